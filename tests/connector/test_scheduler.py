"""IdleSleepScheduler in a real vLLM 0.32 scheduler (simulated worker): the engine reports no
work while it only holds KV for a remote reader, and is woken for exactly what needs a step."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import EngineCoreRequestType  # noqa: E402

from kvtether.connector import scheduler as idle_scheduler  # noqa: E402
from kvtether.connector._leases import Released, Renewed  # noqa: E402
from kvtether.connector.scheduler import IdleSleepScheduler  # noqa: E402
from kvtether.protocol import LeaseInfo, LeaseState  # noqa: E402

from .harness import Harness, finish_decode_turn  # noqa: E402

WAKEUP = (EngineCoreRequestType.WAKEUP, None)


@pytest.fixture
def inputs(monkeypatch: pytest.MonkeyPatch) -> queue.Queue[Any]:
    """Stands in for EngineCoreProc.input_queue, which the scheduler finds in a caller frame."""
    q: queue.Queue[Any] = queue.Queue()
    monkeypatch.setattr(idle_scheduler, "_engine_input_queue", lambda: q)
    return q


def _harness(tmp: Path, **extra: Any) -> Harness:
    return Harness(tmp, scheduler_cls=IdleSleepScheduler,
                   extra={"kvtether_lease_ttl_s": 30, "kvtether_idle_tick_s": 3600, **extra})


@pytest.fixture
def h(tmp_path: Path, inputs: queue.Queue[Any]) -> Iterator[Harness]:
    harness = _harness(tmp_path)
    yield harness
    harness.scheduler.shutdown()  # stops the waker thread


def _settle(h: Harness) -> None:
    """Step until only retained KV is left (the finished turn's bookkeeping step)."""
    for _ in range(5):
        if not h.scheduler.has_requests():
            return
        h.step()
    raise AssertionError("the engine never ran out of work")


def _woken_op(h: Harness, inputs: queue.Queue[Any], op: Any) -> Any:
    """Run a control-channel operation against a sleeping engine: it must post a wake-up and
    make the scheduler report work; then one engine step answers it."""
    replies: list[Any] = []
    caller = threading.Thread(target=lambda: replies.append(op()))
    caller.start()
    assert inputs.get(timeout=5) == WAKEUP  # the control channel woke the engine
    assert h.scheduler.has_requests()
    h.step()
    caller.join(timeout=5)
    assert replies, "the operation was not answered by one engine step"
    return replies[0]


def test_retained_kv_alone_lets_the_engine_sleep(h: Harness) -> None:
    finish_decode_turn(h, "d-1", "key-1")
    _settle(h)
    assert "d-1" in h.scheduler.requests  # still held for the next turn's prefill
    assert h.conn.status().totals.active_leases == 1
    # Upstream's answer for the same state is "step again" (every ~1 ms, for the lease).
    assert Scheduler.has_requests(h.scheduler)
    assert not h.scheduler.has_requests()
    assert h.conn.next_deadline() == pytest.approx(time.perf_counter() + 30, abs=1)


def test_a_release_wakes_the_engine_and_frees_in_one_step(
    h: Harness, inputs: queue.Queue[Any]
) -> None:
    finish_decode_turn(h, "d-1", "key-1")
    _settle(h)
    free_before = h.free_blocks()
    reply = _woken_op(h, inputs, lambda: h.conn.leases.release("key-1"))
    assert isinstance(reply, Released) and reply.info.state is LeaseState.RELEASED
    assert "d-1" not in h.scheduler.requests and h.free_blocks() > free_before
    assert not h.scheduler.has_requests()  # back to sleep, nothing held
    assert h.conn.next_deadline() is None


def test_a_renewal_wakes_the_engine_for_one_step(h: Harness, inputs: queue.Queue[Any]) -> None:
    finish_decode_turn(h, "d-1", "key-1")
    _settle(h)
    reply = _woken_op(h, inputs, lambda: h.conn.leases.renew("key-1", 90))
    assert isinstance(reply, Renewed)
    # The worker's own deadline is later by the slack: the engine loop ends the lease.
    slack = h.conn.leases.worker_slack_s
    assert h.worker.deadlines["d-1"] - time.perf_counter() == pytest.approx(90 + slack, abs=1)
    assert not h.scheduler.has_requests()
    assert h.conn.next_deadline() == pytest.approx(time.perf_counter() + 90, abs=1)


def test_an_expiring_lease_wakes_the_sleeping_engine_at_its_deadline(
    h: Harness, inputs: queue.Queue[Any]
) -> None:
    finish_decode_turn(h, "d-1", "key-1", kvtether_lease_ttl_s=0.5)
    _settle(h)
    deadline = h.conn.next_deadline()
    assert deadline is not None
    assert inputs.get(timeout=5) == WAKEUP  # nothing else happened: the deadline did
    assert time.perf_counter() >= deadline
    steps = 0
    while h.scheduler.has_requests() and steps < 50:
        h.step()
        steps += 1
        time.sleep(0.01)
    assert "d-1" not in h.scheduler.requests
    info = h.conn.leases.lease("key-1")
    assert isinstance(info, LeaseInfo) and info.state is LeaseState.EXPIRED
    status = h.conn.status()
    assert status.idle is not None and status.idle.wakeups["deadline"] >= 1


def test_a_new_request_keeps_upstream_behaviour(h: Harness) -> None:
    finish_decode_turn(h, "d-1", "key-1")
    _settle(h)
    h.add("d-2", list(range(30, 40)), None, max_tokens=2)
    assert h.scheduler.has_requests()  # an unfinished request always steps


def test_without_an_engine_queue_the_scheduler_is_upstream(tmp_path: Path) -> None:
    # Built outside vLLM's EngineCoreProc (as here): no queue to post wake-ups to.
    h = _harness(tmp_path)
    try:
        finish_decode_turn(h, "d-1", "key-1")
        h.step()
        assert h.scheduler.has_requests()  # holds KV, so it keeps stepping like upstream
        assert h.conn.status().idle is None
    finally:
        h.scheduler.shutdown()


@pytest.mark.parametrize("cls", [idle_scheduler.TetherScheduler, IdleSleepScheduler])
@pytest.mark.parametrize("async_scheduling", [True, False, None])
def test_the_scheduler_named_is_built_async_where_vllm_would_build_async(
    cls: type, async_scheduling: bool | None,
) -> None:
    """vLLM resolves --scheduler-cls as given, and builds AsyncScheduler itself only when no
    class is named: kvtether's class turns into its AsyncScheduler twin when async
    scheduling is on, so naming it costs no overlap of scheduling with the step before."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    config = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))
    built = cls.__new__(cls, vllm_config=config)  # __init__ needs a whole engine: not run
    assert isinstance(built, cls)
    assert isinstance(built, AsyncScheduler) is bool(async_scheduling)
    if async_scheduling:
        mro = type(built).__mro__
        assert mro.index(cls) < mro.index(AsyncScheduler) < mro.index(Scheduler)
        assert type(cls.__new__(cls, vllm_config=config)) is type(built)  # one twin per class
