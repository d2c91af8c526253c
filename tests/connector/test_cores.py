"""The worker's forward pass stays on the cores vLLM bound it to (vLLM's NIXL worker re-pins
the calling thread to the host's last core on CPU platforms)."""

from __future__ import annotations

import os
import threading

import pytest

from kvtether.connector._cores import keep_thread_affinity

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and two usable cores",
)


def _in_thread(fn):
    """Run ``fn`` in a fresh thread (affinity is per thread; leave pytest's alone)."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["value"]


def _cores() -> tuple[int, int]:
    first, last = sorted(os.sched_getaffinity(0))[0], sorted(os.sched_getaffinity(0))[-1]
    return first, last


def test_the_calling_thread_goes_back_to_its_cores() -> None:
    first, last = _cores()

    def body():
        os.sched_setaffinity(0, {first})  # where vLLM's OpenMP binding put the worker
        with keep_thread_affinity():
            os.sched_setaffinity(0, {last})  # what vLLM's NIXL worker __init__ does
        return os.sched_getaffinity(0)

    assert _in_thread(body) == {first}


def test_threads_started_after_the_re_pin_follow_it_back_and_older_ones_stay() -> None:
    first, last = _cores()

    def body():
        os.sched_setaffinity(0, {first})
        stop = threading.Event()
        with keep_thread_affinity():
            older = threading.Thread(target=stop.wait)
            older.start()  # like NIXL's agent threads: built before the re-pin
            os.sched_setaffinity(0, {last})
            newer = threading.Thread(target=stop.wait)
            newer.start()  # inherits the reserved core
            os.sched_setaffinity(older.native_id, {last, first})  # someone else's choice
        try:
            return (os.sched_getaffinity(newer.native_id),
                    os.sched_getaffinity(older.native_id))
        finally:
            stop.set()
            older.join()
            newer.join()

    newer_cores, older_cores = _in_thread(body)
    assert newer_cores == {first}
    assert older_cores == {first, last}


def test_restored_when_the_wrapped_code_fails() -> None:
    first, last = _cores()

    def body():
        os.sched_setaffinity(0, {first})
        with pytest.raises(RuntimeError), keep_thread_affinity():
            os.sched_setaffinity(0, {last})
            raise RuntimeError("worker init failed")
        return os.sched_getaffinity(0)

    assert _in_thread(body) == {first}
