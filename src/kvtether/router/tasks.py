"""The tasks a router starts beyond a request (releases nobody waits for, housekeeping): each
belongs to the app's lifespan, which drains them at shutdown."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["TaskOwner"]


class TaskOwner:
    """Starts tasks, holds them until they end (so they are not garbage-collected) and, at
    shutdown, waits for them a bounded time, then cancels what is left."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def start(self, work: Coroutine[Any, Any, Any], *,
              name: str | None = None) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("router task %s failed: %r", task.get_name(), task.exception())

    def __len__(self) -> int:
        return len(self._tasks)

    async def drain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the tasks (those they start meanwhile included), then
        cancel the rest and wait for them to end."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._tasks and (left := deadline - loop.time()) > 0:
            await asyncio.wait(set(self._tasks), timeout=left)
        await self.cancel()

    async def cancel(self) -> None:
        """Cancel every task and wait for them to end."""
        while self._tasks:
            tasks = set(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
