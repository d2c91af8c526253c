"""``KVTetherHooks``: ``RunHooks`` that keep a conversation's KV alive while a function tool runs.

``on_tool_start`` finds the session from the ``tool_call_id`` of the model reply that asked
for the tool and starts its heartbeats; ``on_tool_end`` stops them. A tool whose end hook never
came is closed at its conversation's next model call. Your own hooks still get every event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agents import RunHooks

if TYPE_CHECKING:
    from kvtether_openai_agents._provider import KVTetherProvider

__all__ = ["KVTetherHooks"]


class KVTetherHooks(RunHooks[Any]):
    """``hooks=provider.hooks`` or ``hooks=KVTetherHooks(provider, wrapped=your_hooks)``."""

    def __init__(self, provider: KVTetherProvider, wrapped: RunHooks[Any] | None = None) -> None:
        self._provider = provider
        self._wrapped = wrapped

    async def on_tool_start(self, context: Any, agent: Any, tool: Any) -> None:
        await self._provider._tool_started(
            getattr(context, "tool_call_id", None),
            getattr(tool, "name", type(tool).__name__),
            getattr(context, "tool_arguments", None),
        )
        if self._wrapped is not None:
            await self._wrapped.on_tool_start(context, agent, tool)

    async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: Any) -> None:
        try:
            if self._wrapped is not None:
                await self._wrapped.on_tool_end(context, agent, tool, result)
        finally:
            await self._provider._tool_ended(getattr(context, "tool_call_id", None))


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
