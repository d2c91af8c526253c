"""What `stack up` forwards to the router is declared once: a value one accepts, both accept."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from pydantic_settings import CliApp

from kvtether.cli import RouterCommand
from kvtether.router.settings import AccessSettings, RetentionSettings, RouterSettings
from kvtether.stack._commands import InstancePlan, VllmCommands, router_values
from kvtether.stack.settings import StackSettings

# Stack setting → the router setting it becomes; everything else the router gets comes from the
# stack's plan (where the router listens, which instances it routes to).
FORWARDED = {name: name for name in RetentionSettings.model_fields}
FORWARDED.update({name: name for name in AccessSettings.model_fields if name != "api_key"})
FORWARDED["block_size_tokens"] = "kv_block_size_tokens"
# Forwarded in the router's environment, never on its command line.
SECRET = {"api_key": "KVTETHER_ROUTER_API_KEY"}
FROM_PLAN = {"host", "port", "prefill_urls", "decode_urls"}
PROBES: list[Any] = [-1, 0, 0.5, 1, 16, 10**9, None, "x", float("inf")]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("KVTETHER_"):
            monkeypatch.delenv(key)


def _plan() -> InstancePlan:
    return InstancePlan(
        name="router",
        role="router",
        host="127.0.0.1",
        port=8000,
        log_path=Path("r.log"),
        prefill_urls=("http://127.0.0.1:8100",),
        decode_urls=("http://127.0.0.1:8101",),
    )


def _accepts(model: type[Any], name: str, value: Any) -> bool:
    try:
        model(**{name: value})
    except ValidationError:
        return False
    return True


def test_router_gets_exactly_the_forwarded_settings_and_the_plan() -> None:
    values = router_values(_plan(), StackSettings(max_retained_tokens=100))
    assert set(values) == FROM_PLAN | set(FORWARDED.values())
    assert set(values) <= set(RouterSettings.model_fields)


def test_the_router_gets_the_model_directory_to_tokenize_with() -> None:
    plan = replace(_plan(), model_dir=Path("/models/smol"))
    assert router_values(plan, StackSettings())["tokenizer"] == Path("/models/smol")
    argv = VllmCommands("py").command(plan, StackSettings()).argv
    parsed = CliApp.run(RouterCommand, cli_args=argv[4:], cli_cmd_method_name="no_such_method")
    assert parsed.tokenizer == Path("/models/smol")


@pytest.mark.parametrize(("stack_name", "router_name"), sorted(FORWARDED.items()))
@pytest.mark.parametrize("value", PROBES, ids=repr)
def test_every_forwarded_setting_validates_the_same_in_stack_and_router(
    stack_name: str, router_name: str, value: Any
) -> None:
    assert _accepts(StackSettings, stack_name, value) == _accepts(
        RouterSettings, router_name, value
    )


def test_a_zero_retained_token_cap_is_rejected_by_both() -> None:
    # It used to pass `stack up` and then stop the router it started.
    assert not _accepts(StackSettings, "max_retained_tokens", 0)
    assert not _accepts(RouterSettings, "max_retained_tokens", 0)


def test_the_router_command_line_round_trips_every_forwarded_value() -> None:
    chosen = {
        "kv_recompute_threshold_tokens": 0,
        "decoder_kv_blocks_ttl_s": 0.5,
        "lease_ttl_s": 7,
        "max_retained_tokens": 1,
        "max_retained_tokens_per_tenant": 3,
        "max_branches": 2,
        "local_prefill_max_tokens": 300,
        "api_key_file": Path("/etc/kvtether/keys"),
        "metrics_require_api_key": True,
        "max_request_body_bytes": 2048,
        "block_size_tokens": 1,
        "reuse_policy": "upstream",
    }
    assert set(chosen) == set(FORWARDED)  # a new forwarded setting needs a value here
    settings = StackSettings(**chosen)  # type: ignore[arg-type]
    argv = VllmCommands("py").command(_plan(), settings).argv
    parsed = CliApp.run(RouterCommand, cli_args=argv[4:], cli_cmd_method_name="no_such_method")
    for stack_name, router_name in FORWARDED.items():
        assert getattr(parsed, router_name) == chosen[stack_name], router_name


def test_secrets_reach_the_router_in_its_environment_only() -> None:
    from dataclasses import replace

    settings = StackSettings(api_key="the-key")
    command = VllmCommands("py").command(replace(_plan(), control_secret="ctl"), settings)
    assert not any("the-key" in a or "ctl" in a for a in command.argv)
    assert command.env["KVTETHER_ROUTER_API_KEY"] == "the-key"
    assert command.env["KVTETHER_ROUTER_CONTROL_SECRET"] == "ctl"
    with pytest.MonkeyPatch.context() as mp:
        for name, value in command.env.items():
            mp.setenv(name, value)
        parsed = CliApp.run(RouterCommand, cli_args=command.argv[4:],
                            cli_cmd_method_name="no_such_method")
    assert parsed.api_key is not None and parsed.api_key.get_secret_value() == "the-key"
    assert parsed.control_secret is not None
    assert parsed.control_secret.get_secret_value() == "ctl"
    assert set(SECRET) | set(FORWARDED) >= set(AccessSettings.model_fields)


def test_each_model_keeps_its_env_prefix_for_the_shared_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVTETHER_LEASE_TTL_S", "11")
    monkeypatch.setenv("KVTETHER_ROUTER_LEASE_TTL_S", "22")
    assert StackSettings().lease_ttl_s == 11
    assert RouterSettings().lease_ttl_s == 22


@pytest.mark.parametrize("own", [True, False])
def test_router_tokenizer_decides_whether_the_router_gets_the_model(own: bool,
                                                                   tmp_path: Path) -> None:
    from kvtether.stack._plan import plan_processes

    settings = StackSettings(router_tokenizer=own, state_dir=tmp_path)
    router = next(p for p in plan_processes(settings, tmp_path / "model", "m", None)
                  if p.role == "router")
    assert ("tokenizer" in router_values(router, settings)) is own
