"""Conversation keys: the runner's grouping order, derived from the SDK's public arguments.

``Runner.run``'s ``conversation_id``, else its SDK ``Session``'s ``session_id``, else
``RunConfig.group_id``, else one key per run: the order the SDK's runner groups a run's model
calls by (conversation, session, group, run). Blank ids count as absent, as they do there. The
pool hashes each key into the conversation id the router sees, so ids never leave in clear.
"""

from __future__ import annotations

import contextvars
import uuid
from typing import Any

__all__ = ["RUN_KEY", "grouping_key", "new_run_key"]

# The conversation key of the model request being sent now, read by the pool's resolver.
RUN_KEY: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvtether_openai_agents_run_key", default=None
)


def _clean(value: Any) -> str | None:
    if value is None:
        return None
    text = str(value).strip()
    return text or None


def _session_id(session: Any) -> str | None:
    """An SDK ``Session``'s ``session_id`` (public on every ``Session``), or the id itself."""
    if session is None or isinstance(session, str):
        return _clean(session)
    try:
        return _clean(session.session_id)
    except Exception:  # a custom Session whose id cannot be read groups nothing
        return None


def grouping_key(
    *, conversation_id: Any = None, session: Any = None, group_id: Any = None
) -> str | None:
    """The key of the first grouping given, in the runner's order, or None for none."""
    if (value := _clean(conversation_id)) is not None:
        return f"conversation:{value}"
    if (value := _session_id(session)) is not None:
        return f"session:{value}"
    if (value := _clean(group_id)) is not None:
        return f"group:{value}"
    return None


def new_run_key() -> str:
    """The key of a run (or of a ``bind()``) that names no grouping: its own conversation."""
    return f"run:{uuid.uuid4().hex}"
