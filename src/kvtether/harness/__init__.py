"""Hooks that let coding-agent harnesses keep their conversation's KV on the kvtether router.

Claude Code and OpenCode send no heartbeats, but run hooks around each tool call. With one
command (``kvtether hook install claude-code`` / ``opencode``), they heartbeat the
conversation's lease while a tool runs and release its KV when the session ends
(docs/coding-agents.md):

* :mod:`.claude_code`: the Claude Code hook (``python -m kvtether.harness claude-code``, or
  ``kvtether hook claude-code``), one event on stdin per run;
* ``_beater``: the detached process that heartbeats while one tool runs, ``_state``: the marker
  files that tell it when the tool ended, ``_router``: the two session-API calls;
* ``opencode-plugin.js``: the OpenCode plugin (in OpenCode's own process: no beater);
* :mod:`.install`: writes either into the harness's configuration; :mod:`.commands`: the
  ``kvtether hook`` CLI.

A hook is a process per event, and Claude Code waits for the foreground ones, so the hook
loads nothing beyond the standard library (kvtether.protocol and httpx would double its
start-up). The package never imports the router or the connector.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtether.harness._settings import HookSettings

__all__ = ["HookSettings", "Installed", "install_claude_code", "install_opencode"]

_INSTALL_NAMES = frozenset({"Installed", "install_claude_code", "install_opencode"})

if TYPE_CHECKING:
    from kvtether.harness.install import Installed, install_claude_code, install_opencode


def __getattr__(name: str) -> Any:  # the installer is not needed by the hook itself
    if name in _INSTALL_NAMES:
        from kvtether.harness import install

        return getattr(install, name)
    raise AttributeError(f"module 'kvtether.harness' has no attribute {name!r}")
