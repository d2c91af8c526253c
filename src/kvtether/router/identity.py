"""Which conversation a request belongs to: kvtether's own headers, the body field, or the
session headers coding-agent harnesses already send.

One precedence, first match wins (documented in ``docs/router.md``):

1. ``X-Conversation-Id`` (kvtether), with ``X-Parent-Conversation-Id``.
2. ``X-Session-Id`` (kvtether's alias; OpenCode sends it), with ``X-Parent-Session-Id``.
3. The body's ``conversation_id`` (vLLM's multi-turn benchmark).
4. Claude Code: ``X-Claude-Code-Session-Id``. A request that also carries
   ``X-Claude-Code-Agent-Id`` comes from a subagent, which is its own conversation
   ``<session>:agent:<agent id>``, linked to its parent: the agent named by
   ``X-Claude-Code-Parent-Agent-Id``, else the session's main conversation.
5. Codex: ``thread-id`` / ``thread_id`` (newer builds), else ``session-id`` / ``session_id``;
   a spawned thread names its parent in ``x-codex-parent-thread-id``.

``X-KVTether-End: true`` on a request says it is the conversation's last turn: what the turn
retains is released as soon as it is answered (the same as a ``final`` phase hint).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtether import protocol as p
from kvtether.router._errors import RouterHTTPError

__all__ = ["AgentIdentity", "identify"]


# (conversation header, parent header) pairs, in precedence order after the body field.
_OWN = (
    (p.HEADER_CONVERSATION_ID, p.HEADER_PARENT_CONVERSATION_ID),
    (p.CONVERSATION_ID_HEADER_ALIASES[0], "X-Parent-Session-Id"),
)
_CLAUDE_SESSION = "X-Claude-Code-Session-Id"
_CLAUDE_AGENT = "X-Claude-Code-Agent-Id"
_CLAUDE_PARENT_AGENT = "X-Claude-Code-Parent-Agent-Id"
_CODEX_THREAD = ("thread-id", "thread_id")
_CODEX_SESSION = ("session-id", "session_id")
_CODEX_PARENT = "x-codex-parent-thread-id"
_TRUE = {"1", "true", "yes"}


@dataclass(frozen=True)
class AgentIdentity:
    conversation_id: str | None
    parent_id: str | None = None
    source: str | None = None  # the header or body field the id came from
    end: bool = False


def identify(headers: Mapping[str, str], body: dict[str, Any]) -> AgentIdentity:
    """The request's conversation, its parent and whether it ends the conversation.

    ``headers``: case-insensitive (Starlette's). Raises a 400 :class:`RouterHTTPError` naming
    the header when an id breaks the conversation-id rule.
    """
    end_value = headers.get(p.HEADER_END)
    end = end_value is not None and end_value.strip().lower() in _TRUE
    if end_value is not None and not end and end_value.strip().lower() not in {"0", "false", "no"}:
        raise RouterHTTPError(400, f"{p.HEADER_END} must be 'true' or 'false'",
                              param=p.HEADER_END)
    for header, parent_header in _OWN:
        value = headers.get(header)
        if value is not None:
            return AgentIdentity(_checked(value, header),
                                 _parent(headers, parent_header), header, end)
    if p.BODY_CONVERSATION_ID in body:
        value = body[p.BODY_CONVERSATION_ID]
        return AgentIdentity(_checked(value, p.BODY_CONVERSATION_ID),
                             _parent(headers, p.HEADER_PARENT_CONVERSATION_ID),
                             p.BODY_CONVERSATION_ID, end)
    session = headers.get(_CLAUDE_SESSION)
    if session is not None:
        session = _checked(session, _CLAUDE_SESSION)
        agent = headers.get(_CLAUDE_AGENT)
        if agent is None or not agent.strip():
            return AgentIdentity(session, None, _CLAUDE_SESSION, end)
        parent_agent = headers.get(_CLAUDE_PARENT_AGENT)
        parent = (_agent_conversation(session, parent_agent, _CLAUDE_PARENT_AGENT)
                  if parent_agent and parent_agent.strip() else session)
        return AgentIdentity(_agent_conversation(session, agent, _CLAUDE_AGENT), parent,
                             _CLAUDE_AGENT, end)
    for names in (_CODEX_THREAD, _CODEX_SESSION):
        for name in names:
            value = headers.get(name)
            if value is not None:
                return AgentIdentity(_checked(value, name), _parent(headers, _CODEX_PARENT),
                                     name, end)
    return AgentIdentity(None, None, None, end)


def _agent_conversation(session: str, agent: str, source: str) -> str:
    return _checked(f"{session}:agent:{agent.strip()}", source)


def _parent(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None or not value.strip():
        return None
    return _checked(value, name)


def _checked(value: Any, source: str) -> str:
    value = value.strip() if isinstance(value, str) else value
    problem = p.conversation_id_problem(value)
    if problem is not None:
        hint = ("; derive one from your own id with kvtether.session.conversation_id_from()"
                if "characters [" in problem else "")
        raise RouterHTTPError(400, f"{source} {problem}{hint}", param=source)
    return str(value)
