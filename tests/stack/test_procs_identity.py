"""Process identity in the stack's records survives a step of the wall clock."""

from __future__ import annotations

import os

import psutil
import pytest

from kvtether.stack import _procs


def test_a_start_time_counts_from_boot_so_a_clock_step_cannot_move_it() -> None:
    started = _procs.create_time(os.getpid())
    assert started is not None
    me = psutil.Process()
    # psutil adds the boot time, which Linux moves with every wall-clock step (NTP, a resumed
    # VM: 17 s on this host during a soak, and stack down then took its own vLLM for
    # strangers). The recorded value is the kernel's start tick, which nothing moves.
    if os.path.exists("/proc/self/stat"):
        assert started == pytest.approx(me.create_time() - psutil.boot_time(), abs=0.02)
        assert started < 1e9
    assert _procs.is_alive(os.getpid(), started)
    assert not _procs.is_alive(os.getpid(), started + 5.0)  # another process's start


def test_a_state_file_from_an_earlier_version_still_identifies_its_processes() -> None:
    unix_time = psutil.Process().create_time()  # what stack.json held before
    assert _procs.is_alive(os.getpid(), unix_time)
    assert not _procs.is_alive(os.getpid(), unix_time - 60.0)
