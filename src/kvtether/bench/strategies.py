"""The deployments `kvtether bench` compares, each started the same way on this host.

Colocated baselines: vLLM with its prefix cache (vLLM's default), no KV transfer, on the
hardware the P/D strategies get (on CPU hosts, the cores the P/D stack's instances compute on,
one each: :func:`~kvtether.stack._commands.stack_cores`; two for 1P+1D):

* ``colocated`` — one vLLM on every one of those cores: the simple deployment on the same
  hardware, and the greedy reference every other strategy's outputs are compared with.
* ``colocated-instance`` — one vLLM on one P/D instance's core (decode-0's): the no-transfer
  limit of one P/D instance (what ``colocated`` measured before it got every core).
* ``colocated-dp`` — one vLLM replica per P/D instance, each on that instance's core (on GPU
  hosts: placed on ``gpu_ids`` as the stack places its instances), behind vLLM's own router
  (``vllm-router``) with session affinity: ``consistent_hash`` on the ``X-Session-ID`` header
  the client sends with the conversation id (:attr:`Strategy.session_header`).

P/D strategies:

* ``pd-oneway`` — P/D with NixlConnector's one-way protocol, no bidirectional transfer: every
  turn's prefill recomputes. Routed by vLLM's own router in its P/D mode
  (``vllm-router --vllm-pd-disaggregation``, :mod:`kvtether.bench._upstream`), not kvtether's.
* ``pd-upstream`` — P/D bidirectional as vLLM 0.32 ships it: NixlConnector with
  ``bidirectional_kv_xfer``, a fixed ``decoder_kv_blocks_ttl``, decode chosen round-robin, the
  conversation id in the body, no handle on streamed turns, no prefix check (router
  ``reuse_policy=upstream``, a faithful mode, not a crippled kvtether).
* ``kvtether`` — the kvtether connector and router (affinity, leases renewed by heartbeats while
  tools run, released at the end, prediction hints, prefix check, budget), driven through the
  kvtether session layer.

The P/D strategies run one prefill and one decode instance, with the prefill prefix cache as
the bench options say. By default every P/D strategy runs on kvtether's connector, so each gets
the same engine (on CPU hosts: the idle-sleeping one of ``kvtether bench idle``) and only the
reuse policy differs; the router applies each baseline's rules (``reuse_policy``), and for
``pd-upstream`` decode holds a turn's KV under a lease as long as the fixed TTL that is never
renewed or released, which is vLLM's ``decoder_kv_blocks_ttl``. ``baseline_connector="nixl"``
runs the baselines on vLLM's own NixlConnector instead (on a CPU host that adds the busy
polling of ``kvtether bench idle``'s stock column to their turn times).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvtether.bench._upstream import start_upstream_pd

__all__ = ["Endpoints", "STRATEGIES", "Strategy", "StrategyOptions", "start_strategy"]

# vLLM's decoder_kv_blocks_ttl and kvtether's lease defaults, in workload seconds; the replay
# divides them by the time-compression factor with every other duration.
FIXED_TTL_S = 480.0
LEASE_TTL_S = 60.0
MAX_LEASE_S = 900.0
# What no factor can scale: vLLM's prefill refuses a handle within 5 s of its expiry
# (pull_worker._KV_BLOCKS_EXPIRY_SAFETY_MARGIN), and kvtether's router keeps a 6 s margin over
# that (lease_safety_margin_s). kvtether's scaled leases are floored here so they are usable.
MIN_LEASE_S = 12.0


@dataclass(frozen=True)
class Strategy:
    name: str
    description: str
    colocated: bool = False
    # A colocated strategy's engines: "stack", one on every core the P/D stack uses;
    # "instance", one on one P/D instance's core; "replicas", one per P/D instance, on its
    # core, behind vllm-router.
    placement: Literal["stack", "instance", "replicas"] = "stack"
    # The header the client sends on every turn with the conversation id (the router's
    # affinity key); None: none.
    session_header: str | None = None
    reuse_policy: Literal["kvtether", "upstream", "off"] = "kvtether"
    client: Literal["plain", "kvtether"] = "plain"
    body_conversation_id: bool = False  # the field vLLM's multi-turn benchmark sends
    # A P/D strategy's router: kvtether's (applying reuse_policy), or vLLM's own vllm-router
    # in its P/D mode (one-way only: kvtether.bench._upstream).
    router: Literal["kvtether", "vllm-router"] = "kvtether"


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("colocated", "one vLLM on every core the P/D stack uses, prefix caching on",
                 colocated=True),
        Strategy("colocated-instance", "one vLLM on one P/D instance's core, prefix caching "
                 "on: the no-transfer limit of one P/D instance", colocated=True,
                 placement="instance"),
        Strategy("colocated-dp", "one vLLM per P/D instance, each on its core, prefix caching "
                 "on, behind vllm-router (consistent hash on X-Session-ID)", colocated=True,
                 placement="replicas", session_header="X-Session-ID"),
        Strategy("pd-oneway", "P/D, prefill recomputes every turn, behind vllm-router's P/D "
                 "mode", reuse_policy="off", router="vllm-router"),
        Strategy(
            "pd-upstream",
            "P/D bidirectional as vLLM ships it: fixed TTL, round-robin decode, "
            "no handle on streamed turns, no prefix check",
            reuse_policy="upstream",
            body_conversation_id=True,
        ),
        Strategy(
            "kvtether",
            "kvtether router + connector + session layer: affinity, leases with heartbeats, "
            "prediction, prefix check, budget",
            client="kvtether",
        ),
    )
}


@dataclass(frozen=True)
class StrategyOptions:
    profile: str
    compress: float
    port: int
    state_dir: Path
    prefill_prefix_caching: bool = False
    baseline_connector: Literal["kvtether", "nixl"] = "kvtether"
    prefill: int = 1
    decode: int = 1
    max_retained_tokens: int | None = None
    health_timeout_s: float = 900.0
    extra: dict[str, Any] = field(default_factory=dict)  # more StackSettings fields


@dataclass(frozen=True)
class Endpoints:
    """Where the replay sends turns, and what it watches."""

    openai_base_url: str  # .../v1
    router_url: str | None
    kv_urls: list[str]  # instances whose held KV is sampled (decode; the colocated one)
    served_model_name: str
    block_size: int
    recompute_threshold: int
    # The hardware it ran on: CPU cores as VLLM_CPU_OMP_THREADS_BIND lists them ("0-1"; None
    # on GPU hosts), and how many vLLM engines shared them.
    cores: str | None = None
    instances: int = 1
    # P/D prefill instances, whose NIXL reads of decode's KV (reuse, D->P) are counted.
    prefill_urls: list[str] = field(default_factory=list)


def stack_settings(strategy: Strategy, opts: StrategyOptions) -> Any:
    """The :class:`~kvtether.stack.settings.StackSettings` a P/D strategy runs with."""
    from kvtether.stack.settings import StackSettings

    c = opts.compress
    values: dict[str, Any] = dict(
        profile=opts.profile, state_dir=opts.state_dir / strategy.name,
        port=opts.port, base_port=opts.port + 100, side_channel_base_port=opts.port - 2400,
        control_base_port=opts.port + 200, prefill=opts.prefill, decode=opts.decode,
        health_timeout_s=opts.health_timeout_s,
        reuse_policy=strategy.reuse_policy,
        prefill_prefix_caching=opts.prefill_prefix_caching,
        decoder_kv_blocks_ttl_s=FIXED_TTL_S / c,
        lease_ttl_s=max(LEASE_TTL_S / c, MIN_LEASE_S),
        max_retained_tokens=opts.max_retained_tokens,
        **opts.extra,
    )
    if strategy.colocated:
        values.pop("reuse_policy")
        values.pop("prefill_prefix_caching")
    elif strategy.reuse_policy != "kvtether":
        values["connector"] = opts.baseline_connector
        if strategy.reuse_policy == "upstream" and opts.baseline_connector == "kvtether":
            values["lease_ttl_s"] = FIXED_TTL_S / c  # the fixed TTL, never renewed
    return StackSettings(**values)


def router_max_lease_s(opts: StrategyOptions) -> float:
    return max(MAX_LEASE_S / opts.compress, MIN_LEASE_S)


@contextmanager
def start_strategy(strategy: Strategy, opts: StrategyOptions) -> Iterator[Endpoints]:
    """Start what ``strategy`` deploys; stop every process on exit (errors and Ctrl-C too)."""
    settings = stack_settings(strategy, opts)
    if strategy.colocated:
        with _start_colocated(strategy, opts, settings) as endpoints:
            yield endpoints
        return
    if strategy.router == "vllm-router":
        with start_upstream_pd(settings, opts.port) as (url, stack):
            # vllm-router reports no per-turn reuse or timings: no router_url.
            yield _stack_endpoints(url, None, stack, settings)
        return
    from kvtether.stack.launcher import Stack

    # The router caps leases at max_lease_s, a router-only setting: scaled like every other
    # duration, handed over in the router's environment (the stack passes its own on).
    env_key = "KVTETHER_ROUTER_MAX_LEASE_S"
    previous = os.environ.get(env_key)
    os.environ[env_key] = str(router_max_lease_s(opts))
    try:
        with Stack(settings) as stack:
            yield _stack_endpoints(stack.router_url, stack.router_url, stack, settings)
    finally:
        if previous is None:
            os.environ.pop(env_key, None)
        else:
            os.environ[env_key] = previous


def _stack_endpoints(base_url: str, router_url: str | None, stack: Any,
                     settings: Any) -> Endpoints:
    """The endpoints of a running P/D stack served at ``base_url``."""
    from kvtether.stack._commands import core_list, stack_cores

    return Endpoints(
        openai_base_url=f"{base_url}/v1", router_url=router_url,
        kv_urls=list(stack.decode_urls), served_model_name=stack.served_model_name,
        prefill_urls=list(stack.prefill_urls), block_size=settings.block_size_tokens,
        recompute_threshold=settings.kv_recompute_threshold_tokens,
        cores=core_list(stack_cores(settings)) if settings.device == "cpu" else None,
        instances=settings.instance_count,
    )


def colocated_cores(strategy: Strategy, settings: Any) -> list[list[int]]:
    """The CPU cores of each engine a colocated strategy runs, one list per engine."""
    from kvtether.stack._commands import stack_cores

    pd_cores = stack_cores(settings)
    if strategy.placement == "replicas":
        return [[core] for core in pd_cores]
    if strategy.placement == "instance":
        return [pd_cores[:1]]
    return [sorted(set(pd_cores))]


@contextmanager
def _start_colocated(strategy: Strategy, opts: StrategyOptions,
                     settings: Any) -> Iterator[Endpoints]:
    """The colocated engines on opts.port+100.., and for replicas vllm-router on opts.port."""
    from kvtether.bench import _vllm_router
    from kvtether.stack._commands import core_list
    from kvtether.stack._reference import start_reference_vllms
    from kvtether.stack.settings import resolve_model

    replicas = strategy.placement == "replicas"
    if replicas:
        _vllm_router.require_vllm_router()  # before minutes of vLLM start-up, not after
    _, served = resolve_model(settings)
    engines = colocated_cores(strategy, settings)
    cpu = settings.device == "cpu"
    ports = [opts.port + 100 + i for i in range(len(engines))]
    with ExitStack() as stack:
        urls = stack.enter_context(start_reference_vllms(
            settings, ports, prefix_caching=True,
            cpu_cores=[core_list(cores) for cores in engines] if cpu else None))
        base_url = urls[0]
        if replicas:
            base_url = stack.enter_context(_vllm_router.start_vllm_router(
                # Metrics where a P/D stack has its control channels (none here).
                urls, host=settings.host, port=opts.port, metrics_port=opts.port + 200,
                log_path=Path(settings.state_dir) / "logs" / "vllm-router.log",
                health_timeout_s=settings.health_timeout_s,
                stop_timeout_s=settings.stop_timeout_s,
            ))
        yield Endpoints(
            openai_base_url=f"{base_url}/v1", router_url=None, kv_urls=list(urls),
            served_model_name=served, block_size=settings.block_size_tokens,
            recompute_threshold=settings.kv_recompute_threshold_tokens,
            cores=core_list([c for cores in engines for c in cores]) if cpu else None,
            instances=len(urls),
        )
