"""Stack settings: one model for CLI flags, ``KVTETHER_*`` env vars and a config file.

Precedence, highest first: init kwargs / CLI flags > env vars > config file (``--config`` or
``KVTETHER_CONFIG``; TOML or YAML, flat keys named like the fields) > the profile's preset
(:mod:`kvtether.stack.profiles`) > field defaults.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, create_model, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

from kvtether.router.settings import AccessSettings, KVBlockSizeTokens, RetentionSettings
from kvtether.errors import ConfigError
from kvtether.stack.profiles import DEFAULT_PROFILE, ProfileName, profile_defaults

__all__ = [
    "ConnectorKind",
    "LOCAL_STORE",
    "StackSettings",
    "StackSettingsBase",
    "default_state_dir",
    "resolve_model",
    "stack_settings_subset",
]

ConnectorKind = Literal["nixl", "kvtether"]
ENV_PREFIX = "KVTETHER_"
LOCAL_STORE = "local"
MEMORY_STORE = "memory"  # the router's default: conversations in the router process
# URLs the `redis` client opens (a Valkey server speaks the same protocol).
STORE_URL_SCHEMES = ("redis", "rediss", "unix")


def default_state_dir() -> Path:
    """``$KVTETHER_HOME/stack`` if set, else ``.kvtether/stack`` under the working directory."""
    home = os.environ.get("KVTETHER_HOME")
    return (Path(home) if home else Path.cwd() / ".kvtether") / "stack"


def _preset(description: str) -> Any:
    """A device-specific field: no default of its own, the chosen profile always supplies it."""
    return Field(default=None, description=f"{description} (default: from --profile)")


class StackSettingsBase(BaseSettings):
    """Sources shared by :class:`StackSettings` and its subsets: init > env > config file."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        validate_default=False,
        cli_kebab_case=True,
        cli_implicit_flags=True,
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, ConfigFileSource(settings_cls))


