"""The real command lines: what vLLM and the router are started with."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic_settings import CliApp

from kvtether.cli import RouterCommand
from kvtether.stack import _commands
from kvtether.stack._commands import InstancePlan, VllmCommands, tcmalloc_preload
from kvtether.stack.settings import StackSettings


def _plan(role: str = "prefill", **kw: object) -> InstancePlan:
    base = dict(
        name=f"{role}-0",
        role=role,
        host="127.0.0.1",
        port=8100,
        log_path=Path("x.log"),
        model_dir=Path("/models/tiny"),
        served_model_name="tiny",
        side_channel_port=5600,
        control_port=5900,
    )
    return InstancePlan(**{**base, **kw})  # type: ignore[arg-type]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_vllm_instance_command_line() -> None:
    settings = StackSettings(lease_ttl_s=10, connector="nixl")
    cmd = VllmCommands("py").command(_plan(), settings)
    argv = cmd.argv
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(argv, "--model") == "/models/tiny"
    assert _flag(argv, "--served-model-name") == "tiny"
    assert (_flag(argv, "--port"), _flag(argv, "--host")) == ("8100", "127.0.0.1")
    assert (_flag(argv, "--dtype"), _flag(argv, "--block-size")) == ("float32", "32")
    assert _flag(argv, "--max-model-len") == "4096"
    assert "--enforce-eager" in argv and "--no-enable-prefix-caching" not in argv
    assert json.loads(_flag(argv, "--kv-transfer-config")) == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "bidirectional_kv_xfer": True,
            "kv_recompute_threshold": 16,
            "decoder_kv_blocks_ttl": 480,
            "kv_lease_duration": 120,
        },
    }
    assert cmd.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert cmd.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert cmd.env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_kvtether_connector_is_the_default() -> None:
    settings = StackSettings(lease_ttl_s=10, max_retained_tokens=5000)
    cmd = VllmCommands().command(_plan("decode"), settings)
    config = json.loads(_flag(cmd.argv, "--kv-transfer-config"))
    assert config["kv_connector"] == "NixlConnector"
    assert config["kv_connector_module_path"] == "kvtether.connector.nixl"
    extra = config["kv_connector_extra_config"]
    assert extra["kvtether_lease_ttl_s"] == 10
    # The budget is the router's: a connector-side eviction it did not see would let it
    # forward a handle to freed blocks.
    assert "kvtether_max_retained_tokens" not in extra
    assert (extra["kvtether_role"], extra["kvtether_control_port"]) == ("decode", 5900)
    assert cmd.env["KVTETHER_CONTROL_PORT"] == "5900"


def test_prefill_kv_lease_sets_how_long_prefill_holds_a_new_turn_s_kv() -> None:
    def lease(**kw: object) -> object:
        cmd = VllmCommands().command(_plan(), StackSettings(**kw))  # type: ignore[arg-type]
        extra = json.loads(_flag(cmd.argv, "--kv-transfer-config"))["kv_connector_extra_config"]
        return extra.get("kv_lease_duration")

    assert lease() == 120  # CPU profiles
    assert lease(prefill_kv_lease_s=30) == 30
    assert lease(profile="gpu") is None  # vLLM's own (30 s)
    with pytest.raises(ValueError, match="prefill_kv_lease_s"):
        StackSettings(prefill_kv_lease_s=2)


def test_reference_has_no_transfer_and_no_prefix_cache() -> None:
    cmd = VllmCommands().command(_plan("reference", side_channel_port=None), StackSettings())
    assert "--no-enable-prefix-caching" in cmd.argv
    assert "--kv-transfer-config" not in cmd.argv
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in cmd.env


def test_gpu_profile_command_line() -> None:
    settings = StackSettings(profile="gpu", gpu_ids=[0, 1])
    cmd = VllmCommands().command(_plan(gpu_id=1, gpu_memory_utilization=0.4), settings)
    assert "--enforce-eager" not in cmd.argv
    assert _flag(cmd.argv, "--gpu-memory-utilization") == "0.4"
    assert "VLLM_CPU_KVCACHE_SPACE" not in cmd.env
    assert cmd.env["CUDA_VISIBLE_DEVICES"] == "1"
    config = json.loads(_flag(cmd.argv, "--kv-transfer-config"))
    assert config["kv_buffer_device"] == "cuda"


def test_extra_vllm_args_are_appended() -> None:
    cmd = VllmCommands().command(_plan(), StackSettings(extra_vllm_args=["--seed", "7"]))
    assert cmd.argv[-2:] == ["--seed", "7"]


def test_router_command_parses_back_into_router_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = InstancePlan(
        name="router",
        role="router",
        host="127.0.0.1",
        port=8000,
        log_path=Path("r.log"),
        prefill_urls=("http://127.0.0.1:8100",),
        decode_urls=("http://127.0.0.1:8101", "http://127.0.0.1:8102"),
    )
    settings = StackSettings(block_size_tokens=32, decoder_kv_blocks_ttl_s=120)
    argv = VllmCommands("py").command(plan, settings).argv
    assert argv[:4] == ["py", "-m", "kvtether", "router"]
    parsed = CliApp.run(RouterCommand, cli_args=argv[4:], cli_cmd_method_name="no_such_method")
    assert parsed.prefill_urls == ["http://127.0.0.1:8100"]
    assert parsed.decode_urls == ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]
    assert (parsed.port, parsed.kv_block_size_tokens) == (8000, 32)
    assert (parsed.decoder_kv_blocks_ttl_s, parsed.kv_recompute_threshold_tokens) == (120, 16)


def test_cpu_profiles_let_an_idle_stack_sleep() -> None:
    for profile in ("cpu-tiny", "cpu-smol"):
        settings = StackSettings(profile=profile)
        cmd = VllmCommands().command(_plan("decode"), settings)
        assert _flag(cmd.argv, "--scheduler-cls") == (
            "kvtether.connector.scheduler.IdleSleepScheduler"
        )
        assert _flag(cmd.argv, "--worker-cls") == "kvtether.connector.worker.WatchedCPUWorker"
        extra = json.loads(_flag(cmd.argv, "--kv-transfer-config"))["kv_connector_extra_config"]
        assert extra["kvtether_progress_thread_delay_us"] == 2000
        assert extra["kvtether_rpc_busy_loop_s"] == 0.02
        assert extra["kvtether_idle_tick_s"] == 5
        assert cmd.env["UCX_USE_MT_MUTEX"] == "y"
        assert cmd.env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "0"


def test_smol_profiles_take_small_steps_and_the_rest_keep_vllms() -> None:
    for profile in ("cpu-smol", "cpu-bench"):
        for role in ("prefill", "decode", "reference"):
            cmd = VllmCommands().command(_plan(role), StackSettings(profile=profile))
            assert _flag(cmd.argv, "--max-num-batched-tokens") == "256"
            assert _flag(cmd.argv, "--long-prefill-token-threshold") == "128"
    for profile in ("cpu-tiny", "gpu"):
        cmd = VllmCommands().command(_plan("prefill"), StackSettings(profile=profile))
        assert "--max-num-batched-tokens" not in cmd.argv
        assert "--long-prefill-token-threshold" not in cmd.argv
    chosen = StackSettings(profile="cpu-bench", max_num_batched_tokens=1024,
                           long_prefill_token_threshold=None)
    cmd = VllmCommands().command(_plan("prefill"), chosen)
    assert _flag(cmd.argv, "--max-num-batched-tokens") == "1024"
    assert "--long-prefill-token-threshold" not in cmd.argv


def test_gpu_profile_keeps_vllm_behaviour() -> None:
    cmd = VllmCommands().command(_plan("decode"), StackSettings(profile="gpu"))
    # Upstream's scheduling; the kvtether scheduler only reports steps and prefix-cache hits.
    assert _flag(cmd.argv, "--scheduler-cls") == "kvtether.connector.scheduler.TetherScheduler"
    assert "--worker-cls" not in cmd.argv  # the watched worker is vLLM's CPU worker
    extra = json.loads(_flag(cmd.argv, "--kv-transfer-config"))["kv_connector_extra_config"]
    assert not {"kvtether_progress_thread_delay_us", "kvtether_rpc_busy_loop_s"} & set(extra)
    assert "UCX_USE_MT_MUTEX" not in cmd.env


def test_upstream_connector_gets_no_kvtether_scheduler() -> None:
    # The sleeping scheduler needs the kvtether connector's lease table to know when to wake.
    cmd = VllmCommands().command(_plan("decode"), StackSettings(connector="nixl"))
    assert "--scheduler-cls" not in cmd.argv
    assert "--worker-cls" not in cmd.argv


def test_idle_settings_can_be_switched_off_and_the_callers_env_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("UCX_USE_MT_MUTEX", "n")
    settings = StackSettings(idle_sleep=False, progress_thread_delay_us=None, vllm_env={})
    cmd = VllmCommands().command(_plan("decode"), settings)
    assert _flag(cmd.argv, "--scheduler-cls") == "kvtether.connector.scheduler.TetherScheduler"
    assert "UCX_USE_MT_MUTEX" not in cmd.env  # the process inherits the caller's "n"
    cmd = VllmCommands().command(_plan("decode"), StackSettings())
    assert "UCX_USE_MT_MUTEX" not in cmd.env


def _kv_config(argv: list[str]) -> dict:
    return json.loads(_flag(argv, "--kv-transfer-config"))


@pytest.mark.parametrize(
    ("policy", "connector", "bidirectional"),
    [("kvtether", "kvtether", True), ("upstream", "nixl", True), ("off", "nixl", False)],
)
def test_each_reuse_policy_runs_its_connector(
    policy: str, connector: str, bidirectional: bool
) -> None:
    settings = StackSettings(reuse_policy=policy)
    assert settings.connector == connector
    for role in ("prefill", "decode"):
        argv = VllmCommands("py").command(_plan(role), settings).argv
        config = _kv_config(argv)
        assert config["kv_connector"] == "NixlConnector"
        assert ("kv_connector_module_path" in config) == (connector == "kvtether")
        assert config["kv_connector_extra_config"]["bidirectional_kv_xfer"] is bidirectional
        assert ("--scheduler-cls" in argv) == (connector == "kvtether")
    router = VllmCommands("py").command(_plan("router"), settings).argv
    assert _flag(router, "--reuse-policy") == policy


def test_an_explicit_connector_is_kept() -> None:
    assert StackSettings(connector="nixl").connector == "nixl"  # stock connector, kvtether router
    assert StackSettings(reuse_policy="off", connector="nixl").connector == "nixl"
    for policy in ("upstream", "off"):
        # A baseline policy on kvtether's connector (idle-sleeping engine): what the bench runs.
        settings = StackSettings(reuse_policy=policy, connector="kvtether")
        assert settings.connector == "kvtether"
        argv = VllmCommands("py").command(_plan("decode"), settings).argv
        config = _kv_config(argv)
        assert config["kv_connector_extra_config"]["bidirectional_kv_xfer"] is (policy != "off")
        assert "--scheduler-cls" in argv


@pytest.mark.parametrize("caching", [True, False])
def test_prefill_prefix_caching_applies_to_prefill_instances_only(caching: bool) -> None:
    settings = StackSettings(prefill_prefix_caching=caching)
    prefill = VllmCommands("py").command(_plan("prefill"), settings).argv
    decode = VllmCommands("py").command(_plan("decode"), settings).argv
    assert ("--no-enable-prefix-caching" in prefill) is not caching
    assert "--no-enable-prefix-caching" not in decode


@pytest.mark.parametrize("caching", [False, True])
def test_reference_reports_cached_tokens_with_or_without_prefix_caching(caching: bool) -> None:
    plan = _plan("reference", side_channel_port=None, control_port=None, prefix_caching=caching)
    argv = VllmCommands("py").command(plan, StackSettings()).argv
    assert "--enable-prompt-tokens-details" in argv
    assert ("--no-enable-prefix-caching" in argv) is not caching
    assert "--kv-transfer-config" not in argv
def test_control_channel_secret_and_host_reach_vllm_in_env_and_config() -> None:
    settings = StackSettings(connector="kvtether", control_host="127.0.0.2")
    cmd = VllmCommands("py").command(_plan(control_secret="shh"), settings)
    assert cmd.env["KVTETHER_CONTROL_SECRET"] == "shh"
    assert not any("shh" in a for a in cmd.argv)
    extra = json.loads(_flag(cmd.argv, "--kv-transfer-config"))["kv_connector_extra_config"]
    assert extra["kvtether_control_host"] == "127.0.0.2"
    assert "shh" not in repr(_plan(control_secret="shh"))


def test_cpu_instances_get_a_core_each_decode_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    settings = StackSettings(prefill=2, decode=2)

    def core(role: str, i: int) -> str:
        cmd = VllmCommands().command(_plan(role, name=f"{role}-{i}"), settings)
        return cmd.env["VLLM_CPU_OMP_THREADS_BIND"]

    assert [core("decode", 0), core("decode", 1), core("prefill", 0), core("prefill", 1)] == \
        ["0", "1", "2", "3"]
    assert core("reference", 0) == "0"  # the colocated baseline computes where decode-0 does
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    settings = StackSettings()  # 1P+1D on this project's 2-core machines
    assert [core("decode", 0), core("prefill", 0)] == ["0", "1"]


def test_cpu_instances_preload_tcmalloc_where_the_host_has_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    missing = str(tmp_path / "nowhere" / "libtcmalloc.so.4")
    assert tcmalloc_preload("", (missing, str(lib))) == {"LD_PRELOAD": str(lib)}
    # The caller's preloads stay, after tcmalloc; a tcmalloc the caller chose is kept as is.
    assert tcmalloc_preload("/x/libfoo.so", (str(lib),)) == {"LD_PRELOAD": f"{lib}:/x/libfoo.so"}
    assert tcmalloc_preload("/opt/libtcmalloc.so.4", (str(lib),)) == {}
    assert tcmalloc_preload("", (missing,)) == {}

    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setattr(_commands, "TCMALLOC_CANDIDATES", (str(lib),))
    for role in ("prefill", "decode", "reference"):
        cmd = VllmCommands().command(_plan(role), StackSettings())
        assert cmd.env["LD_PRELOAD"] == str(lib), role
    gpu = VllmCommands().command(_plan("decode"), StackSettings(profile="gpu"))
    assert "LD_PRELOAD" not in gpu.env
