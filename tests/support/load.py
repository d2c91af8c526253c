"""Many agent conversations at once through the router, on fake vLLM instances.

Each conversation runs turns separated by a tool call of a few seconds, heartbeating its lease
every second while the tool runs, then releases. The router's overhead per turn is the turn's
latency at the client minus the time the router spent waiting on upstream calls for it
(tokenize, prefill and decode legs with their bodies, lease and handle calls): parsing,
planning, the table, relaying, and waiting for its event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvtether.router import RouterSettings, create_app

from .fake_vllm import BLOCK_SIZE, Cluster
from .router_harness import SYSTEM_PROMPT, Harness, make_router
from .servers import HOST


# The upstream time of the request the router is handling (set per request by timed_app).
_upstream_s: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar(
    "upstream_s", default=None)


class TimedTransport(httpx.AsyncBaseTransport):
    """The router's upstream transport, adding each call's time (and its body's) to the
    request the router is handling: tokenize, prefill, decode, lease and handle calls."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        acc = _upstream_s.get()
        t0 = time.perf_counter()
        try:
            r = await self.inner.handle_async_request(request)
        finally:
            if acc is not None:
                acc[0] += time.perf_counter() - t0
        if acc is None:
            return r
        assert isinstance(r.stream, httpx.AsyncByteStream)
        return httpx.Response(r.status_code, headers=r.headers,
                              stream=_TimedStream(r.stream, acc), extensions=r.extensions)


class _TimedStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, acc: list[float]) -> None:
        self.inner, self.acc = inner, acc

    async def __aiter__(self) -> AsyncIterator[bytes]:
        chunks = self.inner.__aiter__()
        while True:
            t0 = time.perf_counter()
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                return
            finally:
                self.acc[0] += time.perf_counter() - t0
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


def timed_app(app: Any, sink: dict[str, float]) -> Any:
    """The router app, recording per request (by its ``X-Request-Id``) its upstream time."""

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        acc = [0.0]
        rid = None

        async def send_(message: Any) -> None:
            nonlocal rid
            if message["type"] == "http.response.start":
                rid = dict(message["headers"]).get(b"x-request-id", b"").decode() or None
            await send(message)

        token = _upstream_s.set(acc)
        try:
            await app(scope, receive, send_)
        finally:
            _upstream_s.reset(token)
            if rid:
                sink[rid] = acc[0]

    return wrapped


@dataclass
class LoadResult:
    conversations: int
    turns: int = 0
    failed_turns: list[str] = field(default_factory=list)
    heartbeats: int = 0
    failed_heartbeats: list[str] = field(default_factory=list)
    fired: int = 0
    eligible: int = 0
    turn_s: list[float] = field(default_factory=list)
    overhead_s: list[float] = field(default_factory=list)
    heartbeat_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    @staticmethod
    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")

    def summary(self) -> str:
        ms = lambda xs, q: f"{self.pct(xs, q) * 1000:.1f} ms"  # noqa: E731
        return (
            f"{self.conversations} conversations, {self.turns} turns "
            f"({len(self.failed_turns)} failed), {self.heartbeats} heartbeats "
            f"({len(self.failed_heartbeats)} failed), reuse fired {self.fired}/{self.eligible} "
            f"in {self.wall_s:.1f} s\n"
            f"  turn latency        p50 {ms(self.turn_s, .5)}  p99 {ms(self.turn_s, .99)}\n"
            f"  router overhead     p50 {ms(self.overhead_s, .5)}  "
            f"p99 {ms(self.overhead_s, .99)}\n"
            f"  heartbeat latency   p50 {ms(self.heartbeat_s, .5)}  "
            f"p99 {ms(self.heartbeat_s, .99)}"
        )


