"""Command lines for every process the stack starts.

The launcher decides *what* runs where (an :class:`InstancePlan`: role, ports, URLs); a
:class:`CommandBuilder` decides *how* (argv and env). :class:`VllmCommands` is the real one;
tests inject a builder that starts a fake server instead.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvtether.protocol import CONTROL_SECRET_ENV
from kvtether.router.settings import AccessSettings, RetentionSettings
from kvtether.stack._state import Role
from kvtether.stack._store import find_store_server, store_server_argv
from kvtether.stack.models import model_server_args
from kvtether.stack.settings import StackSettings

__all__ = ["InstancePlan", "Command", "CommandBuilder", "VllmCommands", "kv_transfer_config",
           "core_list", "stack_cores"]

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# The kvtether connector keeps upstream's class name: some vLLM code checks for it by name.
KVTETHER_CONNECTOR_MODULE = "kvtether.connector.nixl"
IDLE_SLEEP_SCHEDULER = "kvtether.connector.scheduler.IdleSleepScheduler"
TETHER_SCHEDULER = "kvtether.connector.scheduler.TetherScheduler"
# Each engine-step RPC of a CPU worker watched whole for a stall (kvtether.connector.worker).
WATCHED_CPU_WORKER = "kvtether.connector.worker.WatchedCPUWorker"


@dataclass(frozen=True)
class InstancePlan:
    """Where one process runs and what it talks to."""

    name: str
    role: Role
    host: str
    port: int
    log_path: Path
    model_dir: Path | None = None
    served_model_name: str | None = None
    side_channel_port: int | None = None
    control_port: int | None = None
    gpu_id: int | None = None
    gpu_memory_utilization: float | None = None  # this instance's share of its GPU
    # The reference only: vLLM's prefix caching on (a simple colocated deployment) or off
    # (the correctness reference).
    prefix_caching: bool = False
    # The cores a CPU instance's worker computes on, as VLLM_CPU_OMP_THREADS_BIND takes them
    # ("0-1"); None: the one core cpu_core gives it. Set for the bench's colocated baselines.
    cpu_cores: str | None = None
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    prefill_control_urls: tuple[str, ...] = ()
    decode_control_urls: tuple[str, ...] = ()
    # The control channels' shared secret: to vLLM and the router through their environment.
    control_secret: str | None = field(default=None, repr=False)
    # A router: the conversation store it shares with the other replicas (may hold a password).
    store_url: str | None = field(default=None, repr=False)
    # The front: the router replicas it spreads requests over.
    upstream_urls: tuple[str, ...] = ()
    # The local store: its working directory (no persistence; Redis still wants one).
    data_dir: Path | None = None

    @property
    def url(self) -> str:
        scheme = "redis" if self.role == "store" else "http"
        return f"{scheme}://{self.host}:{self.port}"


@dataclass(frozen=True)
class Command:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


class CommandBuilder(Protocol):
    """Turns a plan into a command line. ``role`` says which kind of process it is."""

    def command(self, plan: InstancePlan, settings: StackSettings) -> Command: ...


def kv_transfer_config(plan: InstancePlan, settings: StackSettings) -> dict[str, Any]:
    """vLLM ``--kv-transfer-config`` for a P/D instance (both roles run ``kv_both``)."""
    extra: dict[str, Any] = {
        # reuse_policy off is one-way P/D: decode frees a turn's KV as soon as it finishes.
        "bidirectional_kv_xfer": settings.reuse_policy != "off",
        "kv_recompute_threshold": settings.kv_recompute_threshold_tokens,
        "decoder_kv_blocks_ttl": _number(settings.decoder_kv_blocks_ttl_s),
    }
    if settings.prefill_kv_lease_s is not None:
        extra["kv_lease_duration"] = settings.prefill_kv_lease_s
    elif settings.device == "cpu":
        # P holds a turn's KV until D reads it, under upstream's 30 s lease; a slow first
        # NIXL handshake on a busy CPU box can outlast that (D then declines the read and
        # recomputes: kvtether's prefill exports the deadline).
        extra["kv_lease_duration"] = 120
    config: dict[str, Any] = {"kv_connector": "NixlConnector"}
    if settings.connector == "kvtether":
        config["kv_connector_module_path"] = KVTETHER_CONNECTOR_MODULE
        extra.update(
            kvtether_role=plan.role,
            kvtether_lease_ttl_s=_number(settings.lease_ttl_s),
            kvtether_control_port=plan.control_port,
            kvtether_control_host=settings.control_host,
            kvtether_idle_tick_s=_number(settings.idle_tick_s),
        )
        if settings.progress_thread_delay_us is not None:
            extra["kvtether_progress_thread_delay_us"] = settings.progress_thread_delay_us
        if settings.rpc_busy_loop_s is not None:
            extra["kvtether_rpc_busy_loop_s"] = _number(settings.rpc_busy_loop_s)
    config.update(
        kv_role="kv_both",
        kv_buffer_device=settings.kv_buffer_device,
        kv_load_failure_policy=settings.kv_load_failure_policy,
        kv_connector_extra_config=extra,
    )
    return config


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


class VllmCommands:
    """Real processes: ``python -m vllm.entrypoints.openai.api_server``, ``kvtether router``,
    ``kvtether front`` and the local store's ``redis-server`` (or ``valkey-server``)."""

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python

    def command(self, plan: InstancePlan, settings: StackSettings) -> Command:
        if plan.role == "router":
            return self._router(plan, settings)
        if plan.role == "front":
            return self._front(plan, settings)
        if plan.role == "store":
            assert plan.data_dir is not None
            return Command(store_server_argv(find_store_server(), plan.port, plan.data_dir))
        return self._vllm(plan, settings)

    def _front(self, plan: InstancePlan, settings: StackSettings) -> Command:
        argv = [self.python, "-m", "kvtether", "front", "--host", plan.host,
                "--port", str(plan.port), "--upstream-urls", json.dumps(list(plan.upstream_urls)),
                # Larger bodies would be refused by every replica anyway.
                "--max-request-body-bytes", str(settings.max_request_body_bytes)]
        return Command(argv, {"PYTHONUNBUFFERED": "1"})

    def _vllm(self, plan: InstancePlan, settings: StackSettings) -> Command:
        assert plan.model_dir is not None and plan.served_model_name is not None
        argv = [
            self.python,
            "-m",
            VLLM_SERVER_MODULE,
            "--model",
            str(plan.model_dir),
            "--served-model-name",
            plan.served_model_name,
            "--host",
            plan.host,
            "--port",
            str(plan.port),
            "--dtype",
            settings.dtype,
            "--block-size",
            str(settings.block_size_tokens),
            "--max-model-len",
            str(settings.max_model_len_tokens),
        ]
        if settings.enforce_eager:
            argv.append("--enforce-eager")
        if settings.max_num_batched_tokens is not None:
            argv += ["--max-num-batched-tokens", str(settings.max_num_batched_tokens)]
        if settings.long_prefill_token_threshold is not None:
            argv += ["--long-prefill-token-threshold", str(settings.long_prefill_token_threshold)]
        argv += model_server_args(plan.model_dir)
        if plan.gpu_memory_utilization is not None:
            argv += ["--gpu-memory-utilization", str(plan.gpu_memory_utilization)]
        env = {k: v for k, v in settings.vllm_env.items() if k not in os.environ}
        env["PYTHONUNBUFFERED"] = "1"
        if settings.device == "cpu" and "VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT" not in os.environ:
            # vLLM fails a request (500) whose chat template takes over 30 s to render; a
            # loaded 2-core machine got there in CI.
            env["VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT"] = "300"
        if settings.kv_cache_space_gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kv_cache_space_gib)
        if plan.gpu_id is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(plan.gpu_id)
        if settings.device == "cpu" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            env["VLLM_CPU_OMP_THREADS_BIND"] = plan.cpu_cores or str(cpu_core(plan, settings))
        if settings.device == "cpu":
            env.update(tcmalloc_preload(os.environ.get("LD_PRELOAD", "")))
        if plan.role == "reference":
            # One colocated engine, no transfer: the correctness reference (no prefix cache)
            # or the simple colocated deployment (prefix cache). Either reports its cache hits
            # in usage.prompt_tokens_details.cached_tokens.
            if not plan.prefix_caching:
                argv.append("--no-enable-prefix-caching")
            argv.append("--enable-prompt-tokens-details")
        else:
            if plan.role == "prefill" and not settings.prefill_prefix_caching:
                argv.append("--no-enable-prefix-caching")
            config = kv_transfer_config(plan, settings)
            argv += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
            if settings.connector == "kvtether":
                # Step timings and prefix-cache lookups for the control channel; sleeping too.
                argv += ["--scheduler-cls",
                         IDLE_SLEEP_SCHEDULER if settings.idle_sleep else TETHER_SCHEDULER]
            if settings.connector == "kvtether" and settings.device == "cpu":
                argv += ["--worker-cls", WATCHED_CPU_WORKER]
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = plan.host
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(plan.side_channel_port)
            if settings.connector == "kvtether" and plan.control_port is not None:
                env["KVTETHER_CONTROL_PORT"] = str(plan.control_port)
                if plan.control_secret:
                    env[CONTROL_SECRET_ENV] = plan.control_secret
        return Command(argv + list(settings.extra_vllm_args), env)

    def _router(self, plan: InstancePlan, settings: StackSettings) -> Command:
        values = router_values(plan, settings)
        argv = [self.python, "-m", "kvtether", "router"]
        for name, value in values.items():
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                argv += [flag] if value else []
            elif isinstance(value, (list, tuple)):
                argv += [flag, json.dumps(list(value))]
            elif value is not None:
                argv += [flag, str(value)]
        if plan.store_url is not None and not _has_password(plan.store_url):
            argv += ["--store", plan.store_url]
        return Command(argv, {"PYTHONUNBUFFERED": "1", **router_secrets(plan, settings)})


