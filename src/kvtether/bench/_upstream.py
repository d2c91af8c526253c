"""P/D baselines on vLLM's own parts: the stack's prefill and decode instances behind
vllm-router's P/D mode (``vllm-router --vllm-pd-disaggregation``), no kvtether router.

``pd-oneway`` runs here. For each turn vllm-router 0.1.17 (``VllmPDRouter::
process_vllm_two_stage_request``, src/routers/http/vllm_pd_router.rs) sends prefill the
request with ``max_tokens=1``, ``stream=false`` and ``kv_transfer_params`` ``{do_remote_decode:
true, do_remote_prefill: false, remote_*: null}``, then sends decode the client's request with
the ``kv_transfer_params`` prefill answered (engine id, block ids, NIXL side-channel host and
port), both under one ``X-Request-Id``, and relays decode's answer, streamed or not. The NIXL
side channel's address travels in prefill's answer: no bootstrap port, no discovery service.
That is NixlConnector's one-way protocol, which both connectors the stack runs speak
(``baseline_connector``); with ``reuse_policy`` off their ``bidirectional_kv_xfer`` is off, so
decode frees a turn's KV when it ends and every turn's prefill recomputes.

``pd-upstream`` has no such part to run (docs/benchmark.md says why): vllm-router's P/D mode
overwrites ``kv_transfer_params`` on every prefill leg with the fresh one-way value above and
keeps no per-conversation state, so a handle never reaches the next turn's prefill; vLLM's
stateful proxy (examples/disaggregated/disaggregated_serving/disagg_proxy_multiturn.py in vLLM's
repository, not in its wheel) asks decode for a stream on every turn and takes the handle from
its chunks, and vLLM 0.32 puts it only in a non-streamed answer (``ChatCompletionResponse``;
``ChatCompletionStreamResponse`` has no such field), so against vLLM 0.32 it reuses nothing
either. ``pd-upstream`` stays kvtether's router applying that proxy's rules
(``reuse_policy=upstream``), with the handle of non-streamed answers: the most vLLM 0.32's own
protocol gives a proxy.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from kvtether.bench import _vllm_router

if TYPE_CHECKING:
    from kvtether.stack.launcher import Stack
    from kvtether.stack.settings import StackSettings

logger = logging.getLogger(__name__)

__all__ = ["PD_POLICY", "pd_router_args", "pd_settings", "start_upstream_pd"]

# How vllm-router picks each turn's prefill and decode instance: in turn, as vLLM's own
# proxies do. Nothing is kept on decode between turns, so no affinity can help one-way P/D.
PD_POLICY = "round_robin"


def pd_router_args(prefill_urls: Sequence[str], decode_urls: Sequence[str]) -> list[str]:
    """vllm-router's P/D-mode flags for these instances (NIXL: no bootstrap port)."""
    args = ["--vllm-pd-disaggregation"]
    for url in prefill_urls:
        args += ["--prefill", url]
    for url in decode_urls:
        args += ["--decode", url]
    return args


def pd_settings(settings: StackSettings) -> StackSettings:
    """A P/D strategy's stack settings, engines only: vllm-router takes the kvtether router's
    place (and port), and warms the NIXL links itself."""
    return settings.model_copy(update={"start_router": False, "warm_up": False})


@contextmanager
def start_upstream_pd(settings: StackSettings, port: int) -> Iterator[tuple[str, Stack]]:
    """Start the P/D instances of ``settings`` (engines only: :func:`pd_settings`), then
    vllm-router in P/D mode on ``port``; yield vllm-router's URL and the running stack; stop
    everything on exit (errors and Ctrl-C too)."""
    from kvtether.stack._warmup import warm_up
    from kvtether.stack.launcher import Stack

    _vllm_router.require_vllm_router()  # before minutes of vLLM start-up, not after
    settings = pd_settings(settings)
    with ExitStack() as running:
        stack = running.enter_context(Stack(settings))
        # Its Prometheus port: port+1, free without kvtether router replicas (the engines
        # are on port+100.., their control channels on port+200..).
        url = running.enter_context(_vllm_router.start_vllm_router(
            [], host=settings.host, port=port, metrics_port=port + 1,
            log_path=Path(settings.state_dir) / "logs" / "vllm-router.log",
            health_timeout_s=settings.health_timeout_s, stop_timeout_s=settings.stop_timeout_s,
            policy=PD_POLICY,
            extra_args=pd_router_args(stack.prefill_urls, stack.decode_urls),
        ))
        # The first read from each prefill instance opens its NIXL link (slow on a busy CPU
        # host); one throw-away turn per pair keeps that out of the first measured turn, as
        # the kvtether router's warm-up does for the other P/D strategies.
        report = warm_up(url, stack.served_model_name,
                         conversations=settings.prefill * settings.decode, max_turns=1,
                         max_tokens=settings.kv_recompute_threshold_tokens
                         + settings.block_size_tokens,
                         timeout_s=settings.health_timeout_s)
        logger.info("vllm-router P/D warm-up: %d turn(s) in %.1f s", len(report.outcomes),
                    report.seconds)
        yield url, stack
