"""Claude Code's hooks: heartbeat a conversation's KV while its tools run, release it at the end.

``kvtether hook install claude-code`` registers :func:`main` for these events (the fields are
those Claude Code 2.1 sends on stdin; docs/coding-agents.md shows them):

* ``PreToolUse``: mark the tool call running and start a beater (:mod:`._beater`), which
  heartbeats the conversation (phase ``tool_running``) from a second into the tool until it
  ends;
* ``PostToolUse`` / ``PostToolUseFailure``: mark it ended; its beater stops. No renewal: the
  harness sends its next request at once, and the router sizes that answer's lease itself
  (a renewal arriving after it would cut it to ``lease_ttl_s``);
* ``SubagentStop``: release the subagent's conversation;
* ``SessionEnd``: stop every beater of the session and release it and its subagents.

The router's conversation is Claude Code's session id (``X-Claude-Code-Session-Id``), and a
subagent's ``<session>:agent:<agent id>`` (``kvtether.router.identity``): the hook input's
``session_id`` and ``agent_id`` are the same values. Whatever happens (router down, no KV held,
input that is not a hook event), the hook exits 0 and the harness goes on.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from typing import IO, Any

from kvtether.harness import _beater, _state
from kvtether.harness._router import RouterClient
from kvtether.harness._settings import HookSettings

__all__ = ["EVENTS", "conversation_id", "handle", "main"]

logger = logging.getLogger(__name__)

TOOL_START = "PreToolUse"
TOOL_END = ("PostToolUse", "PostToolUseFailure")
SUBAGENT_END = "SubagentStop"
SESSION_END = "SessionEnd"
EVENTS = (TOOL_START, *TOOL_END, SUBAGENT_END, SESSION_END)
# The harness's own process (Claude Code 2.1 gives its hooks CLAUDE_PID): a beater whose
# harness died stops instead of holding the KV for max_lease_s.
HARNESS_PID_ENV = "CLAUDE_PID"


def _text(event: Mapping[str, Any], key: str) -> str | None:
    value = event.get(key)
    return value.strip() if isinstance(value, str) and value.strip() else None


def conversation_id(event: Mapping[str, Any]) -> str | None:
    """The router's conversation for this event: the session, or the subagent it ran in."""
    session = _text(event, "session_id")
    if session is None:
        return None
    agent = _text(event, "agent_id")
    return f"{session}:agent:{agent}" if agent else session


def handle(event: Mapping[str, Any], settings: HookSettings, *,
           env: Mapping[str, str] | None = None) -> None:
    """Act on one hook event. May raise (a full disk, a refused folder): :func:`main` does
    not let it reach the harness."""
    name = event.get("hook_event_name")
    cid = conversation_id(event)
    if cid is None or name not in EVENTS:
        return
    if name == TOOL_START or name in TOOL_END:
        tool_use_id = _text(event, "tool_use_id")
        if tool_use_id is None:
            return
        if name in TOOL_END:
            _state.ended(settings, cid, tool_use_id)
            return
        marker = _state.started(settings, cid, tool_use_id)
        if marker is not None:
            _beater.spawn(settings, cid, marker, _text(event, "tool_name"),
                          _pid((os.environ if env is None else env).get(HARNESS_PID_ENV)))
        return
    client = RouterClient(settings)
    if name == SUBAGENT_END:
        ended = [cid]
    else:  # the session's subagents that ran tools and did not stop, then the session
        session = _text(event, "session_id")
        assert session is not None
        ended = [c for c in _state.session_conversations(settings, session) if c != session]
        ended.append(session)
    for conversation in ended:
        _state.forget(settings, conversation)
        reply = client.release(conversation)
        logger.debug("release %s: %s", conversation, reply.status)


def _pid(raw: str | None) -> int | None:
    return int(raw) if raw and raw.isdigit() and int(raw) > 1 else None


def main(stdin: IO[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Read one hook event from ``stdin`` and act on it; always 0 (exit 2 would block the
    tool call, any other code shows the user an error)."""
    try:
        raw = (sys.stdin if stdin is None else stdin).read()
        event = json.loads(raw) if raw.strip() else None
        if isinstance(event, dict):
            handle(event, HookSettings.from_env(env), env=env)
    except Exception as exc:  # never break the harness: one line where it keeps hook output
        print(f"kvtether hook: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 0
