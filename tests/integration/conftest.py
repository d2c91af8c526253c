"""Real vLLM fixtures: one P/D stack (tiny model) and one colocated reference per test session.

Both are started once and shared: each vLLM instance takes one to two minutes to boot on these
2-core machines. Tests use fresh conversation ids, so they do not see each other's KV.

``pd_stack`` is the bundled stack (router included) with a 60 s initial lease. ``short_lease``
is a second, in-process router over the same vLLM instances whose leases start at 10 s: the
lease tests need KV to lapse quickly, and the router decides each turn's lease length.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any
from pathlib import Path

import httpx
import psutil
import pytest

# Offset from the defaults so a `kvtether stack up` a developer left running does not collide.
_PORT_BASE = int(os.environ.get("KVTETHER_TEST_PORT_BASE", "18000"))
SHORT_LEASE_TTL_S = 10.0


@dataclass(frozen=True)
class StackHandle:
    base_url: str  # a kvtether router
    model: str
    lease_ttl_s: float
    block_size_tokens: int
    prefill_urls: list[str]
    decode_urls: list[str]
    decode_control_urls: list[str]
    state_dir: Path
    control_secret: str | None = None  # the stack's; every control-channel call needs it

    @property
    def control_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.control_secret}"} if self.control_secret else {}


@dataclass(frozen=True)
class Reference:
    base_url: str


def _settings(tmp: Path, **overrides):
    from kvtether.stack.settings import StackSettings

    return StackSettings(
        profile="cpu-tiny",
        port=_PORT_BASE,
        base_port=_PORT_BASE + 100,
        side_channel_base_port=_PORT_BASE - 2000,
        control_base_port=_PORT_BASE + 200,
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


@contextlib.contextmanager
def supervised(stack: Any) -> Iterator[list[str]]:
    """Supervise ``stack`` as a foreground ``kvtether stack up`` does (a process that dies is
    restarted with back-off); yields what the supervisor says, as it says it."""
    said: list[str] = []
    stop = threading.Event()
    thread = threading.Thread(target=stack.supervise, daemon=True,
                              kwargs={"stop": stop, "say": said.append})
    thread.start()
    try:
        yield said
    finally:
        stop.set()
        thread.join(120)


# What an instance log says when something went wrong (vLLM's errors, an engine step that did
# not end, a process the supervisor restarted).
_TROUBLE = ("ERROR", "Traceback", "engine step", "No available shared memory",
            "RPC call to", "EngineDeadError", "NIXL transfer failure")


def trouble_in_logs(stack: Any, max_lines: int = 60) -> str:
    """The lines of each of ``stack``'s logs that say something went wrong (for a failing
    test's output: the logs themselves stay in a temporary directory nobody reads in CI)."""
    out = []
    for record in stack.state.processes:
        try:
            lines = record.log_path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        bad = [line[:400] for line in lines if any(t in line for t in _TROUBLE)]
        if bad:
            out.append(f"--- {record.name} ({len(bad)} lines, last {max_lines})")
            out.extend(bad[-max_lines:])
    return "\n".join(out)


@contextlib.contextmanager
def serve_app(make_app: Callable[[int], Any]) -> Iterator[str]:
    """Run the ASGI app ``make_app(port)`` on a free loopback port in a thread; yield its URL."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(port), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "router did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def serve_router(stack: StackHandle, **settings: Any) -> contextlib.AbstractContextManager[str]:
    """Run another kvtether router in this process over ``stack``'s vLLM instances."""
    from kvtether.router import RouterSettings, create_app

    def make_app(port: int) -> Any:
        return create_app(RouterSettings(
            port=port, prefill_urls=stack.prefill_urls, decode_urls=stack.decode_urls,
            decode_control_urls=stack.decode_control_urls, control_secret=stack.control_secret,
            kv_block_size_tokens=stack.block_size_tokens, **settings,
        ))

    return serve_app(make_app)


@pytest.fixture(scope="session")
def short_lease(pd_stack: StackHandle) -> Iterator[StackHandle]:
    with serve_router(pd_stack, lease_ttl_s=SHORT_LEASE_TTL_S) as url:
        yield replace(pd_stack, base_url=url, lease_ttl_s=SHORT_LEASE_TTL_S)


@pytest.fixture(scope="session")
def reference_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reference]:
    from kvtether.stack.launcher import start_reference_vllm

    tmp = tmp_path_factory.mktemp("reference")
    settings = _settings(tmp)
    with start_reference_vllm(settings, port=_PORT_BASE + 99) as url:
        server = next(p for p in psutil.Process(os.getpid()).children()
                      if "--no-enable-prefix-caching" in p.cmdline())
        procs = [server, *server.children(recursive=True)]
        # The first request on a fresh CPU vLLM is slow; no test should time it.
        httpx.post(f"{url}/v1/completions", timeout=600, json={
            "model": "tiny", "prompt": "the agent calls a tool", "max_tokens": 4,
            "temperature": 0}).raise_for_status()
        yield Reference(base_url=url)
    # start_reference_vllm stops the server and its engine and worker processes.
    alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [p.cmdline()[:4] for p in alive]
