"""When a sleeping engine is woken (deadlines, requests, housekeeping ticks), and which held
deadlines it wakes for."""

from __future__ import annotations

import queue
import time

import pytest

from kvtether.connector._idle import EngineWaker, HeldDeadlines


def _waker(tick_s: float = 60.0, slack_s: float = 0.0) -> tuple[EngineWaker, queue.Queue[str]]:
    posted: queue.Queue[str] = queue.Queue()
    return EngineWaker(lambda: posted.put("wake"), tick_s=tick_s, slack_s=slack_s), posted


def test_nothing_held_never_wakes_the_engine() -> None:
    waker, posted = _waker(tick_s=0.05)
    waker.start()
    try:
        waker.arm(None)
        with pytest.raises(queue.Empty):
            posted.get(timeout=0.3)
        assert not waker.step_requested()
    finally:
        waker.close()


def test_wakes_at_the_earliest_armed_deadline() -> None:
    waker, posted = _waker()
    waker.start()
    try:
        deadline = time.perf_counter() + 0.2
        waker.arm(deadline)
        posted.get(timeout=5)
        assert time.perf_counter() >= deadline
        assert waker.step_requested() and waker.wakeups["deadline"] == 1
        waker.take_step()
        assert not waker.step_requested()
    finally:
        waker.close()


def test_a_new_earlier_deadline_rearms_the_sleeping_thread() -> None:
    waker, posted = _waker()
    waker.start()
    try:
        waker.arm(time.perf_counter() + 3600)
        time.sleep(0.05)  # the thread now sleeps towards the far deadline
        waker.arm(time.perf_counter() + 0.1)
        posted.get(timeout=5)
        assert waker.wakeups["deadline"] == 1
    finally:
        waker.close()


def test_ticks_while_kv_is_held_and_counts_steps() -> None:
    waker, posted = _waker(tick_s=0.1)
    waker.start()
    try:
        waker.arm(time.perf_counter() + 3600)
        for _ in range(2):
            posted.get(timeout=5)
            assert waker.step_requested()
            waker.take_step()  # the engine served the tick; the next one is tick_s later
        assert waker.wakeups["tick"] >= 2 and waker.steps == 2
    finally:
        waker.close()


def test_request_step_wakes_at_once_from_any_thread() -> None:
    waker, posted = _waker()
    waker.request_step("control")
    assert posted.get_nowait() == "wake"
    assert waker.step_requested() and waker.wakeups["control"] == 1


def test_close_stops_the_thread_and_a_failing_wake_ends_it_quietly() -> None:
    def broken() -> None:
        raise RuntimeError("engine gone")

    waker = EngineWaker(broken, tick_s=0.01, slack_s=0.0).start()
    waker.arm(time.perf_counter())
    time.sleep(0.2)
    waker.close()
    assert waker._thread is not None and not waker._thread.is_alive()


def test_bad_tick_is_refused() -> None:
    with pytest.raises(ValueError, match="tick_s"):
        EngineWaker(lambda: None, tick_s=0)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_held_deadlines_wake_the_engine_until_a_little_past_due() -> None:
    clock = _Clock()
    held = HeldDeadlines(past_due_s=2.0, clock=clock)
    assert held.earliest() is None and not held.just_passed()
    held.update({"a": 1010.0, "b": 1005.0})
    assert held.earliest() == 1005.0 and not held.just_passed()
    clock.now = 1006.0  # b's deadline passed: a step lets the worker free it
    assert held.just_passed() and held.earliest() == 1005.0
    clock.now = 1007.5  # not freed in the steps after: only the housekeeping tick retries
    assert held.earliest() == 1010.0
    held.freed(["a", "unknown"])
    assert held.earliest() is None


def test_a_renewed_deadline_replaces_the_old_one() -> None:
    held = HeldDeadlines(clock=_Clock())
    held.update({"a": 1005.0})
    held.update({"a": 1090.0})
    assert held.earliest() == 1090.0
