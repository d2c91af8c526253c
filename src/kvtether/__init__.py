"""kvtether: keep an agent's KV cache tethered to its conversation on disaggregated vLLM.

``import kvtether`` stays light: the session layer (pydantic, httpx) loads on first use of
``kvtether.Session`` / ``kvtether.AsyncSession``; the OpenAI SDK only inside ``session.wrap``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtether.errors import KVTetherError

__version__ = "0.1.0"

__all__ = ["Session", "AsyncSession", "KVTetherError", "__version__"]

if TYPE_CHECKING:
    from kvtether.session import AsyncSession, Session


def __getattr__(name: str) -> Any:
    if name in ("Session", "AsyncSession"):
        from kvtether import session

        return getattr(session, name)
    raise AttributeError(f"module 'kvtether' has no attribute {name!r}")
