"""A clock tests move by hand, for the router's injected ``Clock``."""

from __future__ import annotations

import time


class ManualClock:
    def __init__(self, start_unix_s: float | None = None) -> None:
        self.t = time.time() if start_unix_s is None else start_unix_s

    def now_unix_s(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds
