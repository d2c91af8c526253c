"""Keep a CPU worker's forward pass on the cores vLLM bound it to.

vLLM 0.32's NIXL worker, on a CPU platform, ends its ``__init__`` with
``os.sched_setaffinity(0, [last core of each NUMA node])`` ("reserve different cores for
start_load_kv() from model_forward()", ``nixl/base_worker.py``). ``0`` is the calling thread,
and the connector is built on the worker's main thread, which is also the OpenMP master thread
that runs ``model_forward``: every NIXL-enabled CPU instance then computes on the host's last
core, whatever ``VLLM_CPU_OMP_THREADS_BIND`` said: a prefill and a decode instance on one host
then compute on the same core while the others sit idle, and every turn waits for it.

:func:`keep_thread_affinity` puts the calling thread back where it was, and with it every
thread that the wrapped code started after re-pinning (they inherited the reserved cores).
Threads started before the re-pin (NIXL's agent and UCX progress threads) already carry the
original binding. The upstream change that would make this unnecessary: reserve cores for
transfer threads by pinning those threads, not the caller, or skip it when
``VLLM_CPU_OMP_THREADS_BIND`` already placed the worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

__all__ = ["keep_thread_affinity"]

logger = logging.getLogger(__name__)


def _thread_ids() -> set[int]:
    try:
        return {int(t) for t in os.listdir(f"/proc/{os.getpid()}/task")}
    except OSError:
        return set()


@contextlib.contextmanager
def keep_thread_affinity() -> Iterator[None]:
    """Undo any change the wrapped code makes to the calling thread's CPU affinity."""
    if not hasattr(os, "sched_getaffinity"):  # pragma: no cover - not Linux
        yield
        return
    before = os.sched_getaffinity(0)
    threads_before = _thread_ids()
    try:
        yield
    finally:
        after = os.sched_getaffinity(0)
        if after != before:
            moved = 0
            for tid in _thread_ids() - threads_before:
                with contextlib.suppress(OSError):
                    if os.sched_getaffinity(tid) == after:
                        os.sched_setaffinity(tid, before)
                        moved += 1
            os.sched_setaffinity(0, before)
            logger.info("kept the worker's forward pass on cores %s (vLLM's NIXL worker had "
                        "moved it to %s); %d thread(s) started meanwhile moved back too",
                        sorted(before), sorted(after), moved)
