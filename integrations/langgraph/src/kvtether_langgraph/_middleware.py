"""``KVTetherMiddleware``: kvtether for ``langchain.agents.create_agent`` in one line.

``create_agent(model, tools, middleware=[KVTetherMiddleware(router_url)])``: each model call
goes out through a tethered copy of the agent's ``ChatOpenAI`` (``tether``), tagged with its
LangGraph thread, and each tool call heartbeats that thread's KV while it runs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from cachetools import LRUCache
from kvtether import AsyncSessionPool, SessionPool
from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
from langchain_core.messages import ToolMessage
from langchain_openai import ChatOpenAI
from langgraph.types import Command

from kvtether_langgraph._model import is_tethered, tether
from kvtether_langgraph._thread import thread_id_of
from kvtether_langgraph._tools import session_for_tool

try:  # the type of wrap_tool_call's request, where later langchain 1.x releases export it
    from langchain.agents.middleware import ToolCallRequest
except ImportError:  # langchain 1.0 documents it here
    from langchain.tools.tool_node import ToolCallRequest  # type: ignore[no-redef]

__all__ = ["KVTetherMiddleware"]

logger = logging.getLogger(__name__)

# Distinct models whose tethered copies are kept (an agent has one or a few; a model built per
# call would otherwise pile up).
_TETHERED_MODELS = 32

ToolResult = ToolMessage | Command[Any]


class KVTetherMiddleware(AgentMiddleware):
    """Tethers a ``create_agent`` agent's model calls and tool runs to their thread's KV.

    ``pool``: the ``SessionPool`` (or ``AsyncSessionPool``) of the threads; close it to release
    their KV. Without one, the middleware makes a ``SessionPool(base_url, api_key=api_key)``
    (``base_url``: the kvtether router; None: the model's ``base_url``; ``api_key``: the
    router's key; None: env ``KVTETHER_API_KEY``, else the model's), whose sessions keep their
    KV until the router's lease lapses. Models other than ``ChatOpenAI`` run untethered (logged once).
    """

    def __init__(
        self, pool: SessionPool | AsyncSessionPool | None = None, *, base_url: str | None = None,
        api_key: str | None = None,
    ) -> None:
        super().__init__()
        self.pool: SessionPool | AsyncSessionPool = (
            pool if pool is not None else SessionPool(base_url, api_key=api_key)
        )
        self._lock = threading.Lock()
        # id(model) -> (model, its tethered copy); the model is held so its id stays unique,
        # and the least recently used pairs go, so models made per call are not kept forever.
        self._tethered: LRUCache[int, tuple[Any, Any]] = LRUCache(maxsize=_TETHERED_MODELS)
        self._warned_untethered = False

    # --- model calls ------------------------------------------------------------------------
    def _tethered_request(self, request: ModelRequest) -> ModelRequest:
        model = request.model
        if is_tethered(model):
            return request
        if not isinstance(model, ChatOpenAI):
            with self._lock:
                first, self._warned_untethered = not self._warned_untethered, True
            if first:
                logger.warning(
                    "kvtether: the agent's model is a %s, not a langchain_openai.ChatOpenAI; "
                    "its requests are not tethered to their thread's KV",
                    type(model).__qualname__,
                )
            return request
        with self._lock:
            pair = self._tethered.get(id(model))
            if pair is None:
                pair = self._tethered[id(model)] = (model, tether(model, self.pool))
        return request.override(model=pair[1])

    def wrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]
    ) -> ModelResponse:
        return handler(self._tethered_request(request))

    async def awrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], Awaitable[ModelResponse]]
    ) -> ModelResponse:
        return await handler(self._tethered_request(request))

    # --- tool calls -------------------------------------------------------------------------
    def _session(self, request: ToolCallRequest) -> Any:
        runtime = getattr(request, "runtime", None)
        config = getattr(runtime, "config", None)
        return session_for_tool(self.pool, request.tool_call.get("id"), thread_id_of(config))

    def wrap_tool_call(
        self, request: ToolCallRequest, handler: Callable[[ToolCallRequest], ToolResult]
    ) -> ToolResult:
        session = self._session(request)
        if session is None:
            return handler(request)
        with session.tool_call(request.tool_call["name"], args=request.tool_call.get("args")):
            return handler(request)

    async def awrap_tool_call(
        self,
        request: ToolCallRequest,
        handler: Callable[[ToolCallRequest], Awaitable[ToolResult]],
    ) -> ToolResult:
        session = self._session(request)
        if session is None:
            return await handler(request)
        async with session.tool_call(
            request.tool_call["name"], args=request.tool_call.get("args")
        ):
            return await handler(request)
