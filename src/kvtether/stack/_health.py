"""Wait for ``GET /health`` on starting processes, with an optional rich progress display."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvtether.errors import InstanceFailedError
from kvtether.stack._procs import tail

__all__ = ["Starting", "probe", "wait_healthy"]

POLL_INTERVAL_S = 0.5
# The first probes come quickly (a router or a warm process answers almost at once), then
# back off to POLL_INTERVAL_S: vLLM itself takes tens of seconds.
FIRST_POLL_INTERVAL_S = 0.05


@dataclass
class Starting:
    """A process being waited on."""

    name: str
    url: str
    log_path: Path
    popen: subprocess.Popen[bytes]
    started_monotonic: float = field(default_factory=time.monotonic)
    healthy_after_s: float | None = None


def probe(client: httpx.Client, url: str) -> bool:
    """``GET /health`` answers 200; for a ``redis://`` URL (the local store), PING answers."""
    if url.startswith("redis://"):
        return _redis_ping(url)
    try:
        return client.get(url.rstrip("/") + "/health").status_code == 200
    except httpx.HTTPError:
        return False


def _redis_ping(url: str, timeout_s: float = 2.0) -> bool:
    host, _, port = url.removeprefix("redis://").partition("/")[0].rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")  # the inline command form every Redis and Valkey takes
            return sock.recv(64).startswith(b"+PONG")
    except (OSError, ValueError):
        return False


def wait_healthy(
    procs: Sequence[Starting], timeout_s: float, *, progress: bool = False, console: Any = None
) -> None:
    """Return once every process answers ``/health`` with 200.

    Raises :class:`InstanceFailedError` (with the log tail) as soon as one exits, or when
    ``timeout_s`` passes first. Stopping the others is the caller's job.
    """
    display = _Display(procs, console) if progress else None
    deadline = time.monotonic() + timeout_s
    interval_s = FIRST_POLL_INTERVAL_S
    try:
        with httpx.Client(timeout=httpx.Timeout(2.0, connect=1.0), trust_env=False) as client:
            while True:
                for proc in procs:
                    if proc.healthy_after_s is not None:
                        continue
                    code = proc.popen.poll()
                    if code is not None:
                        raise InstanceFailedError(
                            proc.name,
                            f"exited with code {code} while starting",
                            proc.log_path,
                            tail(proc.log_path),
                        )
                    if probe(client, proc.url):
                        proc.healthy_after_s = time.monotonic() - proc.started_monotonic
                if display:
                    display.refresh()
                if all(p.healthy_after_s is not None for p in procs):
                    return
                if time.monotonic() > deadline:
                    slow = next(p for p in procs if p.healthy_after_s is None)
                    raise InstanceFailedError(
                        slow.name,
                        f"was not healthy after {timeout_s:.0f} s",
                        slow.log_path,
                        tail(slow.log_path),
                    )
                time.sleep(interval_s)
                interval_s = min(POLL_INTERVAL_S, interval_s * 2)
    finally:
        if display:
            display.close()


class _Display:
    """One line per process: name, URL, state, elapsed time, log path.

    A live table on a terminal; elsewhere (CI logs, pipes) one plain line per state change.
    """

    def __init__(self, procs: Sequence[Starting], console: Any) -> None:
        from rich.console import Console
        from rich.live import Live

        self.procs = procs
        self.console = console or Console(stderr=True, soft_wrap=True)
        self.live = None
        self.reported: dict[str, str] = {}
        if self.console.is_terminal:
            self.live = Live(self._table(), console=self.console, refresh_per_second=4)
            self.live.start()
        else:
            for p in procs:
                line = f"{p.name} starting at {p.url} (log: {p.log_path})"
                self.console.print(line, markup=False)

    def _state(self, p: Starting, now: float) -> tuple[str, float]:
        if p.healthy_after_s is not None:
            return "healthy", p.healthy_after_s
        if p.popen.poll() is not None:
            return "exited", now - p.started_monotonic
        return "starting", now - p.started_monotonic

    def _table(self) -> Any:
        from rich.table import Table

        colour = {"healthy": "green", "exited": "red", "starting": "yellow"}
        table = Table(box=None, pad_edge=False, show_header=False)
        table.add_column(no_wrap=True)
        table.add_column(no_wrap=True)
        table.add_column(no_wrap=True)
        table.add_column(justify="right", no_wrap=True)
        table.add_column(overflow="fold")
        now = time.monotonic()
        for p in self.procs:
            state, elapsed = self._state(p, now)
            table.add_row(
                p.name,
                p.url,
                f"[{colour[state]}]{state}[/]",
                f"{elapsed:.1f} s",
                f"[dim]{p.log_path}[/]",
            )
        return table

    def refresh(self) -> None:
        if self.live is not None:
            self.live.update(self._table())
            return
        now = time.monotonic()
        for p in self.procs:
            state, elapsed = self._state(p, now)
            if state != "starting" and self.reported.get(p.name) != state:
                self.reported[p.name] = state
                self.console.print(f"{p.name} {state} after {elapsed:.1f} s", markup=False)

    def close(self) -> None:
        self.refresh()
        if self.live is not None:
            self.live.stop()