def router_values(plan: InstancePlan, settings: StackSettings) -> dict[str, Any]:
    """RouterSettings values for this stack's router.

    Where it listens and what it routes to come from the plan; the block size is vLLM's; every
    :class:`~kvtether.router.settings.RetentionSettings` field is forwarded as is (the stack
    inherits those from the router, so each one validates the same on both sides).
    """
    values: dict[str, Any] = {
        "host": plan.host,
        "port": plan.port,
        "prefill_urls": list(plan.prefill_urls),
        "decode_urls": list(plan.decode_urls),
        "prefill_control_urls": list(plan.prefill_control_urls),
        "decode_control_urls": list(plan.decode_control_urls),
        "kv_block_size_tokens": settings.block_size_tokens,
    }
    if plan.model_dir is not None:  # the router tokenizes prompts itself (router_tokenizer)
        values["tokenizer"] = plan.model_dir
    values.update({name: getattr(settings, name) for name in RetentionSettings.model_fields})
    values.update({name: getattr(settings, name) for name in AccessSettings.model_fields
                   if name not in _SECRETS})
    return {k: v for k, v in values.items() if v != []}


# Settings that go to the router in its environment, never on its command line (`ps` shows
# command lines to every user of the host).
_SECRETS = ("api_key",)


def router_secrets(plan: InstancePlan, settings: StackSettings) -> dict[str, str]:
    """``KVTETHER_ROUTER_*`` environment variables carrying this stack's secrets."""
    env = {}
    if settings.api_key is not None:
        env["KVTETHER_ROUTER_API_KEY"] = settings.api_key.get_secret_value()
    if plan.control_secret:
        env["KVTETHER_ROUTER_CONTROL_SECRET"] = plan.control_secret
    if plan.store_url is not None and _has_password(plan.store_url):
        env["KVTETHER_ROUTER_STORE"] = plan.store_url
    return env


