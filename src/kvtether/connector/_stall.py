"""A worker step that does not end is reported with every thread's stack, once.

vLLM's engine waits ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (300 s) for its worker to finish a
step, then dies with "RPC call to execute_model timed out" and nothing that says where the
worker was; meanwhile a decode instance reading that worker's KV over NIXL waits for a dead
peer until the router gives up. The connector sees each step begin
(``bind_connector_metadata``) and end (``get_transfer_results``); :class:`StepWatch` reports a
step that has run for ``after_s``:

* from a Python thread, with every thread's stack and name, when the stuck call lets other
  Python threads run (it released the GIL, as blocking I/O and most NIXL waits do);
* from ``faulthandler``'s native watchdog when it does not: a C call that blocks while holding
  the GIL freezes every Python thread, this one included. The Python thread keeps that
  watchdog re-armed while steps end; if it cannot run, the watchdog writes
  ``Timeout (0:01:00)!`` and every thread's stack to the worker's stderr (the instance log).

A call stuck in NIXL or UCX shows as the Python line that made it.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Protocol

__all__ = [
    "FaulthandlerWatchdog", "NativeWatchdog", "StepWatch", "process_watch", "rpcs_watched",
    "thread_stacks", "watch_whole_rpcs",
]

logger = logging.getLogger(__name__)


def thread_stacks() -> str:
    """Every thread's Python stack in this process, named as ``threading`` knows them."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame)).rstrip()
        parts.append(f"--- thread {names.get(ident, '?')} ({ident})\n{stack}")
    return "\n".join(parts)


class NativeWatchdog(Protocol):
    def arm(self, seconds: float) -> None: ...
    def cancel(self) -> None: ...


class FaulthandlerWatchdog:
    """``faulthandler.dump_traceback_later``: a C thread that needs no GIL to write stacks.
    One per process (faulthandler has one); vLLM does not use it."""

    def arm(self, seconds: float) -> None:
        faulthandler.dump_traceback_later(seconds, repeat=False, file=sys.stderr, exit=False)

    def cancel(self) -> None:
        faulthandler.cancel_dump_traceback_later()


class StepWatch:
    """``begin()`` / ``end()`` around a step; a step longer than ``after_s`` is reported once.

    The step path stays cheap: ``begin`` arms the native watchdog only on the first step after
    an idle spell (~60 us); the watch thread re-arms it while steps keep ending and cancels it
    when the worker is idle.
    """

    def __init__(self, after_s: float, *, report: Callable[[float], None] | None = None,
                 native: NativeWatchdog | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.after_s = after_s
        self.tick_s = after_s / 4
        self.reports = 0
        self._report = report or self._log
        self._native = native
        self._clock = clock
        self._cond = threading.Condition()
        self._started: float | None = None
        self._last_end = -float("inf")
        self._reported = False
        self._armed_at: float | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvtether-stepwatch", daemon=True)
        self._thread.start()

    @property
    def native_armed(self) -> bool:
        return self._armed_at is not None

    def begin(self) -> None:
        with self._cond:
            if self._started is None:
                self._started, self._reported = self._clock(), False
                if self._native is not None and self._armed_at is None:
                    self._native.arm(self.after_s)
                    self._armed_at = self._started
                self._cond.notify_all()

    def end(self) -> None:
        with self._cond:
            now = self._clock()
            if self._reported and self._started is not None:
                logger.warning("kvtether: the engine step reported above ended after %.0f s",
                               now - self._started)
            self._started, self._last_end = None, now

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._disarm()
            self._cond.notify_all()
        self._thread.join(5)

    # --- the watch thread ------------------------------------------------------------------
    def _disarm(self) -> None:
        if self._native is not None and self._armed_at is not None:
            self._native.cancel()
        self._armed_at = None

    def _keep_native_armed(self, now: float) -> None:
        """While this thread runs, the native watchdog never fires: re-armed every tick while
        steps run or have just ended, cancelled once the worker is idle."""
        if self._armed_at is None or self._native is None:
            return
        if self._started is None and now - self._last_end > self.tick_s:
            self._disarm()  # idle: nothing can be stuck
        elif now - self._armed_at >= self.tick_s:
            self._native.cancel()
            self._native.arm(self.after_s)
            self._armed_at = now

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                now, started = self._clock(), self._started
                running = started is not None and not self._reported
                if started is not None and running and now - started >= self.after_s:
                    self._reported = True
                    self.reports += 1
                    self._disarm()  # this report says it all
                    self._cond.release()
                    try:
                        self._report(now - started)
                    except Exception:  # a report must never take the worker down
                        logger.debug("kvtether step watch: report failed", exc_info=True)
                    finally:
                        self._cond.acquire()
                    continue
                self._keep_native_armed(now)
                if started is None or not running:
                    if self._armed_at is None:
                        self._cond.wait()  # idle (or reported): begin() wakes us
                        continue
                    self._cond.wait(self.tick_s)
                    continue
                self._cond.wait(max(0.001, min(self.tick_s, started + self.after_s - now)))

    @staticmethod
    def _log(running_s: float) -> None:
        logger.warning(
            "kvtether: this worker's engine step has run for %.0f s (vLLM ends the engine at "
            "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 s by default); its threads are at:\n%s",
            running_s, thread_stacks())


# --- one watch per worker process ------------------------------------------------------------
_process_watch: StepWatch | None = None
_rpcs_watched = False


def process_watch(after_s: float) -> StepWatch:
    """The worker process's one :class:`StepWatch` (faulthandler's watchdog is per process)."""
    global _process_watch
    if _process_watch is None:
        _process_watch = StepWatch(after_s, native=FaulthandlerWatchdog())
    return _process_watch


def watch_whole_rpcs(after_s: float) -> StepWatch:
    """Called by :class:`~kvtether.connector.worker.WatchedCPUWorker`: the worker's engine-step
    RPCs are watched whole, so the connector does not watch its part of them as well."""
    global _rpcs_watched
    _rpcs_watched = True
    return process_watch(after_s)


def rpcs_watched() -> bool:
    return _rpcs_watched
