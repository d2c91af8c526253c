"""The router's one source of wall-clock time, injected so tests move time instead of sleeping.

Lease deadlines, idle times and turn timestamps are unix seconds (they are compared with
deadlines decode instances report); latencies use ``time.perf_counter`` directly, since no
test needs to fake a duration, and backend back-off uses ``time.monotonic`` for the same reason.
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Clock", "SystemClock"]


class Clock(Protocol):
    def now_unix_s(self) -> float: ...


class SystemClock:
    """Real time."""

    def now_unix_s(self) -> float:
        return time.time()
