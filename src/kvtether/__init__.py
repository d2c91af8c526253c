"""kvtether: keep an agent's KV cache tethered to its conversation on disaggregated vLLM.

``import kvtether`` stays light: the session layer (pydantic, httpx) loads on first use of
``kvtether.Session`` / ``kvtether.AsyncSession`` or a session pool; the OpenAI SDK only inside
``wrap``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtether.errors import KVTetherError

__version__ = "0.1.0"

__all__ = [
    "Session",
    "AsyncSession",
    "SessionPool",
    "AsyncSessionPool",
    "KVTetherError",
    "__version__",
]

_SESSION_NAMES = frozenset({"Session", "AsyncSession", "SessionPool", "AsyncSessionPool"})

if TYPE_CHECKING:
    from kvtether.session import AsyncSession, AsyncSessionPool, Session, SessionPool


def __getattr__(name: str) -> Any:
    if name in _SESSION_NAMES:
        from kvtether import session

        return getattr(session, name)
    raise AttributeError(f"module 'kvtether' has no attribute {name!r}")
