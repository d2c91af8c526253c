"""benchmarks/step_watch.py: which processes it watches (no vLLM; the dumps are soak's)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks import step_watch


def _proc(pid: int, cmdline: list[str]) -> Any:
    return SimpleNamespace(pid=pid, info={"pid": pid, "cmdline": cmdline})


def test_it_finds_every_kvtether_instance_from_its_command_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kv = {"kv_connector_extra_config": {"kvtether_role": "decode", "kvtether_control_port": 9002}}
    procs = [
        _proc(10, ["python", "-m", "vllm.entrypoints.openai.api_server", "--kv-transfer-config",
                   json.dumps(kv)]),
        _proc(11, ["python", "-m", "vllm.entrypoints.openai.api_server"]),  # no connector
        _proc(12, ["python", "-m", "vllm.entrypoints.openai.api_server", "--kv-transfer-config",
                   "{not json"]),
        _proc(13, ["python", "-m", "kvtether", "router"]),
    ]
    monkeypatch.setattr(step_watch.psutil, "process_iter", lambda attrs: procs)
    monkeypatch.setattr(step_watch, "_secret", lambda pid: f"s{pid}")
    assert step_watch.instances() == [step_watch.Instance("decode-9002", 10, 9002, "s10")]


def test_it_says_which_instances_it_watches_when_that_changes() -> None:
    d, pf = step_watch.Instance("decode-9002", 1, 9002, None), step_watch.Instance(
        "prefill-9001", 2, 9001, None)
    assert step_watch.watching(None, []) == (
        "no vLLM instance with the kvtether connector found (yet)")
    assert step_watch.watching([], [d, pf]) == "watching decode-9002, prefill-9001"
    assert step_watch.watching([pf, d], [d, pf]) is None
    assert step_watch.watching([d, pf], [pf]) == "watching prefill-9001"


def test_an_unreachable_instance_reads_as_no_step() -> None:
    import httpx

    inst = step_watch.Instance("decode-1", 1, 1, None)  # port 1: nobody listens
    with httpx.Client() as client:
        assert step_watch.step_running_s(client, inst) is None


def test_it_reads_every_thread_of_a_process_from_proc() -> None:
    import os
    import threading
    import time

    stop = threading.Event()
    spinner = threading.Thread(target=lambda: stop.wait(30), name="watched")
    spinner.start()
    try:
        # until the thread is asleep in its wait (on a loaded host it may still be starting)
        deadline = time.monotonic() + 20
        while True:
            seen = step_watch.sample_threads([("me python", os.getpid())])
            asleep = seen.get(spinner.native_id)
            if (asleep and asleep.state == "S") or time.monotonic() > deadline:
                break
            time.sleep(0.01)
    finally:
        stop.set()
        spinner.join()
    main = seen[os.getpid()]
    assert (main.process, main.pid, main.state) == ("me python", os.getpid(), "R")
    assert main.run_ns > 0
    assert main.allowed and main.doing == "read"  # it is reading /proc
    assert spinner.native_id in seen and seen[spinner.native_id].state == "S"
    assert step_watch.sample_threads([("gone", 2**22 + 7)]) == {}  # no such process
    assert set(step_watch.host_cpu()) >= {"user", "system", "idle", "steal"}


def test_the_report_says_whether_a_stalled_worker_was_starved_or_asleep() -> None:
    T = step_watch.ThreadSample
    worker = "decode-9002 VLLM::Worker"
    core = "decode-9002 VLLM::EngineCore"
    before = {
        20: T(worker, 20, 20, "VLLM::Worker", "R", 1_000_000, 0),
        30: T(core, 30, 30, "VLLM::EngineCo", "S", 5_000_000, 0),
        40: T("prefill-9001 VLLM::Worker", 40, 41, "pt_main_thread", "R", 0, 0),
        50: T(worker, 20, 50, "gone", "S", 0, 0),
    }
    after = {
        20: T(worker, 20, 20, "VLLM::Worker", "R", 101_000_000, 2_500_000_000),
        30: T(core, 30, 30, "VLLM::EngineCo", "S", 5_000_000, 0),
        40: T("prefill-9001 VLLM::Worker", 40, 41, "pt_main_thread", "R", 1_900_000_000, 0),
        60: T(worker, 20, 60, "new", "S", 9, 9),  # born inside the window: no delta
    }
    summary, table = step_watch.sched_report(
        "decode-9002", 2.0, before, after,
        {"user": 0, "idle": 0, "steal": 0}, {"user": 380, "idle": 10, "steal": 10})
    assert summary == (
        "decode-9002 over 2.0 s: VLLM::Worker R, ran 100 ms, waited runnable 2500 ms; "
        "VLLM::EngineCore S, ran 0 ms, waited runnable 0 ms; all vLLM threads ran 1.00 cores "
        "and waited runnable 1.25, 2 runnable at the end; host: user 95%, idle 2%, steal 2%")
    lines = table.splitlines()
    assert lines[0] == summary
    assert [line.split()[2] for line in lines[3:]] == ["20", "41"]  # most time first
    assert "new" not in table and "gone" not in table
    assert "VLLM::Worker not found" in step_watch.sched_report("x", 1, {}, {}, {}, {})[0]


def test_the_report_names_the_thread_that_held_the_stalled_worker_s_core() -> None:
    T = step_watch.ThreadSample
    stalled = T("prefill-9000 VLLM::Worker", 20, 20, "VLLM::Worker", "R", 0, 0, "0")
    mate = T("decode-9002 VLLM::Worker", 30, 30, "VLLM::Worker", "R", 0, 0, "0", "user")
    other = T("decode-9003 VLLM::Worker", 40, 40, "VLLM::Worker", "R", 0, 0, "1", "user")
    after = {20: stalled, 30: T(**{**mate.__dict__, "run_ns": 2_900_000_000}),
             40: T(**{**other.__dict__, "run_ns": 3_000_000_000})}
    middle = [{30: T(**{**mate.__dict__, "doing": d})} for d in ("sched_yield",) * 3 + ("user",)]
    summary, table = step_watch.sched_report(
        "prefill-9000", 3.0, {20: stalled, 30: mate, 40: other}, after, {}, {}, middle)
    assert summary.startswith("prefill-9000 over 3.0 s: VLLM::Worker R, ran 0 ms, waited "
                              "runnable 0 ms (runnable and never run in the window); ")
    assert summary.endswith("; on core 0 decode-9002 VLLM::Worker (30) ran 2900 ms, "
                            "seen sched_yield 3/4, user 1/4")
    assert "sched_yield 3/4, user 1/4" in table.splitlines()[4]  # its row, second by time