def _has_password(url: str) -> bool:
    """A store URL with credentials (``redis://:pw@host``) goes in the environment, not argv."""
    return "@" in url.partition("://")[2].partition("/")[0]


# Where Linux distributions put gperftools' tcmalloc (Debian/Ubuntu: libtcmalloc-minimal4,
# Fedora/RHEL: gperftools-libs). `make setup` installs Debian's where it can.
TCMALLOC_CANDIDATES = tuple(
    f"{lib}/{name}"
    for lib in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu",
                "/usr/lib/aarch64-linux-gnu", "/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")
    for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
)


def tcmalloc_preload(ld_preload: str, candidates: tuple[str, ...] | None = None) -> dict[str, str]:
    """``{"LD_PRELOAD": ...}`` that puts tcmalloc first for a CPU vLLM, or ``{}``.

    vLLM's CPU worker asks for tcmalloc in ``LD_PRELOAD`` (it warns at start without it) and
    preloads the copy its own CPU wheels bundle under ``vllm/libs``; a vLLM built from source
    has none. Replaying vLLM's CPU matmuls over every step size, glibc's malloc kept +880 MiB
    where tcmalloc kept +334 (docs/cpu-hosts.md). Nothing changes where ``LD_PRELOAD`` already
    names a tcmalloc, or where no system copy is found.
    """
    if "libtcmalloc" in ld_preload:
        return {}
    paths = TCMALLOC_CANDIDATES if candidates is None else candidates
    found = next((path for path in paths if os.path.exists(path)), None)
    if found is None:
        return {}
    return {"LD_PRELOAD": f"{found}:{ld_preload}" if ld_preload else found}


