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
