"""Act on a recorded stack from any process: status and stop, found through the state file."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvtether.stack import _procs
from kvtether.errors import StackError, StackNotRunningError
from kvtether.stack._health import probe
from kvtether.stack._state import ProcessRecord, load_state, remove_state

__all__ = ["InstanceStatus", "stack_status", "stack_down", "stop_records", "status_of"]


@dataclass(frozen=True)
class InstanceStatus:
    name: str
    role: str
    url: str
    pid: int
    alive: bool
    healthy: bool
    log_path: Path


# Stopped in this order (no new requests first), each group's processes at once.
_STOP_ORDER = (("front",), ("router",), ("prefill", "decode", "reference", "store"))


def stop_records(records: list[ProcessRecord], timeout_s: float) -> list[int]:
    """The front, then the routers, then every engine and the local store at once."""
    survivors: list[int] = []
    stop = lambda r: _procs.stop_group(r.pid, r.create_time, timeout_s)  # noqa: E731
    for roles in _STOP_ORDER:
        group = [r for r in records if r.role in roles]
        if group:
            with ThreadPoolExecutor(max_workers=len(group)) as pool:
                for left in pool.map(stop, group):
                    survivors += left
    return survivors


def status_of(records: list[ProcessRecord]) -> list[InstanceStatus]:
    out = []
    with httpx.Client(timeout=httpx.Timeout(2.0, connect=1.0), trust_env=False) as client:
        for r in records:
            alive = _procs.is_alive(r.pid, r.create_time)
            healthy = alive and probe(client, r.url)
            out.append(InstanceStatus(r.name, r.role, r.url, r.pid, alive, healthy, r.log_path))
    return out


def stack_status(state_dir: Path) -> list[InstanceStatus]:
    """Status of the stack recorded in ``state_dir`` (raises if none is recorded)."""
    state = load_state(state_dir)
    if state is None:
        raise StackNotRunningError(state_dir)
    return status_of(state.processes)


def stack_down(state_dir: Path, stop_timeout_s: float = 15.0) -> list[ProcessRecord]:
    """Stop the stack recorded in ``state_dir``, started by whichever process; return its records.

    A foreground ``kvtether stack up`` that still runs is asked to stop first (SIGTERM), so it
    exits cleanly; then every recorded process group is stopped regardless.
    """
    state = load_state(state_dir)
    if state is None:
        raise StackNotRunningError(state_dir)
    if state.owner_stops_on_sigterm and state.owner_pid != os.getpid():
        _procs.terminate(state.owner_pid, state.owner_create_time, stop_timeout_s + 10.0)
    with _procs.signals_deferred():
        survivors = stop_records(state.processes, stop_timeout_s)
        remove_state(state_dir)
    if survivors:
        raise StackError(f"processes survived shutdown: {survivors}; kill them by hand")
    return state.processes