@contextlib.asynccontextmanager
async def _fakes_in_a_process() -> AsyncIterator[Harness]:
    """The router in this process, the four fakes in another, over real HTTP."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.fake_servers", "4"],
                            stdout=subprocess.PIPE, cwd=Path(__file__).resolve().parents[2])
    try:
        assert proc.stdout is not None
        said = proc.stdout.readline().decode().split()  # "ready PORT PORT PORT PORT"
        assert said[:1] == ["ready"] and len(said) == 5, f"the fake servers said {said}"
        urls = [f"http://{HOST}:{port}" for port in said[1:]]
        rs = RouterSettings(prefill_urls=urls[:2], decode_urls=urls[2:],
                            decode_control_urls=urls[2:], kv_block_size_tokens=BLOCK_SIZE)
        app = create_app(rs)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                   base_url="http://router")
        async with app.router.lifespan_context(app), client:
            # The fakes' state lives in their process: a harness without them.
            h = Harness.__new__(Harness)
            h.cluster, h.prefill, h.decode = Cluster(), [], []
            h.settings, h.app, h.client = rs, app, client
            yield h
    finally:
        proc.terminate()
        proc.wait(10)


async def run_load(conversations: int = 200, turns: int = 4, tool_s: tuple[float, float] = (1, 3),
                   heartbeat_every_s: float = 1.0, stream_share: float = 0.5,
                   seed: int = 1, fakes_in_process: bool = True) -> LoadResult:
    """``fakes_in_process``: the fakes share the router's event loop (and their KV reads are
    checked); otherwise they run in a process of their own, so the overhead measured is the
    router's (and this client's) alone."""
    rng = random.Random(seed)
    result = LoadResult(conversations)
    harness = (make_router(control=True, n_prefill=2, n_decode=2) if fakes_in_process
               else _fakes_in_a_process())
    async with harness as h:
        timed = TimedTransport(h.app.state.pool.all[0].client._transport)
        for b in h.app.state.pool.all:  # the router's upstream clients, now timed
            b.client._transport = timed
        upstream_s: dict[str, float] = {}
        client = h.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=timed_app(h.app, upstream_s)),
            base_url="http://router", timeout=120)

        async def heartbeats(cid: str, until_s: float) -> None:
            while time.perf_counter() < until_s:
                await asyncio.sleep(heartbeat_every_s)
                t0 = time.perf_counter()
                r = await client.post(f"/v1/sessions/{cid}/heartbeat",
                                      json={"phase": "tool_running"})
                result.heartbeat_s.append(time.perf_counter() - t0)
                result.heartbeats += 1
                if r.status_code != 200:
                    result.failed_heartbeats.append(f"{cid}: {r.status_code} {r.text[:200]}")

        async def conversation(i: int) -> None:
            cid = f"load-{i}"
            messages = [{"role": "system", "content": SYSTEM_PROMPT}]
            await asyncio.sleep(rng.uniform(0, 1))  # arrivals spread over a second
            for t in range(turns):
                stream = rng.random() < stream_share
                t0 = time.perf_counter()
                messages.append({"role": "user", "content": f"step {t} of task {i}"})
                turn = await h.chat(list(messages), cid, stream=stream)
                seconds = time.perf_counter() - t0
                result.turns += 1
                if turn.status != 200:
                    result.failed_turns.append(f"{cid} turn {t + 1}: {turn.status}")
                    return
                messages.append(turn.assistant_message())
                result.turn_s.append(seconds)
                rid = turn.headers["X-Request-Id"]
                result.overhead_s.append(seconds - upstream_s.pop(rid, 0.0))
                if t > 0:
                    result.eligible += 1
                    result.fired += turn.outcome == "fired"
                tool = rng.uniform(*tool_s)
                await heartbeats(cid, time.perf_counter() + tool)
            await client.delete(f"/v1/sessions/{cid}")

        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(i) for i in range(conversations)))
        result.wall_s = time.perf_counter() - t0
        h.assert_kv_correct()
        for url in h.settings.decode_control_urls:  # no KV left held on any decode instance
            status = (await h.app.state.pool.all[0].client.get(
                f"{url}/kvtether/v1/status")).json()
            assert status["totals"]["active_leases"] == 0, status
    return result

