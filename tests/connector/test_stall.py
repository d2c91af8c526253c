"""A worker step that does not end is reported once, with every thread's stack."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from kvtether.connector._stall import StepWatch, thread_stacks


def _wait_for(cond, timeout_s: float = 5.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_step_longer_than_the_limit_is_reported_once() -> None:
    reported: list[float] = []
    watch = StepWatch(0.1, report=reported.append)
    try:
        watch.begin()
        _wait_for(lambda: reported)
        time.sleep(0.3)
        assert len(reported) == 1 and reported[0] >= 0.1  # once per stall, not every 0.1 s
        watch.end()
        watch.begin()  # the next stall is reported again
        _wait_for(lambda: len(reported) == 2)
        watch.end()
    finally:
        watch.close()


def test_steps_that_end_in_time_are_never_reported() -> None:
    reported: list[float] = []
    watch = StepWatch(0.2, report=reported.append)
    try:
        for _ in range(20):
            watch.begin()
            time.sleep(0.02)
            watch.end()
        time.sleep(0.4)  # idle between steps is not a step
        assert reported == []
    finally:
        watch.close()


def test_the_report_names_the_stuck_thread_and_its_line(caplog: pytest.LogCaptureFixture) -> None:
    stuck = threading.Event()

    def hung_in_nixl() -> None:  # stands in for a call that never returns
        stuck.wait(10)

    t = threading.Thread(target=hung_in_nixl, name="worker-main", daemon=True)
    t.start()
    watch = StepWatch(0.1)
    try:
        with caplog.at_level(logging.WARNING, logger="kvtether.connector._stall"):
            watch.begin()
            _wait_for(lambda: watch.reports == 1)
            _wait_for(lambda: "threads are at" in caplog.text)
            watch.end()
        assert "--- thread worker-main" in caplog.text and "hung_in_nixl" in caplog.text
        assert "ended after" in caplog.text
    finally:
        stuck.set()
        watch.close()


def test_a_failing_report_does_not_stop_the_watch() -> None:
    calls: list[float] = []

    def report(s: float) -> None:
        calls.append(s)
        raise RuntimeError("logging is broken")

    watch = StepWatch(0.05, report=report)
    try:
        watch.begin()
        _wait_for(lambda: len(calls) == 1)
        watch.end()
        watch.begin()
        _wait_for(lambda: len(calls) == 2)
    finally:
        watch.close()


def test_thread_stacks_lists_this_thread() -> None:
    assert "test_thread_stacks_lists_this_thread" in thread_stacks()


class _Watch:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def begin(self) -> None:
        self.calls.append("begin")

    def end(self) -> None:
        self.calls.append("end")


def test_every_step_of_the_connector_begins_and_ends_the_watch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM binds a step's metadata first and asks for its transfer results last (also on a
    step with no forward pass): that pair brackets the watch, even when the last call raises."""
    pytest.importorskip("vllm")
    from kvtether.connector.nixl import KVTetherWorker, NixlConnector

    worker = object.__new__(KVTetherWorker)
    worker._step_watch = _Watch()
    connector = object.__new__(NixlConnector)
    connector.connector_worker = worker
    results = object()
    parent = KVTetherWorker.__mro__[1]
    monkeypatch.setattr(parent, "get_transfer_results", lambda self: results)
    connector.bind_connector_metadata(object())
    assert worker.get_transfer_results() is results
    # upstream's legacy get_finished goes through get_transfer_results: one end, not two
    monkeypatch.setattr(parent, "get_transfer_results",
                        lambda self: (_ for _ in ()).throw(RuntimeError("nixl")))
    connector.bind_connector_metadata(object())
    with pytest.raises(RuntimeError):
        worker.get_transfer_results()
    assert worker._step_watch.calls == ["begin", "end", "begin", "end"]