class StackSettings(RetentionSettings, AccessSettings, StackSettingsBase):
    """How to run N prefill + M decode vLLM instances and the kvtether router.

    The KV retention settings (lease TTL, retained-token cap, ...) and the access settings
    (API keys, body limit) are the router's own
    (:class:`~kvtether.router.settings.RetentionSettings`,
    :class:`~kvtether.router.settings.AccessSettings`), inherited, not re-declared: ``stack up``
    forwards them to the router it starts (the API key in its environment).
    """

    config: Path | None = Field(default=None, description="TOML or YAML file with stack settings")
    profile: ProfileName = Field(default=DEFAULT_PROFILE, description="named preset of settings")
    prefill: int = Field(default=1, ge=1, le=64, description="number of prefill instances")
    decode: int = Field(default=1, ge=1, le=64, description="number of decode instances")
    model: Path | None = Field(
        default=None, description="model directory (default: the profile's prepared model)"
    )
    served_model_name: str | None = Field(
        default=None, description="model name clients use (default: the prepared model's name)"
    )
    host: str = Field(default="127.0.0.1", description="interface every process binds to")
    port: int = Field(
        default=8000, ge=1, le=65535,
        description="the stack's public port: the router's, or with --routers above 1 the "
        "round-robin front's (replica i listens on port+1+i, a local store after them)",
    )
    routers: int = Field(
        default=1, ge=1, le=16,
        description="router replicas; above 1 a round-robin front listens on --port and "
        "--store is required (each replica would otherwise keep its own conversations)",
    )
    store: str | None = Field(
        default=None,
        description="conversation store the routers share: 'local' (start redis-server or "
        "valkey-server on loopback for this stack, no persistence) or a redis://host:port/db "
        "URL; 'memory' or unset: the router keeps them itself (one router only)",
    )
    base_port: int = Field(default=8100, ge=1, le=65535, description="vLLM instance i: base+i")
    side_channel_base_port: int = Field(
        default=5600, ge=1, le=65535, description="NIXL side channel of instance i: base+stride*i"
    )
    side_channel_stride: int = Field(default=10, ge=1, description="port gap between instances")
    control_base_port: int = Field(
        default=5900, ge=1, le=65535, description="kvtether connector control of instance i: base+i"
    )
    control_host: str = Field(
        default="127.0.0.1",
        description="interface the connectors' control channels bind to (the router reaches "
        "them there); loopback unless the router runs on another host",
    )
    control_secret: SecretStr | None = Field(
        default=None,
        description="shared secret of the control channels (default: a new random one per "
        "`stack up`, handed to the instances and the router in their environment)",
    )

    # Device-specific: defaults come from the profile only.
    device: Literal["cpu", "cuda"] = _preset("device vLLM runs on")
    prepared_model: Literal["tiny", "smol", "agents"] = _preset("model prepared when --model is not given")
    dtype: str = _preset("vLLM --dtype")
    enforce_eager: bool = _preset("vLLM --enforce-eager")
    block_size_tokens: KVBlockSizeTokens = _preset("vLLM KV block size")
    max_model_len_tokens: int = _preset("vLLM --max-model-len")
    max_num_batched_tokens: int | None = _preset(
        "vLLM --max-num-batched-tokens, the tokens one engine step computes; none = vLLM's "
        "default"
    )
    long_prefill_token_threshold: int | None = _preset(
        "vLLM --long-prefill-token-threshold, the most tokens of one prompt a step computes "
        "while other requests wait; none = vLLM's 0 (no cap)"
    )
    kv_cache_space_gib: int | None = _preset("CPU KV cache GiB (VLLM_CPU_KVCACHE_SPACE)")
    kv_buffer_device: Literal["cpu", "cuda"] = _preset("NIXL kv_buffer_device")
    gpu_memory_utilization: float | None = _preset("vLLM --gpu-memory-utilization")
    idle_sleep: bool = _preset(
        "engines sleep while they only hold KV for a remote reader (kvtether connector only; "
        "vLLM --scheduler-cls kvtether.connector.scheduler.IdleSleepScheduler)"
    )
    progress_thread_delay_us: int | None = _preset(
        "NIXL progress-thread wait in microseconds; none = nixl's busy-polling 0 "
        "(kvtether connector only)"
    )
    rpc_busy_loop_s: float | None = _preset(
        "vLLM worker spins this long on its RPC queue before blocking; none = vLLM's 1 s "
        "(kvtether connector only)"
    )
    vllm_env: dict[str, str] = _preset(
        "environment for every vLLM instance (transport settings such as UCX_*); the "
        "caller's environment wins"
    )
    gpu_ids: list[int] = Field(
        default_factory=list, description="GPUs to spread instances over (CUDA_VISIBLE_DEVICES)"
    )

    kv_load_failure_policy: Literal["recompute", "fail"] = Field(
        default="recompute", description="what vLLM does when a KV read fails"
    )
    prefill_kv_lease_s: int | None = Field(
        default=None, ge=6, description="how long prefill holds a new turn's KV for decode's "
        "read, extended by decode's heartbeats while the turn waits (vLLM's kv_lease_duration); "
        "none = 120 s on CPU, vLLM's 30 s on GPU. Decode declines a later read and recomputes"
    )
    idle_tick_s: float = Field(
        default=5.0, gt=0, description="a sleeping engine steps this often while it holds KV "
        "(frees blocks a reader has finished with)"
    )
    connector: ConnectorKind = Field(
        default="kvtether",
        description="'kvtether' (leases, control channel, streamed handles) or 'nixl' "
        "(upstream NixlConnector: fixed decoder_kv_blocks_ttl, no streamed reuse); default "
        "'kvtether' for reuse_policy kvtether, else 'nixl' (set it to run a baseline policy "
        "on the kvtether connector)",
    )
    prefill_prefix_caching: bool = Field(
        default=True,
        description="prefill instances keep vLLM's prefix cache; false gives them "
        "--no-enable-prefix-caching (a prefill pool whose cache does not hold the "
        "conversation: many instances, or churn). Decode instances are unchanged",
    )

    restart: bool = Field(
        default=True,
        description="a foreground `stack up` restarts a process that exits, with back-off",
    )
    restart_backoff_s: float = Field(
        default=2.0, gt=0, description="wait before the first restart; doubles per failure"
    )
    restart_backoff_max_s: float = Field(default=60.0, gt=0, description="longest back-off")
    restart_max_failures: int = Field(
        default=5, ge=1,
        description="give up (and stop the stack) at this many failures of one process "
        "(deaths or failed restarts) within --restart-window-s",
    )
    restart_window_s: float = Field(
        default=600.0, gt=0, description="the window --restart-max-failures counts in"
    )
    health_timeout_s: float = Field(default=300.0, gt=0, description="wait this long for /health")
    stop_timeout_s: float = Field(default=15.0, gt=0, description="SIGTERM grace before SIGKILL")
    state_dir: Path = Field(
        default_factory=default_state_dir, description="where stack.json and logs/ go"
    )
    detach: bool = Field(default=False, description="return once healthy, leave the stack running")
    start_router: bool = Field(default=True, description="also start the kvtether router")
    router_tokenizer: bool = Field(
        default=True,
        description="the router tokenizes prompts itself with the model directory's tokenizer "
        "(checked against vLLM's token ids) instead of asking prefill's /tokenize per turn",
    )
    warm_up: bool = Field(
        default=True,
        description="once healthy, run throw-away turns until one reuses KV (opens NIXL links)",
    )
    extra_vllm_args: list[str] = Field(
        default_factory=list, description="appended to every vLLM command line"
    )

    @model_validator(mode="after")
    def _apply_profile(self) -> StackSettings:
        # Fill what no source set from the profile, without marking it as set: a settings
        # object re-validated with another profile (or dumped with exclude_unset) keeps only
        # what someone actually chose.
        for name, value in profile_defaults(self.profile).items():
            if name not in self.model_fields_set:
                self.__dict__[name] = value
        self._resolve_connector()
        self._check_scale_out()
        return self

    def _check_scale_out(self) -> None:
        if self.store == MEMORY_STORE:
            self.__dict__["store"] = None  # the router's own default: nothing to forward
        if self.store is not None and self.store != LOCAL_STORE:
            scheme = self.store.partition("://")[0].lower()
            if "://" not in self.store or scheme not in STORE_URL_SCHEMES:
                raise ConfigError(
                    f"--store {self.store!r} is neither 'local', 'memory' nor a Redis/Valkey "
                    "URL; pass --store local or --store redis://HOST:PORT/DB"
                )
        if self.routers > 1 and self.store is None:
            raise ConfigError(
                f"--routers {self.routers} needs a shared conversation store: each replica "
                "would keep its own conversations and a turn landing on another replica would "
                "lose its KV; add --store local (a Redis server for this stack) or --store "
                "redis://HOST:PORT/DB"
            )

    def _resolve_connector(self) -> None:
        """The baselines run what vLLM ships: reuse_policy upstream / off → connector nixl.

        Unless ``connector`` is set: ``--connector kvtether`` runs them on kvtether's connector
        (its idle-sleeping engine on CPU hosts) with the router applying the baseline's reuse
        rules, so a comparison measures the reuse policy alone (what `kvtether bench` does).
        """
        if self.reuse_policy != "kvtether" and "connector" not in self.model_fields_set:
            self.__dict__["connector"] = "nixl"

    # --- derived values ------------------------------------------------------------------
    @property
    def instance_count(self) -> int:
        return self.prefill + self.decode

    def vllm_port(self, index: int) -> int:
        """Port of instance ``index`` (prefills first, then decodes)."""
        return self.base_port + index

    def side_channel_port(self, index: int) -> int:
        return self.side_channel_base_port + self.side_channel_stride * index

    def control_port(self, index: int) -> int:
        return self.control_base_port + index

    def router_ports(self) -> list[int]:
        """One router: --port. Several: port+1+i for replica i (the front has --port)."""
        if self.routers == 1:
            return [self.port]
        return [self.port + 1 + i for i in range(self.routers)]

    @property
    def local_store_port(self) -> int:
        """Port of the Redis server ``--store local`` starts: the first after the routers'."""
        return self.router_ports()[-1] + 1


