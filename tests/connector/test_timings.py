"""A request's leg timings inside the engine, and the step in flight (no vLLM)."""

from __future__ import annotations

from kvtether.connector._timings import LegTimings, StepClock
from kvtether.protocol import EngineTimings


def test_a_leg_that_read_kv_reports_queue_read_and_engine_time() -> None:
    leg = LegTimings(taken_up=100.5, read_started=100.75, read_done=101.0)
    params = leg.as_params(arrival=100.0, now=103.0)
    assert params == {"queue_s": 0.5, "read_s": 0.25, "engine_s": 3.0}
    assert EngineTimings.model_validate(params).read_s == 0.25  # the wire model reads it


def test_a_leg_that_read_nothing_has_no_read_time() -> None:
    assert LegTimings(taken_up=100.0).as_params(arrival=100.0, now=101.0)["read_s"] is None
    started_only = LegTimings(taken_up=100.0, read_started=100.1)  # the read never finished
    assert started_only.as_params(arrival=100.0, now=101.0)["read_s"] is None


def test_times_before_arrival_count_as_none_waited() -> None:
    # time.time() is not monotonic: a clock step back must not give a negative wait.
    params = LegTimings(taken_up=99.0).as_params(arrival=100.0, now=99.5)
    assert params["queue_s"] == 0.0 and params["engine_s"] == 0.0


def test_the_step_clock_times_the_oldest_step_in_flight() -> None:
    clock = StepClock()
    assert clock.running_s() is None  # between steps
    clock.began()
    assert clock.running_s() is not None
    clock._began = 0.0  # as if the first step began long ago
    clock.began()  # a second step queued behind it (batch queue) keeps the oldest
    running = clock.running_s()
    assert running is not None and running > 1.0
    clock.ended()
    assert clock.running_s() is None
