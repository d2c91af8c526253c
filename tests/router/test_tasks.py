"""The owner of the router's own tasks (:mod:`kvtether.router.tasks`)."""

from __future__ import annotations

import asyncio

from kvtether.router.tasks import TaskOwner


async def test_a_task_is_held_until_it_ends() -> None:
    owner = TaskOwner()
    gate = asyncio.Event()
    task = owner.start(gate.wait())
    assert len(owner) == 1
    gate.set()
    await task
    await asyncio.sleep(0)
    assert len(owner) == 0


async def test_drain_waits_for_tasks_and_those_they_start_then_cancels_the_rest() -> None:
    owner = TaskOwner()
    done: list[str] = []

    async def second() -> None:
        done.append("second")

    async def first() -> None:
        await asyncio.sleep(0.01)
        owner.start(second())
        done.append("first")

    owner.start(first())
    stuck = owner.start(asyncio.Event().wait())
    await owner.drain(0.1)
    assert done == ["first", "second"]
    assert stuck.cancelled() and len(owner) == 0


async def test_a_failed_task_is_logged_not_raised(caplog) -> None:  # noqa: ANN001
    owner = TaskOwner()

    async def fail() -> None:
        raise RuntimeError("release failed")

    task = owner.start(fail(), name="release")
    await asyncio.wait({task})
    await asyncio.sleep(0)
    assert "release failed" in caplog.text and len(owner) == 0
