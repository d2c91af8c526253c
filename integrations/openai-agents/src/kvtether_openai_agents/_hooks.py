"""``KVTetherHooks``: ``RunHooks`` that keep a conversation's KV alive while a function tool runs.

``on_tool_start`` finds the session from the ``tool_call_id`` of the model reply that asked
for the tool and starts its heartbeats; ``on_tool_end`` stops them. A tool whose end hook never
came is closed at its conversation's next model call. Your own hooks still get every event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agents.lifecycle import RunHooks

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

    async def on_llm_start(self, *args: Any) -> None:
        if self._wrapped is not None:
            await self._wrapped.on_llm_start(*args)

    async def on_llm_end(self, *args: Any) -> None:
        if self._wrapped is not None:
            await self._wrapped.on_llm_end(*args)

    async def on_agent_start(self, *args: Any) -> None:
        if self._wrapped is not None:
            await self._wrapped.on_agent_start(*args)

    async def on_agent_end(self, *args: Any) -> None:
        if self._wrapped is not None:
            await self._wrapped.on_agent_end(*args)

    async def on_handoff(self, *args: Any) -> None:
        if self._wrapped is not None:
            await self._wrapped.on_handoff(*args)
