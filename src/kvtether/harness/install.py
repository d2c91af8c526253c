"""``kvtether hook install``: register kvtether's hooks with a harness, idempotently.

* Claude Code: a ``hooks`` block in a settings file (default ``~/.claude/settings.json``, or
  ``$CLAUDE_CONFIG_DIR/settings.json``), merged into what is there: kvtether's earlier entries
  are replaced, everything else is kept.
* OpenCode: the plugin file ``opencode-plugin.js`` copied to ``<dir>/kvtether.js`` (default
  ``~/.config/opencode/plugins``; a project's is ``.opencode/plugins``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from kvtether.errors import ConfigError
from kvtether.harness.claude_code import SESSION_END, SUBAGENT_END, TOOL_END, TOOL_START

__all__ = [
    "Installed", "claude_code_command", "claude_code_hooks", "default_claude_settings",
    "default_opencode_dir", "install_claude_code", "install_opencode",
]

PLUGIN_RESOURCE = "opencode-plugin.js"
PLUGIN_NAME = "kvtether.js"
HOOK_TIMEOUT_S = 10
# A command of ours, whichever way it was written: replaced on every install.
_OURS = re.compile(r"kvtether(\.harness| hook) claude-code\b")


@dataclass(frozen=True)
class Installed:
    path: Path
    changed: bool  # False: it was installed like this already

    def __str__(self) -> str:
        return f"{'installed in' if self.changed else 'already installed in'} {self.path}"


def default_claude_settings() -> Path:
    config = os.environ.get("CLAUDE_CONFIG_DIR")
    return (Path(config) if config else Path.home() / ".claude") / "settings.json"


def default_opencode_dir() -> Path:
    config = os.environ.get("XDG_CONFIG_HOME")
    return (Path(config) if config else Path.home() / ".config") / "opencode" / "plugins"


def claude_code_command() -> str:
    """This interpreter running the hook: no PATH lookup, and none of the CLI's start-up."""
    return f"{shlex.quote(sys.executable)} -m kvtether.harness claude-code"


def claude_code_hooks(command: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """The ``hooks`` entries, by event. The tool-start hook runs in the background
    (``async``: it only starts a beater); the tool-end hook runs in the foreground, so that
    its beater has stopped before the harness sends its next request; the subagent's release
    in the background; the session's release in the foreground (a DELETE, milliseconds), since
    a harness that exits does not wait for its background hooks (`claude -p`)."""
    command = command or claude_code_command()

    def entry(run_async: bool) -> dict[str, Any]:
        hook: dict[str, Any] = {"type": "command", "command": command, "timeout": HOOK_TIMEOUT_S}
        if run_async:
            hook["async"] = True
        return {"hooks": [hook]}

    hooks = {TOOL_START: [{"matcher": "*", **entry(True)}]}
    hooks |= {event: [{"matcher": "*", **entry(False)}] for event in TOOL_END}
    hooks |= {SUBAGENT_END: [entry(True)], SESSION_END: [entry(False)]}
    return hooks


def _without_ours(groups: Any) -> list[Any]:
    kept = []
    for group in groups if isinstance(groups, list) else []:
        if isinstance(group, dict) and isinstance(group.get("hooks"), list):
            hooks = [h for h in group["hooks"]
                     if not (isinstance(h, dict) and _OURS.search(str(h.get("command", ""))))]
            if not hooks:
                continue
            group = {**group, "hooks": hooks}
        kept.append(group)
    return kept


def install_claude_code(settings_path: Path | None = None,
                        command: str | None = None) -> Installed:
    """Merge kvtether's hooks into a Claude Code settings file (created if missing)."""
    path = settings_path or default_claude_settings()
    try:
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        settings = json.loads(text) if text.strip() else {}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path} as JSON ({exc}); fix it, or pass --settings "
                          "another file") from None
    if not isinstance(settings, dict) or not isinstance(settings.get("hooks", {}), dict):
        raise ConfigError(f"{path} is not a Claude Code settings file (an object whose "
                          "'hooks' is an object); pass --settings another file")
    hooks = dict(settings.get("hooks", {}))
    for event in list(hooks):
        hooks[event] = _without_ours(hooks[event])
        if not hooks[event]:
            del hooks[event]
    for event, groups in claude_code_hooks(command).items():
        hooks[event] = [*hooks.get(event, []), *groups]
    new = json.dumps({**settings, "hooks": hooks}, indent=2) + "\n"
    if new == text:
        return Installed(path, changed=False)
    _write(path, new)
    return Installed(path, changed=True)


def install_opencode(directory: Path | None = None) -> Installed:
    """Copy the OpenCode plugin to ``<directory>/kvtether.js``."""
    target = (directory or default_opencode_dir()) / PLUGIN_NAME
    source = resources.files("kvtether.harness").joinpath(PLUGIN_RESOURCE).read_text("utf-8")
    if target.exists() and target.read_text(encoding="utf-8") == source:
        return Installed(target, changed=False)
    _write(target, source)
    return Installed(target, changed=True)


def _write(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.kvtether-tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc}") from None
