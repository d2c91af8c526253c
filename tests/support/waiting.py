"""Waiting for an event instead of for a fixed time.

Tests poll a condition until it holds, so a busy machine makes them slower, never flaky; a
condition that never holds fails the test after ``timeout_s`` with ``message``.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

Message = str | Callable[[], object] | None


def _timed_out(condition: Callable[[], object], timeout_s: float,
               message: Message) -> AssertionError:
    said = message() if callable(message) else message
    return AssertionError(f"timed out after {timeout_s} s waiting for "
                          f"{said if said is not None else condition}")


def wait_for(condition: Callable[[], T], timeout_s: float = 10.0, interval_s: float = 0.01,
             message: Message = None) -> T:
    """Call ``condition()`` every ``interval_s`` until it returns something true, and return
    that. After ``timeout_s`` raise :class:`AssertionError` saying ``message`` (a string, or a
    callable asked only then, e.g. for a log's tail). An exception ``condition`` raises (an
    ``assert`` that something went wrong for good) ends the wait at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(condition, timeout_s, message)
        time.sleep(interval_s)


async def await_for(condition: Callable[[], Any], timeout_s: float = 10.0,
                    interval_s: float = 0.01, message: Message = None) -> Any:
    """:func:`wait_for` on an event loop: sleeps with ``asyncio.sleep``, so the tasks the test
    waits on keep running; ``condition`` may be a coroutine function."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(condition, timeout_s, message)
        await asyncio.sleep(interval_s)
