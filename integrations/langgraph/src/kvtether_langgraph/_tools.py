"""Finding the session a tool run belongs to, and ``KVTetherCallbackHandler``.

A tool's session is the one whose model reply asked for it (``pool.session_for_tool_call``),
else the session of the tool's LangGraph thread. A tool with neither is not followed.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from kvtether.session import AsyncSession, AsyncSessionPool, Session, SessionPool
from langchain_core.callbacks import BaseCallbackHandler

from kvtether_langgraph._thread import current_thread_id, thread_id_of

__all__ = ["KVTetherCallbackHandler", "session_for_tool"]

Pool = SessionPool | AsyncSessionPool


def session_for_tool(
    pool: Pool, tool_call_id: str | None, thread_id: str | None
) -> Session | AsyncSession | None:
    """The session of a tool run, or None when neither its call id nor its thread is known."""
    if thread_id is None:
        thread_id = current_thread_id()
    return pool.session_for_tool(tool_call_id, thread_id)


class KVTetherCallbackHandler(BaseCallbackHandler):
    """Heartbeats the lease of a thread's KV while each of its tools runs.

    For graphs that run tools without ``KVTetherMiddleware`` (``create_react_agent``,
    ``ToolNode``, hand-built graphs): pass it in the run's config, e.g.
    ``graph.invoke(inputs, {"configurable": {"thread_id": t}, "callbacks": [handler]})``.
    One handler serves every thread and run: ``ToolNode`` runs parallel tool calls in worker
    threads, so each run is the pool's, under the tool run's id (kvtether's
    ``pool.begin_tool`` / ``pool.end_tool``). It never raises into the graph; a tool's own
    exception reaches the graph unchanged.
    """

    raise_error = False
    # Called in the event loop's thread for async tools, in order, instead of an executor.
    run_inline = True

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

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
        thread_id = thread_id_of({"metadata": metadata})
        name = kwargs.get("name") or (serialized or {}).get("name") or "tool"
        self.pool.begin_tool(
            (_RUN_ID_TAG, run_id), str(name), tool_call_id=kwargs.get("tool_call_id"),
            key=thread_id if thread_id is not None else current_thread_id(),
            args=inputs if inputs is not None else input_str,
        )

    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self.pool.end_tool((_RUN_ID_TAG, run_id))

    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self.pool.end_tool((_RUN_ID_TAG, run_id), error)

    @property
    def running(self) -> int:
        """How many tool runs this handler began are being heartbeated now."""
        return sum(isinstance(r, tuple) and r[:1] == (_RUN_ID_TAG,)
                   for r in self.pool.open_tool_runs())


# Tags this handler's run ids in the pool's registry, which other code may share.
_RUN_ID_TAG = "kvtether_langgraph.callback"
