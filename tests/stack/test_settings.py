"""StackSettings: profiles, precedence (flag > env > file > profile > default), config files."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from kvtether.errors import ConfigError
from kvtether.stack.profiles import PROFILES
from kvtether.stack.settings import StackSettings, stack_settings_subset


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("KVTETHER_"):
            monkeypatch.delenv(key)


def test_default_profile_is_cpu_tiny() -> None:
    s = StackSettings()
    assert (s.profile, s.device, s.dtype) == ("cpu-tiny", "cpu", "float32")
    assert s.prepared_model == "tiny"
    assert (s.block_size_tokens, s.max_model_len_tokens, s.kv_cache_space_gib) == (32, 4096, 1)
    assert (s.prefill, s.decode, s.port, s.connector) == (1, 1, 8000, "kvtether")


def test_every_profile_sets_every_device_field() -> None:
    keys = set(PROFILES["cpu-tiny"])
    for name, preset in PROFILES.items():
        assert set(preset) == keys, name
        s = StackSettings(profile=name)  # type: ignore[arg-type]
        assert all(getattr(s, k) == v for k, v in preset.items())


def test_profile_presets_differ_where_devices_differ() -> None:
    smol, gpu = StackSettings(profile="cpu-smol"), StackSettings(profile="gpu")
    assert (smol.prepared_model, smol.max_model_len_tokens) == ("smol", 2048)
    assert (gpu.device, gpu.kv_buffer_device, gpu.kv_cache_space_gib) == ("cuda", "cuda", None)
    assert not gpu.enforce_eager


def test_precedence_flag_over_env_over_file_over_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "stack.toml"
    cfg.write_text('dtype = "float16"\nblock-size-tokens = 64\nport = 9001\nprefill = 2\n')
    monkeypatch.setenv("KVTETHER_CONFIG", str(cfg))
    monkeypatch.setenv("KVTETHER_BLOCK_SIZE_TOKENS", "48")
    monkeypatch.setenv("KVTETHER_PORT", "9002")
    s = StackSettings(port=9003)  # type: ignore[call-arg]
    assert s.port == 9003  # flag/init beats env
    assert s.block_size_tokens == 48  # env beats file
    assert s.dtype == "float16"  # file beats profile
    assert s.prefill == 2
    assert s.max_model_len_tokens == 4096  # profile where nothing else says
    assert s.decode == 1  # field default


def test_profile_chosen_by_env_or_file_applies_its_preset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTETHER_PROFILE", "cpu-smol")
    assert StackSettings().max_model_len_tokens == 2048
    cfg = tmp_path / "s.yaml"
    cfg.write_text("profile: gpu\nmax_model_len_tokens: 1024\n")
    monkeypatch.delenv("KVTETHER_PROFILE")
    s = StackSettings(config=cfg)
    assert (s.profile, s.dtype, s.max_model_len_tokens) == ("gpu", "auto", 1024)


def test_explicit_value_equal_to_a_default_still_beats_the_profile() -> None:
    assert StackSettings(profile="gpu", enforce_eager=True).enforce_eager is True
    assert StackSettings(profile="gpu", kv_cache_space_gib=None).kv_cache_space_gib is None


CONFIG_FILES = {
    ".toml": 'profile = "gpu"\nprefill = 2\nblock-size-tokens = 64\nmax_retained_tokens = 5000\n'
    'extra_vllm_args = ["--seed", "1"]\n[vllm_env]\nUCX_TLS = "tcp"\n',
    ".yaml": "profile: gpu\nprefill: 2\nblock-size-tokens: 64\nmax_retained_tokens: 5000\n"
    "extra_vllm_args: [--seed, '1']\nvllm_env:\n  UCX_TLS: tcp\n",
}
CONFIG_FILES[".yml"] = CONFIG_FILES[".yaml"]
CONFIG_FILES[".conf"] = CONFIG_FILES[".toml"]  # anything but .yaml/.yml is TOML


@pytest.mark.parametrize("suffix", sorted(CONFIG_FILES))
def test_toml_and_yaml_config_files_set_the_same_settings(tmp_path: Path, suffix: str) -> None:
    cfg = tmp_path / f"stack{suffix}"
    cfg.write_text(CONFIG_FILES[suffix])
    s = StackSettings(config=cfg)
    assert (s.profile, s.prefill, s.block_size_tokens, s.max_retained_tokens) == (
        "gpu", 2, 64, 5000
    )
    assert (s.extra_vllm_args, s.vllm_env) == (["--seed", "1"], {"UCX_TLS": "tcp"})
    assert s.dtype == "auto"  # the file's profile applies where the file says nothing
    assert "dtype" not in s.model_fields_set


def test_config_file_values_are_validated_like_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "s.yaml"
    cfg.write_text("max_retained_tokens: 0\n")
    with pytest.raises(ValidationError, match="max_retained_tokens"):
        StackSettings(config=cfg)


@pytest.mark.parametrize(
    ("text", "suffix", "message"),
    [
        ("nope = 1\n", ".toml", "unknown setting.*nope"),
        # handoff_lease_s is a router setting the stack does not take
        ("nope: 1\nhandoff_lease_s: 3\nport: 1\n", ".yml", r"in .*: handoff_lease_s, nope \("),
        ("prefill = [\n", ".toml", "cannot parse"),
        ("prefill: [\n", ".yaml", "cannot parse"),
        ("- 1\n", ".yaml", "must hold a mapping"),
    ],
)
def test_bad_config_files_say_what_is_wrong(
    tmp_path: Path, text: str, suffix: str, message: str
) -> None:
    cfg = tmp_path / f"bad{suffix}"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=message):
        StackSettings(config=cfg)


def test_a_subset_rejects_the_same_unknown_keys(tmp_path: Path) -> None:
    Target = stack_settings_subset("Target", ("config", "state_dir"), "doc")
    cfg = tmp_path / "s.toml"
    cfg.write_text("prefill = 3\nnope = 1\n")
    with pytest.raises(ConfigError, match="unknown setting.*nope"):
        Target(config=cfg)  # type: ignore[call-arg]


def test_yaml_file_precedence_matches_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "stack.yaml"
    cfg.write_text("lease_ttl_s: 30\nport: 9001\ndecode: 2\n")
    monkeypatch.setenv("KVTETHER_CONFIG", str(cfg))
    monkeypatch.setenv("KVTETHER_LEASE_TTL_S", "40")
    s = StackSettings(port=9003)  # type: ignore[call-arg]
    assert (s.port, s.lease_ttl_s, s.decode, s.prefill) == (9003, 40, 2, 1)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        StackSettings(config=tmp_path / "absent.toml")


def test_invalid_values_are_rejected() -> None:
    for bad in ({"prefill": 0}, {"port": 70000}, {"connector": "lmcache"}, {"profile": "tpu"}):
        with pytest.raises(ValidationError):
            StackSettings(**bad)  # type: ignore[arg-type]


def test_ports_are_distinct_per_instance() -> None:
    s = StackSettings(prefill=4, decode=4)
    n = s.instance_count
    ports = [s.vllm_port(i) for i in range(n)] + [s.side_channel_port(i) for i in range(n)]
    ports += [s.control_port(i) for i in range(n)] + [s.port]
    assert len(set(ports)) == len(ports)


def test_state_dir_follows_kvtether_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTETHER_HOME", str(tmp_path))
    assert StackSettings().state_dir == tmp_path / "stack"
    monkeypatch.delenv("KVTETHER_HOME")
    monkeypatch.chdir(tmp_path)
    assert StackSettings().state_dir == tmp_path / ".kvtether" / "stack"


def test_subset_shares_fields_env_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Target = stack_settings_subset("Target", ("config", "state_dir"), "doc")
    assert Target.model_fields["state_dir"].description == (
        StackSettings.model_fields["state_dir"].description
    )
    cfg = tmp_path / "s.toml"
    cfg.write_text(f'state_dir = "{tmp_path / "x"}"\nprefill = 3\n')  # prefill: known, not ours
    assert Target(config=cfg).state_dir == tmp_path / "x"  # type: ignore[call-arg]
    monkeypatch.setenv("KVTETHER_STATE_DIR", str(tmp_path / "y"))
    assert Target(config=cfg).state_dir == tmp_path / "y"  # type: ignore[call-arg]


def test_public_surface() -> None:
    import kvtether.stack as stack

    assert sorted(stack.__all__) == sorted(
        [
            "Stack",
            "StackSettings",
            "PROFILES",
            "ProfileName",
            "InstanceStatus",
            "start_reference_vllm",
            "stack_status",
            "stack_down",
            "resolve_model",
            "prepare_model",
            "StackError",
            "PortInUseError",
            "StackAlreadyRunningError",
            "StackNotRunningError",
            "InstanceFailedError",
            "RestartsExhaustedError",
        ]
    )
    assert all(hasattr(stack, name) for name in stack.__all__)
