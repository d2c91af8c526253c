"""``KVTetherHooks``: ``RunHooks`` that keep a conversation's KV alive while a function tool runs.

``on_tool_start`` finds the session from the ``tool_call_id`` of the model reply that asked
for the tool and starts its heartbeats; ``on_tool_end`` stops them. A tool whose end hook never
came is closed at its conversation's next model call. Your own hooks still get every event.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from agents import RunHooks
from kvtether.session import AsyncSessionPool

__all__ = ["KVTetherHooks"]


class _HasPool(Protocol):
    """What the hooks take: a :class:`~kvtether_openai_agents.KVTetherProvider` (its sessions)."""

    @property
    def pool(self) -> AsyncSessionPool: ...


class KVTetherHooks(RunHooks[Any]):
    """``hooks=provider.hooks`` or ``hooks=KVTetherHooks(provider, wrapped=your_hooks)``."""

    def __init__(self, provider: _HasPool, wrapped: RunHooks[Any] | None = None) -> None:
        self._pool = provider.pool
        self._wrapped = wrapped

    async def on_tool_start(self, context: Any, agent: Any, tool: Any) -> None:
        tool_call_id = getattr(context, "tool_call_id", None)
        if tool_call_id:
            arguments = getattr(context, "tool_arguments", None)
            try:
                args = json.loads(arguments) if isinstance(arguments, str) else arguments
            except ValueError:
                args = arguments
            # Not followed when its reply came from no tethered request (fallback, another
            # client).
            await self._pool.abegin_tool(tool_call_id, getattr(tool, "name", type(tool).__name__),
                                         tool_call_id=tool_call_id, args=args)
        if self._wrapped is not None:
            await self._wrapped.on_tool_start(context, agent, tool)

    async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: Any) -> None:
        try:
            if self._wrapped is not None:
                await self._wrapped.on_tool_end(context, agent, tool, result)
        finally:
            tool_call_id = getattr(context, "tool_call_id", None)
            if tool_call_id:
                await self._pool.aend_tool(tool_call_id)


def _forwarder(name: str) -> Any:
    async def forward(self: KVTetherHooks, *args: Any, **kwargs: Any) -> None:
        if self._wrapped is not None:
            await getattr(self._wrapped, name)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    return forward


# Every other hook the installed SDK defines goes to your hooks unchanged, so a hook a later
# SDK adds is forwarded too.
for _name in dir(RunHooks):
    if _name.startswith("on_") and _name not in KVTetherHooks.__dict__:
        setattr(KVTetherHooks, _name, _forwarder(_name))
del _name
