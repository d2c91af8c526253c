"""`kvtether stack up|status|down` against real vLLM (cpu-tiny): healthy, visible, no orphans."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from kvtether.stack._state import load_state

pytestmark = pytest.mark.vllm

UP_TIMEOUT_S = 300


def _kvtether(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtether", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def _free_block(n: int, start: int) -> int:
    """First base >= start with n free ports (stay clear of stacks others run on this box)."""
    from kvtether.stack._procs import port_in_use

    base = start
    while any(port_in_use("127.0.0.1", base + i) for i in range(n)):
        base += n
    return base


@pytest.fixture
def stack_args(tmp_path: Path) -> Iterator[list[str]]:
    state_dir = tmp_path / "state"
    args = [
        "--state-dir",
        str(state_dir),
        "--port",
        str(_free_block(1, 8290)),
        "--base-port",
        str(_free_block(2, 8200)),
        "--side-channel-base-port",
        str(_free_block(20, 5700)),
    ]
    yield args
    if load_state(state_dir) is not None:  # the test failed half way: never leave vLLM running
        _kvtether("stack", "down", "--state-dir", str(state_dir))


def _tree(pids: list[int]) -> list[psutil.Process]:
    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            procs += [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return procs


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_stack_up_detach_status_down(stack_args: list[str], tmp_path: Path) -> None:
    t0 = time.monotonic()
    up = _kvtether(
        "stack",
        "up",
        "--profile",
        "cpu-tiny",
        "--detach",
        *stack_args,
        timeout_s=UP_TIMEOUT_S + 60,
    )
    elapsed_s = time.monotonic() - t0
    assert up.returncode == 0, up.stderr
    assert elapsed_s < UP_TIMEOUT_S
    print(f"stack up --detach healthy after {elapsed_s:.1f} s")

    state = load_state(tmp_path / "state")
    assert state is not None and state.phase == "running"
    assert [p.name for p in state.processes] == ["prefill-0", "decode-0", "router"]
    # vLLM's EngineCore (and its worker) run as children of each API server.
    procs = _tree([p.pid for p in state.processes])
    assert len(procs) > len(state.processes)

    status = _kvtether("stack", "status", "--state-dir", str(tmp_path / "state"))
    assert status.returncode == 0, status.stdout + status.stderr
    for name in ("prefill-0", "decode-0", "router"):
        line = next(ln for ln in status.stdout.splitlines() if name in ln)
        assert "yes" in line and "ok" in line, status.stdout

    models = httpx.get(f"{state.router_url}/v1/models", timeout=30, trust_env=False)
    assert models.status_code == 200
    assert [m["id"] for m in models.json()["data"]] == ["tiny"]

    t0 = time.monotonic()
    down = _kvtether("stack", "down", "--state-dir", str(tmp_path / "state"))
    assert down.returncode == 0, down.stderr
    print(f"stack down took {time.monotonic() - t0:.1f} s")
    assert not _alive(procs), [p.cmdline()[:4] for p in _alive(procs)]
    assert load_state(tmp_path / "state") is None