def resolve_model(settings: StackSettings) -> tuple[Path, str]:
    """The model directory to serve and the name clients use for it."""
    if settings.model is None:
        from kvtether.stack.models import prepare_model

        path = prepare_model(settings.prepared_model)
        return path, settings.served_model_name or settings.prepared_model
    path = settings.model.expanduser().resolve()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model directory {path} has no config.json; prepare one with "
            f"`kvtether model prepare tiny --out {path}` or pass another --model"
        )
    return path, settings.served_model_name or path.name


def stack_settings_subset(name: str, fields: tuple[str, ...], doc: str) -> type[StackSettingsBase]:
    """A settings model with only ``fields`` of :class:`StackSettings` (same env, same file).

    Used for commands that need a few stack settings (``stack down`` needs the state dir): the
    fields, their defaults and help come from :class:`StackSettings`, never re-declared.
    """
    definitions: dict[str, Any] = {
        f: (StackSettings.model_fields[f].annotation, StackSettings.model_fields[f]) for f in fields
    }
    model = create_model(name, __base__=StackSettingsBase, __doc__=doc, **definitions)
    return model


class ConfigFileSource(PydanticBaseSettingsSource):
    """The file named by ``config`` in a higher-priority source (flag, init or env).

    Read by pydantic-settings' own TOML or YAML source, chosen by the file's suffix
    (``.yaml``/``.yml``: YAML, anything else: TOML). Keys are the field names (``-`` may stand
    for ``_``); a key no :class:`StackSettings` field has is a :class:`ConfigError`.
    """

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        raise NotImplementedError  # __call__ reads the whole file at once

    def __call__(self) -> dict[str, Any]:
        path = self.current_state.get("config")
        if not path:
            return {}
        values = read_config_file(Path(path))
        # A subset model (e.g. for `stack down`) reads the same file and keeps what it knows.
        return {k: v for k, v in values.items() if k in self.settings_cls.model_fields}


