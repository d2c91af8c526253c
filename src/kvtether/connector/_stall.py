"""A worker step that does not end is reported with every thread's stack, once.

vLLM's engine waits ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (300 s) for its worker to finish a
step, then dies with "RPC call to execute_model timed out" and nothing that says where the
worker was. Seen on loaded 2-core CPU hosts: a prefill worker stopped inside a step while a
decode instance read its KV over NIXL, and the read then waited for the dead peer until the
router gave up. The connector sees each step begin (``start_load_kv``) and end
(``get_finished``); :class:`StepWatch` logs the worker's Python stacks when a step has run for
``after_s`` (a call stuck in NIXL or UCX shows as the Python line that made it), so the
instance log says where a hang is, minutes before vLLM's own timeout fires.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

__all__ = ["StepWatch", "thread_stacks"]

logger = logging.getLogger(__name__)


def thread_stacks() -> str:
    """Every thread's Python stack in this process, named as ``threading`` knows them."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame)).rstrip()
        parts.append(f"--- thread {names.get(ident, '?')} ({ident})\n{stack}")
    return "\n".join(parts)


class StepWatch:
    """``begin()`` / ``end()`` around a step; a step longer than ``after_s`` is reported once."""

    def __init__(self, after_s: float, *, report: Callable[[float], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.after_s = after_s
        self.reports = 0
        self._report = report or self._log
        self._clock = clock
        self._cond = threading.Condition()
        self._started: float | None = None
        self._reported = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvtether-stepwatch", daemon=True)
        self._thread.start()

    def begin(self) -> None:
        with self._cond:
            if self._started is None:
                self._started, self._reported = self._clock(), False
                self._cond.notify_all()

    def end(self) -> None:
        with self._cond:
            if self._reported and self._started is not None:
                logger.warning("kvtether: the engine step reported above ended after %.0f s",
                               self._clock() - self._started)
            self._started = None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(5)

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if self._started is None or self._reported:
                    self._cond.wait()
                    continue
                left = self._started + self.after_s - self._clock()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._reported = True
                self.reports += 1
                running_s = self._clock() - self._started
                self._cond.release()
                try:
                    self._report(running_s)
                except Exception:  # a report must never take the worker down
                    logger.debug("kvtether step watch: report failed", exc_info=True)
                finally:
                    self._cond.acquire()

    @staticmethod
    def _log(running_s: float) -> None:
        logger.warning(
            "kvtether: this worker's engine step has run for %.0f s (vLLM ends the engine at "
            "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 s by default); its threads are at:\n%s",
            running_s, thread_stacks())
