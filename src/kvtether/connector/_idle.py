"""An engine that only holds KV for a remote reader sleeps; this module decides when it wakes.

Plain Python (no vLLM import), used by :mod:`kvtether.connector.scheduler` in the engine-core
process. Why it exists: vLLM 0.32's engine loop steps every ~1 ms for as long as any request's
blocks are held for a remote reader (prefill until decode reads; decode for the whole lease),
and each step is an RPC that makes the worker spin, which on a CPU host takes cores from the
turns. With kvtether's scheduler the engine instead blocks on its input queue, and
:class:`EngineWaker` asks for a step only when there is something to do:

* a new request: vLLM's own input queue wakes the engine, nothing to add;
* a renew / release / eviction from the control channel: :meth:`EngineWaker.request_step`;
* a lease (or upstream prefill hold) reaching its deadline: the waker thread sleeps until the
  earliest deadline the engine armed, plus ``slack_s`` (the worker rebases deadlines onto its
  own clock a little later than the scheduler stamped them);
* NIXL notifications (a reader finished; a decode's heartbeat): nothing signals the engine
  process for these, so a housekeeping step runs every ``tick_s`` while anything is held. They
  only free memory early; a deadline never depends on them.

A wake-up is a no-op ``WAKEUP`` message in the engine's input queue (the same one vLLM posts at
shutdown) plus a flag that makes the scheduler report work for one step. :class:`HeldDeadlines`
is what the connector knows of those deadlines.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

__all__ = ["EngineWaker", "HeldDeadlines", "WAKE_REASONS"]

logger = logging.getLogger(__name__)

WAKE_REASONS = ("control", "deadline", "tick")


class EngineWaker:
    """Wakes a parked engine at deadlines, on request, and every ``tick_s`` while KV is held.

    ``wake`` must be safe to call from any thread (it posts to the engine's input queue). The
    engine thread calls :meth:`arm` after each step with the earliest held-block deadline (or
    ``None`` when nothing is held) and :meth:`take_step` when it schedules a step.
    """

    def __init__(
        self,
        wake: Callable[[], None],
        *,
        tick_s: float,
        slack_s: float = 0.05,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if tick_s <= 0:
            raise ValueError(f"tick_s must be > 0, got {tick_s}")
        self._wake, self.tick_s, self.slack_s, self._clock = wake, tick_s, slack_s, clock
        self._cond = threading.Condition()
        self._requested = False
        self._deadline: float | None = None
        self._last_step = clock()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.wakeups: Counter[str] = Counter({reason: 0 for reason in WAKE_REASONS})
        self.steps = 0

    # --- any thread ------------------------------------------------------------------------
    def request_step(self, reason: str = "control") -> None:
        """Make the engine take one step soon (e.g. a lease operation was queued)."""
        with self._cond:
            self._requested = True
            self.wakeups[reason] += 1
        self._wake()

    def start(self) -> EngineWaker:
        self._thread = threading.Thread(target=self._run, name="kvtether-waker", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # --- engine thread ---------------------------------------------------------------------
    def step_requested(self) -> bool:
        with self._cond:
            return self._requested

    def take_step(self) -> None:
        """The engine is stepping now: the pending request (if any) is served by this step."""
        with self._cond:
            served, self._requested = self._requested, False
            self._last_step = self._clock()
            self.steps += 1
            if served:
                self._cond.notify_all()  # the waker thread waits for this before re-arming

    def arm(self, deadline: float | None) -> None:
        """The earliest deadline of blocks held for a remote reader; ``None``: nothing held."""
        with self._cond:
            if deadline != self._deadline:
                self._deadline = deadline
                self._cond.notify_all()

    # --- the waker thread ------------------------------------------------------------------
    def _next_wake(self) -> tuple[float, str] | None:
        if self._deadline is None:
            return None
        tick = self._last_step + self.tick_s
        deadline = self._deadline + self.slack_s
        return (deadline, "deadline") if deadline <= tick else (tick, "tick")

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                nxt = self._next_wake()
                if nxt is None or self._requested:
                    # Nothing held (the engine is idle the ordinary way), or a step is already
                    # on its way: wait for the engine to re-arm.
                    self._cond.wait()
                    continue
                at, reason = nxt
                remaining = at - self._clock()
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue  # re-evaluate: re-armed, stepped, or time is up
                self._requested = True
                self.wakeups[reason] += 1
            try:
                self._wake()
            except Exception:  # the engine is shutting down; nothing left to wake
                logger.debug("kvtether waker: wake-up failed", exc_info=True)
                return


class HeldDeadlines:
    """Deadlines of every request whose blocks wait for a remote reader (both roles), as the
    worker was sent them: when a sleeping engine must step so the worker frees them.

    A request still held ``past_due_s`` after its deadline (the worker frees it on the first
    step after its own, slightly later, deadline) is dropped: only the tick retries it.
    """

    def __init__(
        self, *, past_due_s: float = 2.0, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.past_due_s, self._clock = past_due_s, clock
        self._deadlines: dict[str, float] = {}

    def update(self, deadlines: Mapping[str, float]) -> None:
        self._deadlines.update(deadlines)

    def freed(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._deadlines.pop(request_id, None)

    def earliest(self) -> float | None:
        """The earliest deadline not yet past due; ``None`` if none is held."""
        now = self._clock()
        stale = [r for r, d in self._deadlines.items() if now - d > self.past_due_s]
        for request_id in stale:
            logger.debug("request %s: held past its deadline; not waking for it again",
                         request_id)
            del self._deadlines[request_id]
        return min(self._deadlines.values(), default=None)

    def just_passed(self) -> bool:
        """A deadline has passed within ``past_due_s`` (a step lets the worker free it)."""
        now = self._clock()
        return any(0 <= now - d <= self.past_due_s for d in self._deadlines.values())