def read_config_file(path: Path) -> dict[str, Any]:
    """Field name → value of every :class:`StackSettings` setting in a TOML or YAML file."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    source_cls = _YamlFile if path.suffix.lower() in (".yaml", ".yml") else _TomlFile
    try:
        values = source_cls(StackSettings, path)()
    except ConfigError:
        raise
    except ImportError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    except Exception as exc:  # each parser raises its own error types
        detail = " ".join(str(exc).split())  # YAML's messages span lines
        raise ConfigError(f"cannot parse config file {path}: {detail}") from None
    unknown = sorted(set(values) - set(StackSettings.model_fields))
    if unknown:
        raise ConfigError(
            f"unknown setting(s) in {path}: {', '.join(unknown)} "
            "(see `kvtether stack up --help` for the names)"
        )
    values.pop("config", None)
    return values


def _flat_settings(data: Any, path: Path) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


class _TomlFile(TomlConfigSettingsSource):
    def _read_file(self, file_path: Path) -> dict[str, Any]:  # type: ignore[override]
        return _flat_settings(super()._read_file(file_path), file_path)


class _YamlFile(YamlConfigSettingsSource):
    def _read_file(self, file_path: Path) -> dict[str, Any]:  # type: ignore[override]
        return _flat_settings(super()._read_file(file_path), file_path)
