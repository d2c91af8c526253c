"""Real vLLM fixtures: one P/D stack (tiny model) and one colocated reference per test session.

Both are started once and shared: each vLLM instance takes one to two minutes to boot on these
2-core machines. Tests use fresh conversation ids, so they do not see each other's KV.

``pd_stack`` is the bundled stack (router included) with a 60 s initial lease. ``short_lease``
is a second, in-process router over the same vLLM instances whose leases start at 10 s: the
lease tests need KV to lapse quickly, and the router decides each turn's lease length.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.stacks import PORT_BASE, Reference, StackHandle, serve_router

SHORT_LEASE_TTL_S = 10.0


def _settings(tmp: Path, **overrides):
    from kvtether.stack.settings import StackSettings

    return StackSettings(
        profile="cpu-tiny",
        port=PORT_BASE,
        base_port=PORT_BASE + 100,
        side_channel_base_port=PORT_BASE - 2000,
        control_base_port=PORT_BASE + 200,
        state_dir=tmp,
        health_timeout_s=900,  # generous: a loaded 2-core machine boots vLLM slowly
        **overrides,
    )


@pytest.fixture(scope="session")
def pd_stack(
    tmp_path_factory: pytest.TempPathFactory, reference_vllm: Reference
) -> Iterator[StackHandle]:
    # Asks for the reference only to start it first: booting vLLM is CPU-bound, and on 2 cores
    # a third instance booting beside a working P/D pair slows both.
    del reference_vllm
    from kvtether.stack.launcher import Stack

    tmp = tmp_path_factory.mktemp("stack")
    settings = _settings(tmp, connector="kvtether", lease_ttl_s=60)
    with Stack(settings, die_with_parent=True) as stack:
        n_p = settings.prefill
        handle = StackHandle(
            base_url=stack.router_url,
            model=stack.served_model_name,
            lease_ttl_s=settings.lease_ttl_s,
            block_size_tokens=settings.block_size_tokens,
            prefill_urls=stack.prefill_urls,
            decode_urls=stack.decode_urls,
            decode_control_urls=[
                f"http://{settings.host}:{settings.control_port(n_p + i)}"
                for i in range(settings.decode)
            ],
            state_dir=tmp,
            control_secret=stack.control_secret,
        )
        # The control channel refuses a call without the stack's secret.
        refused = httpx.get(f"{handle.decode_control_urls[0]}/kvtether/v1/status", timeout=10)
        assert refused.status_code == 401, refused.text
        # Stack.up() ran turns until one reused KV: both NIXL handshakes are done, so no test
        # times (or fails on) vLLM's 5 s first-handshake limit.
        report = stack.warm_up_report
        assert report is not None and report.fired, report
        yield handle


@pytest.fixture(scope="session")
def short_lease(pd_stack: StackHandle) -> Iterator[StackHandle]:
    with serve_router(pd_stack, lease_ttl_s=SHORT_LEASE_TTL_S) as url:
        yield replace(pd_stack, base_url=url, lease_ttl_s=SHORT_LEASE_TTL_S)


@pytest.fixture(scope="session")
def reference_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reference]:
    from kvtether.stack.launcher import start_reference_vllm

    tmp = tmp_path_factory.mktemp("reference")
    settings = _settings(tmp)
    with start_reference_vllm(settings, port=PORT_BASE + 99) as url:
        # By its port: the coding-agent reference may be running beside it.
        port = str(PORT_BASE + 99)
        server = next(p for p in psutil.Process(os.getpid()).children()
                      if "--no-enable-prefix-caching" in p.cmdline()
                      and port in p.cmdline())
        procs = [server, *server.children(recursive=True)]
        # The first request on a fresh CPU vLLM is slow; no test should time it.
        httpx.post(f"{url}/v1/completions", timeout=600, json={
            "model": "tiny", "prompt": "the agent calls a tool", "max_tokens": 4,
            "temperature": 0}).raise_for_status()
        yield Reference(base_url=url)
    # start_reference_vllm stops the server and its engine and worker processes.
    alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [p.cmdline()[:4] for p in alive]


# The coding-agent stack (`cpu-agents`: a 64K-context model that holds a harness's prompt),
# started by the first test that needs it, with its own colocated reference.
AGENTS_PORT = PORT_BASE + 700


def _agents_settings(tmp: Path, **overrides):
    from kvtether.stack.settings import StackSettings

    return StackSettings(
        profile="cpu-agents", port=AGENTS_PORT, base_port=AGENTS_PORT + 10,
        side_channel_base_port=PORT_BASE - 1500, control_base_port=AGENTS_PORT + 20,
        state_dir=tmp, health_timeout_s=900, **overrides,
    )


@pytest.fixture(scope="session")
def agents_reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reference]:
    from kvtether.stack.launcher import start_reference_vllm

    settings = _agents_settings(tmp_path_factory.mktemp("agents-reference"))
    with start_reference_vllm(settings, port=AGENTS_PORT + 30) as url:
        yield Reference(base_url=url)


@pytest.fixture(scope="session")
def agents_stack(
    tmp_path_factory: pytest.TempPathFactory, agents_reference: Reference
) -> Iterator[StackHandle]:
    del agents_reference  # started first: three instances booting at once slow each other
    from kvtether.stack.launcher import Stack

    tmp = tmp_path_factory.mktemp("agents-stack")
    settings = _agents_settings(tmp, connector="kvtether")
    with Stack(settings, die_with_parent=True) as stack:
        n_p = settings.prefill
        yield StackHandle(
            base_url=stack.router_url, model=stack.served_model_name,
            lease_ttl_s=settings.lease_ttl_s, block_size_tokens=settings.block_size_tokens,
            prefill_urls=stack.prefill_urls, decode_urls=stack.decode_urls,
            decode_control_urls=[f"http://{settings.host}:{settings.control_port(n_p + i)}"
                                 for i in range(settings.decode)],
            state_dir=tmp, control_secret=stack.control_secret,
        )
