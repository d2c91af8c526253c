"""The bench's deployments: which strategies run, the cores each colocated baseline computes on,
replicas started and stopped together, and vllm-router (the real one) in front of them."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from kvtether.bench import _vllm_router, compare
from kvtether.bench.strategies import (
    STRATEGIES,
    Endpoints,
    Strategy,
    StrategyOptions,
    colocated_cores,
    stack_settings,
)
from kvtether.errors import ConfigError, InstanceFailedError
from kvtether.stack._commands import InstancePlan, VllmCommands, core_list, stack_cores
from kvtether.stack._reference import start_reference_vllms
from kvtether.stack.settings import StackSettings
from tests.stack.stack_fakes import FakeCommands, free_port_block
from tests.support.fake_vllm import MODEL, Cluster, FakeVLLM
from tests.support.replays import COMPRESS, endpoints, serving

COLOCATED = ("colocated", "colocated-instance", "colocated-dp")


# --- what runs -------------------------------------------------------------------------------
def test_every_strategy_runs_by_default_colocated_first() -> None:
    names = list(STRATEGIES)
    assert names[0] == "colocated"  # its outputs are the reference the others are checked by
    assert set(COLOCATED) | {"pd-oneway", "pd-upstream", "kvtether"} <= set(names)
    assert compare.build_parser().parse_args([]).strategies == names
    assert all(STRATEGIES[name].colocated for name in COLOCATED)
    assert [STRATEGIES[name].placement for name in COLOCATED] == ["stack", "instance",
                                                                  "replicas"]


def test_colocated_dp_sends_the_header_vllm_router_hashes_first() -> None:
    assert STRATEGIES["colocated-dp"].session_header == _vllm_router.SESSION_HEADER
    assert _vllm_router.SESSION_HEADER.lower() == "x-session-id"
    assert _vllm_router.POLICY == "consistent_hash"
    others = [s for s in STRATEGIES.values() if s.name != "colocated-dp"]
    assert all(s.session_header is None for s in others)


# --- the cores -------------------------------------------------------------------------------
def _opts(tmp_path: Path, prefill: int = 1, decode: int = 1) -> StrategyOptions:
    return StrategyOptions(profile="cpu-tiny", compress=16.0, port=9000, state_dir=tmp_path,
                           prefill=prefill, decode=decode)


@pytest.mark.parametrize(("host_cores", "prefill", "decode", "expected"), [
    # This project's 2-core machines, 1P+1D: decode on core 0, prefill on core 1.
    (2, 1, 1, {"colocated": [[0, 1]], "colocated-instance": [[0]],
               "colocated-dp": [[0], [1]]}),
    (4, 2, 2, {"colocated": [[0, 1, 2, 3]], "colocated-instance": [[0]],
               "colocated-dp": [[0], [1], [2], [3]]}),
    # More instances than cores: the P/D instances share them, so do the replicas.
    (1, 1, 1, {"colocated": [[0]], "colocated-instance": [[0]], "colocated-dp": [[0], [0]]}),
])
def test_each_colocated_baseline_computes_on_the_cores_the_pd_stack_uses(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, host_cores: int, prefill: int,
        decode: int, expected: dict[str, list[list[int]]]) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: host_cores)
    opts = _opts(tmp_path, prefill, decode)
    for name in COLOCATED:
        settings = stack_settings(STRATEGIES[name], opts)
        assert colocated_cores(STRATEGIES[name], settings) == expected[name], name
    pd = stack_settings(STRATEGIES["kvtether"], opts)
    assert sorted(set(stack_cores(pd))) == expected["colocated"][0]
    assert len(stack_cores(pd)) == prefill + decode == len(expected["colocated-dp"])


def test_core_lists_read_as_vllm_takes_them() -> None:
    assert core_list([0, 1]) == "0-1"
    assert core_list([3, 0, 1, 1]) == "0-1,3"
    assert core_list([0, 2, 4]) == "0,2,4"
    assert core_list([0]) == "0"


def _reference_plan(**kw: object) -> InstancePlan:
    return InstancePlan(name="reference", role="reference", host="127.0.0.1", port=8100,
                        log_path=Path("x.log"), model_dir=Path("/models/tiny"),
                        served_model_name="tiny", **kw)  # type: ignore[arg-type]


def test_a_colocated_engine_is_bound_to_the_cores_it_is_given(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    settings = StackSettings()
    bind = VllmCommands().command(_reference_plan(cpu_cores="0-1", prefix_caching=True),
                                  settings).env["VLLM_CPU_OMP_THREADS_BIND"]
    assert bind == "0-1"
    # The correctness reference beside a test stack stays on decode-0's core.
    assert VllmCommands().command(_reference_plan(), settings).env[
        "VLLM_CPU_OMP_THREADS_BIND"] == "0"


# --- replicas --------------------------------------------------------------------------------
@pytest.fixture
def fake_settings(tmp_path: Path) -> StackSettings:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return StackSettings(model=model, state_dir=tmp_path / "state", health_timeout_s=20,
                         stop_timeout_s=3)


def _children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if p.status() != psutil.STATUS_ZOMBIE]


def test_replicas_start_together_each_on_its_cores_and_all_stop(
        fake_settings: StackSettings) -> None:
    commands = FakeCommands()
    base = free_port_block(2)
    with start_reference_vllms(fake_settings, [base, base + 1], commands=commands,
                               prefix_caching=True, cpu_cores=["0", "1"]) as urls:
        assert urls == [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
        for url in urls:
            assert httpx.get(f"{url}/health", trust_env=False).status_code == 200
    assert [(p.name, p.cpu_cores, p.prefix_caching) for p in commands.plans] == [
        ("reference-0", "0", True), ("reference-1", "1", True)]
    assert not _children()


def test_a_replica_that_fails_to_start_takes_the_others_down(
        fake_settings: StackSettings) -> None:
    commands = FakeCommands({"reference-1": {"FAKE_EXIT_CODE": "3"}})
    base = free_port_block(2)
    with pytest.raises(InstanceFailedError, match="reference-1"):
        with start_reference_vllms(fake_settings, [base, base + 1], commands=commands):
            pytest.fail("replicas reported healthy")
    assert not _children()


# --- vllm-router -----------------------------------------------------------------------------
def test_the_router_command_line_is_one_vllm_router_parses() -> None:
    launch = pytest.importorskip("vllm_router.launch_router")
    argv = _vllm_router.router_argv(["http://127.0.0.1:9101", "http://127.0.0.1:9102"],
                                    host="127.0.0.1", port=9000, metrics_port=9300)
    assert argv[1:3] == ["-m", "vllm_router.launch_router"]
    args = launch.parse_router_args(argv[3:])
    assert args.worker_urls == ["http://127.0.0.1:9101", "http://127.0.0.1:9102"]
    assert (args.host, args.port, args.policy) == ("127.0.0.1", 9000, "consistent_hash")
    assert (args.prometheus_port, args.worker_startup_check_interval) == (9300, 1)


def test_without_vllm_router_installed_the_error_says_how_to_get_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm_router" else real(name, *a))
    with pytest.raises(ConfigError, match=r"kvtether\[bench\]"):
        _vllm_router.require_vllm_router()


def test_vllm_router_keeps_each_conversation_on_one_replica(tmp_path: Path) -> None:
    pytest.importorskip("vllm_router")
    cluster = Cluster()
    with contextlib.ExitStack() as stack:
        fakes = [stack.enter_context(serving(
            lambda port, i=i: FakeVLLM(cluster, f"replica-{i}", "127.0.0.1", port)))
            for i in range(2)]
        port = free_port_block(2)
        url = stack.enter_context(_vllm_router.start_vllm_router(
            [f.url for f in fakes], host="127.0.0.1", port=port, metrics_port=port + 1,
            log_path=tmp_path / "router.log", health_timeout_s=30, stop_timeout_s=5))
        sessions = [f"bench-t-s{i}" for i in range(16)]
        with httpx.Client(base_url=url, trust_env=False, timeout=30) as client:
            for turn in range(2):
                for sid in sessions:
                    r = client.post("/v1/chat/completions", headers={"X-Session-ID": sid},
                                    json={"model": MODEL, "max_tokens": 4,
                                          "return_token_ids": True,
                                          "messages": [{"role": "user",
                                                        "content": f"{sid} turn {turn}"}]})
                    assert r.status_code == 200, r.text
                    assert r.json()["prompt_token_ids"]  # the bench's own fields pass through
    seen = [[r.headers["x-session-id"] for r in f.requests] for f in fakes]
    assert all(seen), "one replica got no conversation"
    assert not set(seen[0]) & set(seen[1]), "a conversation moved between replicas"
    assert sorted(seen[0] + seen[1]) == sorted(sessions * 2)
    assert not _children()


# --- the results say what each strategy ran on -------------------------------------------------
def test_results_record_each_strategy_s_cores_and_engines(tmp_path: Path) -> None:
    placed = {"colocated": ("0-1", 1), "colocated-dp": ("0-1", 2)}
    with serving(lambda port: FakeVLLM(Cluster(), "fake", "127.0.0.1", port)) as fake:

        @contextlib.contextmanager
        def start(strategy: Strategy, opts: StrategyOptions) -> Iterator[Endpoints]:
            cores, instances = placed[strategy.name]
            e = endpoints(fake)
            yield Endpoints(**{**e.__dict__, "cores": cores, "instances": instances})

        out = tmp_path / "out"
        assert compare.main([
            "--strategies", "colocated", "colocated-dp", "--sessions", "2", "--turns", "2", "2",
            "--compress", str(COMPRESS), "--context-tokens", "700", "--system-tokens", "200",
            "--max-output-tokens", "16", "--long-tools", "0", "--no-plots", "--out", str(out),
            "--state-dir", str(tmp_path / "state"),
        ], start=start) == 0
    detail = json.loads((out / "results.json").read_text())["strategies"]
    assert {name: (detail[name]["cores"], detail[name]["instances"]) for name in placed} == \
        placed
