"""A worker step that does not end is reported once, with every thread's stack."""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

import pytest

from kvtether.connector._stall import StepWatch, thread_stacks
from tests.support.waiting import wait_for


def test_a_step_longer_than_the_limit_is_reported_once() -> None:
    reported: list[float] = []
    watch = StepWatch(0.1, report=reported.append)
    try:
        watch.begin()
        wait_for(lambda: reported)
        time.sleep(0.3)
        assert len(reported) == 1 and reported[0] >= 0.1  # once per stall, not every 0.1 s
        watch.end()
        watch.begin()  # the next stall is reported again
        wait_for(lambda: len(reported) == 2)
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
            wait_for(lambda: watch.reports == 1)
            wait_for(lambda: "threads are at" in caplog.text)
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
        wait_for(lambda: len(calls) == 1)
        watch.end()
        watch.begin()
        wait_for(lambda: len(calls) == 2)
    finally:
        watch.close()


def test_thread_stacks_lists_this_thread() -> None:
    assert "test_thread_stacks_lists_this_thread" in thread_stacks()


class _Native:
    def __init__(self) -> None:
        self.armed: list[float] = []
        self.cancelled = 0

    def arm(self, seconds: float) -> None:
        self.armed.append(seconds)

    def cancel(self) -> None:
        self.cancelled += 1


def test_the_native_watchdog_is_kept_armed_while_steps_run_and_cancelled_when_idle() -> None:
    native = _Native()
    watch = StepWatch(0.4, report=lambda s: None, native=native)  # ticks every 0.1 s
    try:
        for _ in range(30):  # 0.6 s of short steps
            watch.begin()
            time.sleep(0.01)
            watch.end()
            time.sleep(0.01)
        assert watch.native_armed
        assert len(native.armed) >= 3  # armed by the first begin, re-armed by the thread
        assert all(s == 0.4 for s in native.armed)
        wait_for(lambda: not watch.native_armed)  # idle: cancelled
        assert native.cancelled == len(native.armed)
        armed = len(native.armed)
        watch.begin()  # the first step after idle arms it again, from the step's thread
        assert len(native.armed) == armed + 1
        watch.end()
    finally:
        watch.close()


def test_a_step_stuck_with_python_running_is_reported_from_python_not_natively() -> None:
    native = _Native()
    reported: list[float] = []
    watch = StepWatch(0.3, report=reported.append, native=native)
    try:
        watch.begin()
        wait_for(lambda: reported)
        assert not watch.native_armed and native.cancelled == len(native.armed)
        watch.end()
    finally:
        watch.close()


def test_a_call_holding_the_gil_is_reported_by_the_native_watchdog(tmp_path: Path) -> None:
    """A C call that blocks with the GIL held freezes every Python thread: faulthandler's
    watchdog (a C thread) still writes where the worker is."""
    import subprocess
    import textwrap

    script = textwrap.dedent("""
        import ctypes, time
        from kvtether.connector._stall import FaulthandlerWatchdog, StepWatch
        watch = StepWatch(0.4, report=lambda s: None, native=FaulthandlerWatchdog())
        def stuck_in_nixl():
            ctypes.PyDLL(None).sleep(2)  # PyDLL: the GIL stays held
        watch.begin()
        stuck_in_nixl()
        watch.end()
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Timeout (0:00:00.400000)!" in r.stderr, r.stderr
    assert "stuck_in_nixl" in r.stderr


def test_one_watch_per_process_and_the_connector_defers_to_the_whole_rpc_watch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvtether.connector import _stall

    monkeypatch.setattr(_stall, "_process_watch", None)
    monkeypatch.setattr(_stall, "_rpcs_watched", False)
    created: list[StepWatch] = []
    monkeypatch.setattr(_stall, "StepWatch",
                        lambda after_s, native: created.append(object()) or created[-1])
    assert not _stall.rpcs_watched()
    first = _stall.process_watch(60.0)
    assert _stall.watch_whole_rpcs(60.0) is first and _stall.rpcs_watched()
    assert len(created) == 1
