"""Each CPU vLLM instance computes on the core the stack bound it to, with tcmalloc.

vLLM 0.32's NIXL worker moves the thread that builds it (the worker's main thread, which runs
the forward pass) to the host's last core; the kvtether connector moves it back
(:mod:`kvtether.connector._cores`). Without that, prefill and decode of a 2-core stack both
computed on core 1, and concurrent conversations queued behind each other.
"""

from __future__ import annotations

import json
import os

import psutil
import pytest

from kvtether.stack._commands import tcmalloc_preload
from tests.support.stacks import StackHandle

pytestmark = pytest.mark.vllm


def _workers(api_server_pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(api_server_pid).children(recursive=True)
            if "Worker" in p.name()]


def test_prefill_and_decode_compute_on_their_own_cores(pd_stack: StackHandle) -> None:
    state = json.loads((pd_stack.state_dir / "stack.json").read_text())
    placed: dict[str, set[int]] = {}
    for proc in state["processes"]:
        if proc["role"] not in ("prefill", "decode"):
            continue
        workers = _workers(proc["pid"])
        assert len(workers) == 1, (proc["name"], workers)
        worker = workers[0]
        # What the stack bound the instance to (the worker's own environ block is overwritten
        # by its process title).
        bound = psutil.Process(proc["pid"]).environ().get("VLLM_CPU_OMP_THREADS_BIND")
        assert bound is not None and bound.isdigit(), (proc["name"], bound)
        # The worker's main thread (tid == pid) runs the model.
        placed[proc["name"]] = os.sched_getaffinity(worker.pid)
        assert placed[proc["name"]] == {int(bound)}, proc["name"]
    if (os.cpu_count() or 1) >= 2:
        assert placed["prefill-0"] != placed["decode-0"], placed


def test_cpu_workers_allocate_with_tcmalloc_where_the_host_has_it(pd_stack: StackHandle) -> None:
    """vLLM's CPU worker asks for tcmalloc preloaded; the stack preloads the host's copy."""
    if tcmalloc_preload("") == {}:
        pytest.skip("no tcmalloc on this host (Debian: apt install libtcmalloc-minimal4)")
    state = json.loads((pd_stack.state_dir / "stack.json").read_text())
    for proc in state["processes"]:
        if proc["role"] not in ("prefill", "decode"):
            continue
        for worker in _workers(proc["pid"]):
            maps = [m.path for m in worker.memory_maps(grouped=True)]
            assert any("libtcmalloc" in path for path in maps), (proc["name"], worker.pid)