def host_cores() -> int:
    """The cores CPU instances are placed on (:func:`cpu_core`), one each, round-robin."""
    return os.cpu_count() or 1


def cpu_core(plan: InstancePlan, settings: StackSettings) -> int:
    """The core a CPU instance's worker computes on: one each, decode instances first.

    vLLM's CPU workers spin their OpenMP threads, so P and D on the same cores starve each other
    (a KV read waits seconds for a core instead of milliseconds). Decode takes the first cores
    because it computes most of every conversation (its tokens, and its short turns' prompts);
    core 0 is also the one a host's device interrupts are least likely to be routed to (they
    slow the turns on the core they land on; docs/decisions/cpu-core-pinning.md). The
    reference (the correctness reference beside a test stack, or
    the bench's ``colocated-instance``) shares decode-0's core: it then computes where
    kvtether's decode does, and beside a stack it runs between decode's turns. The bench's other
    colocated baselines name their cores (``InstancePlan.cpu_cores``, :func:`stack_cores`).
    """
    cores = host_cores()
    if plan.role == "reference":
        return 0
    suffix = plan.name.rsplit("-", 1)[-1]  # prefill-0, decode-1, ... (_plan.plan_stack)
    index = int(suffix) if suffix.isdigit() else 0
    if plan.role == "prefill":
        index += settings.decode
    return index % cores


def stack_cores(settings: StackSettings) -> list[int]:
    """The core :func:`cpu_core` gives each P/D instance of a stack, decode instances first.

    What a colocated deployment on the same hardware gets: the set of these cores for one
    engine, or one of them per replica.
    """
    roles: list[tuple[Role, int]] = [("decode", i) for i in range(settings.decode)]
    roles += [("prefill", i) for i in range(settings.prefill)]
    return [cpu_core(InstancePlan(name=f"{role}-{i}", role=role, host=settings.host, port=0,
                                  log_path=Path(os.devnull)), settings)
            for role, i in roles]


def core_list(cores: list[int]) -> str:
    """``[0, 1, 3]`` as ``VLLM_CPU_OMP_THREADS_BIND`` takes it: ``"0-1,3"`` (sorted, each once)."""
    ordered = sorted(set(cores))
    runs: list[list[int]] = []
    for core in ordered:
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
