"""Keep a running stack up: restart a process that died, with exponential back-off.

Used by a foreground ``kvtether stack up`` (and by tests, from a thread). Each death of a
process, and each restart of it that does not become healthy, is one failure. Before the k-th
failure's restart the supervisor waits ``restart_backoff_s * 2**(k-1)``, at most
``restart_backoff_max_s``; the ``restart_max_failures``-th failure of one process within
``restart_window_s`` gives up (:class:`RestartsExhaustedError`) and the caller stops the stack.
The router notices a restarted instance by itself: its health probe (every few seconds) takes
the instance back once it answers ``/health``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from kvtether.errors import InstanceFailedError, RestartsExhaustedError
from kvtether.stack._procs import tail

if TYPE_CHECKING:
    from kvtether.stack.settings import StackSettings

logger = logging.getLogger(__name__)

__all__ = ["RestartPolicy", "RestartsExhaustedError", "Supervised", "supervise"]


class Supervised(Protocol):
    """What the supervisor needs of a running stack (:class:`~kvtether.stack.launcher.Stack`
    is one): its processes by index, which have died, and a way to start one again."""

    def dead_processes(self) -> list[int]: ...

    def process_name(self, index: int) -> str: ...

    def exit_code(self, index: int) -> int | None: ...

    def log_path(self, index: int) -> Path: ...

    def respawn(self, index: int) -> float:
        """Start process ``index`` again; seconds until it was healthy (raises
        :class:`~kvtether.errors.InstanceFailedError` when it never was)."""
        ...


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float
    backoff_max_s: float
    max_failures: int
    window_s: float

    @classmethod
    def from_settings(cls, s: StackSettings) -> RestartPolicy:
        return cls(s.restart_backoff_s, s.restart_backoff_max_s, s.restart_max_failures,
                   s.restart_window_s)

    def delay_s(self, failures: int) -> float:
        """Wait before the restart that follows the ``failures``-th recent failure."""
        return float(min(self.backoff_max_s, self.backoff_s * 2 ** max(0, failures - 1)))


def supervise(
    stack: Supervised,
    policy: RestartPolicy,
    *,
    stop: threading.Event | None = None,
    poll_s: float = 0.5,
    say: Callable[[str], None] | None = None,
) -> None:
    """Watch ``stack``'s processes until ``stop`` is set; restart any that exits.

    Raises :class:`RestartsExhaustedError` when one fails too often; stopping the stack is the
    caller's job (as with every error from here).
    """
    stop = stop or threading.Event()
    say = say or logger.warning
    failures: dict[str, deque[float]] = {}
    while not stop.wait(poll_s):
        for index in stack.dead_processes():
            name = stack.process_name(index)
            code = stack.exit_code(index)
            say(f"{name} exited unexpectedly (code {code}); restarting it")
            _restart(stack, index, policy, failures.setdefault(name, deque()), stop, say)
            if stop.is_set():
                return


def _restart(
    stack: Supervised, index: int, policy: RestartPolicy, failures: deque[float],
    stop: threading.Event, say: Callable[[str], None],
) -> None:
    name = stack.process_name(index)
    while True:
        now = time.monotonic()
        failures.append(now)
        while failures and failures[0] < now - policy.window_s:
            failures.popleft()
        log_path = stack.log_path(index)
        if len(failures) >= policy.max_failures:
            raise RestartsExhaustedError(name, len(failures), policy.window_s, log_path,
                                         tail(log_path))
        delay_s = policy.delay_s(len(failures))
        say(f"restarting {name} in {delay_s:.1f} s (failure {len(failures)} of at most "
            f"{policy.max_failures - 1} restarts within {policy.window_s:.0f} s)")
        if stop.wait(delay_s):
            return
        try:
            healthy_after_s = stack.respawn(index)
        except InstanceFailedError as exc:
            say(f"restart of {name} failed: {exc.reason}")
            continue
        say(f"{name} is back: healthy {healthy_after_s:.1f} s after its restart")
        return
