"""Where a request's time went inside this engine, and how long the step in flight has run.

Plain Python (no vLLM). :class:`LegTimings` is one request's leg as the connector's scheduler
side sees it; it becomes the response's :class:`~kvtether.protocol.EngineTimings`
(``kvtether_timings``), which the router reports per turn. :class:`StepClock` names a frozen
worker: the control channel's ``step_running_s`` is how long the engine has waited for the
step it sent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["LegTimings", "StepClock"]


@dataclass
class LegTimings:
    """One request's leg, in ``time.time()`` (the clock of vLLM's ``request.arrival_time``)."""

    taken_up: float  # the scheduler first asked the connector about the request
    read_started: float | None = None  # blocks allocated for KV read from the other instance
    read_done: float | None = None  # the worker reported that read finished

    def as_params(self, arrival: float, now: float) -> dict[str, float | None]:
        """The leg as :class:`~kvtether.protocol.EngineTimings` fields, JSON-ready."""
        read_s = None
        if self.read_started is not None and self.read_done is not None:
            read_s = round(self.read_done - self.read_started, 4)
        return {
            "queue_s": round(max(0.0, self.taken_up - arrival), 4),
            "read_s": read_s,
            "engine_s": round(max(0.0, now - arrival), 4),
        }


class StepClock:
    """When the engine step in flight was scheduled; the engine thread marks each step, the
    control channel's threads read it."""

    def __init__(self) -> None:
        self._began: float | None = None  # perf_counter(); None between steps

    def began(self) -> None:
        if self._began is None:  # with a batch queue, the oldest step in flight
            self._began = time.perf_counter()

    def ended(self) -> None:
        self._began = None

    def running_s(self) -> float | None:
        """How long the step in flight has waited for the worker; None between steps."""
        began = self._began  # read once: the engine thread may clear it meanwhile
        return None if began is None else round(time.perf_counter() - began, 3)
