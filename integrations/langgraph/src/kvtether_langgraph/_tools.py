"""Finding the session a tool run belongs to, and ``KVTetherCallbackHandler``.

A tool's session is the one whose model reply asked for it (``pool.session_for_tool_call``),
else the session of the tool's LangGraph thread. A tool with neither is not followed.
"""

from __future__ import annotations

import logging
import threading
from typing import Any
from uuid import UUID

from kvtether.session import AsyncSession, AsyncSessionPool, Session, SessionPool, ToolCall
from langchain_core.callbacks import BaseCallbackHandler

from kvtether_langgraph._thread import current_thread_id, thread_id_of

__all__ = ["KVTetherCallbackHandler", "session_for_tool"]

logger = logging.getLogger(__name__)

Pool = SessionPool | AsyncSessionPool


def session_for_tool(
    pool: Pool, tool_call_id: str | None, thread_id: str | None
) -> Session | AsyncSession | None:
    """The session of a tool run, or None when neither its call id nor its thread is known."""
    if tool_call_id:
        session = pool.session_for_tool_call(tool_call_id)
        if session is not None:
            return session
    if thread_id is None:
        thread_id = current_thread_id()
    return None if thread_id is None else pool.get(thread_id)


class KVTetherCallbackHandler(BaseCallbackHandler):
    """Heartbeats the lease of a thread's KV while each of its tools runs.

    For graphs that run tools without ``KVTetherMiddleware`` (``create_react_agent``,
    ``ToolNode``, hand-built graphs): pass it in the run's config, e.g.
    ``graph.invoke(inputs, {"configurable": {"thread_id": t}, "callbacks": [handler]})``.
    One handler serves every thread and run: ``ToolNode`` runs parallel tool calls in worker
    threads, so its state is keyed by the tool run's id, behind a lock. It never raises into
    the graph; a tool's own exception reaches the graph unchanged.
    """

    raise_error = False
    # Called in the event loop's thread for async tools, in order, instead of an executor.
    run_inline = True

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self._lock = threading.Lock()
        self._runs: dict[UUID, ToolCall] = {}

    def on_tool_start(
        self,
        serialized: dict[str, Any] | None,
        input_str: str,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        tags: list[str] | None = None,
        metadata: dict[str, Any] | None = None,
        inputs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        session = session_for_tool(
            self.pool, kwargs.get("tool_call_id"), thread_id_of({"metadata": metadata})
        )
        if session is None:
            return
        name = kwargs.get("name") or (serialized or {}).get("name") or "tool"
        call = session.tool_call(str(name), args=inputs if inputs is not None else input_str)
        call.__enter__()
        with self._lock:
            self._runs[run_id] = call

    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._finish(run_id, None)

    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._finish(run_id, error)

    def _finish(self, run_id: UUID, error: BaseException | None) -> None:
        with self._lock:
            call = self._runs.pop(run_id, None)
        if call is not None:
            call.__exit__(None if error is None else type(error), error, None)

    @property
    def running(self) -> int:
        """How many tool runs are being heartbeated now."""
        with self._lock:
            return len(self._runs)
