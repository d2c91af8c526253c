"""kvtether's client side: tether an agent conversation to its KV on a kvtether router.

    from kvtether import Session

    with Session(base_url="http://127.0.0.1:8000") as session:
        client = session.wrap(OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-"))

        @session.tool
        def run_tests(target: str) -> str: ...

        ...  # the agent loop, unchanged
        print(session.report())

Async code uses ``AsyncSession`` the same way (``async with``, ``await session.aclose()``).
Many conversations through one client (framework threads): ``SessionPool`` / ``AsyncSessionPool``.
"""

from kvtether.errors import (
    ConfigError,
    MissingConversationKeyWarning,
    PrefixBreakWarning,
    RouterUnavailableError,
    SessionError,
    SessionGoneError,
    SessionNotFoundError,
)
from kvtether.session._ids import conversation_id_from, new_conversation_id
from kvtether.session._predict import GrowthPredictor, Prediction, tool_key
from kvtether.session._prefix import keep_prefix_stable, normalize_message
from kvtether.session._records import (
    EventKind,
    PrefixCheck,
    PrefixStatus,
    SessionEvent,
    SessionTotals,
    ToolRun,
    Turn,
)
from kvtether.session._pool import AsyncSessionPool, SessionPool
from kvtether.session._session import AsyncSession, Session
from kvtether.session._settings import SessionSettings
from kvtether.session._tools import ToolCall

__all__ = [
    "Session",
    "AsyncSession",
    "SessionPool",
    "AsyncSessionPool",
    "SessionSettings",
    "ToolCall",
    "Turn",
    "ToolRun",
    "SessionEvent",
    "SessionTotals",
    "EventKind",
    "PrefixCheck",
    "PrefixStatus",
    "PrefixBreakWarning",
    "MissingConversationKeyWarning",
    "ConfigError",
    "RouterUnavailableError",
    "SessionError",
    "SessionNotFoundError",
    "SessionGoneError",
    "GrowthPredictor",
    "Prediction",
    "tool_key",
    "conversation_id_from",
    "new_conversation_id",
    "keep_prefix_stable",
    "normalize_message",
]
