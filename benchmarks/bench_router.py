"""Router overhead, in-process, against the fake vLLM P/D backend of tests.support.

Measures, on one event loop (one core):

- turns: latency of a chat turn through the router vs. the same backend calls made directly
  (tokenize + prefill leg + decode leg on the fakes), so "added" is the router's own cost per
  turn: parsing, planning, the conversation table, header/body rewriting, relaying;
  sequential (latency) and with many conversations in flight (throughput).
- heartbeats: ``POST /v1/sessions/{id}/heartbeat`` handled per second and its latency, called
  straight on the ASGI app (router cost only) and through an httpx client; with the upstream
  connector (router table only) and with the kvtether connector (adds the renew call to D).

Plain script, no assertions; from the repository root:

    python -m benchmarks.bench_router [--turns 400] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

import httpx

from kvtether import protocol as p
from tests.support.router_harness import SYSTEM_PROMPT, make_router


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def ms(x: float) -> str:
    return f"{x * 1000:7.3f}"


def row(name: str, xs: list[float], rate: float | None = None, unit: str = "",
        cpu_s: float | None = None) -> str:
    r = f"{rate:8.0f} {unit:<7}" if rate is not None else " " * 16
    c = f"  cpu {cpu_s / len(xs) * 1000:7.3f} ms/op" if cpu_s is not None else ""
    return (f"{name:<52} {r} p50 {ms(pct(xs, .5))} ms  p99 {ms(pct(xs, .99))} ms{c}"
            f"  (n={len(xs)})")


async def asgi_call(app: Any, method: str, path: str, body: bytes = b"") -> int:
    """One request straight into the ASGI app; returns the status."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    status = 0

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 1), "server": ("router", 80),
        "headers": [(b"content-type", b"application/json")],
    }
    await app(scope, receive, send)
    return status


async def direct_turn(h: Any, client: httpx.AsyncClient, messages: list[dict],
                      handle: dict | None) -> tuple[dict, dict | None]:
    """What the router asks of the backends for one turn, without the router."""
    body = {"model": "tiny", "messages": messages}
    if handle is not None:
        await client.post(f"{h.p.url}/tokenize", json={**body, "add_generation_prompt": True})
    pre = {**body, "max_tokens": 1, "n": 1, "return_token_ids": True,
           "kv_transfer_params": handle or {"do_remote_decode": True, "do_remote_prefill": False}}
    r = (await client.post(f"{h.p.url}/v1/chat/completions", json=pre)).json()
    dec = {**body, "return_token_ids": True, "kv_transfer_params": r["kv_transfer_params"]}
    d = (await client.post(f"{h.d.url}/v1/chat/completions", json=dec)).json()
    return d, d.get("kv_transfer_params")


async def bench_turns(n_turns: int, turns_per_conv: int, concurrency: int) -> list[str]:
    out = []
    n_conv = max(1, n_turns // turns_per_conv)
    async with make_router() as h:
        # Baseline: the backend calls alone.
        direct: list[float] = []
        cpu0 = time.process_time()
        async with httpx.AsyncClient(transport=h.transport) as client:
            for c in range(n_conv):
                msgs: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}]
                handle = None
                for t in range(turns_per_conv):
                    msgs.append({"role": "user", "content": f"step {t} of conversation {c}"})
                    t0 = time.perf_counter()
                    d, handle = await direct_turn(h, client, msgs, handle)
                    direct.append(time.perf_counter() - t0)
                    msgs.append({"role": "assistant",
                                 "content": d["choices"][0]["message"]["content"]})
        cpu_direct = time.process_time() - cpu0
        # Through the router, sequential.
        routed: list[float] = []
        cpu0 = time.process_time()
        fired = 0
        for c in range(n_conv):
            a = h.conversation(f"seq-{c}")
            for t in range(turns_per_conv):
                t0 = time.perf_counter()
                turn = await a.say(f"step {t} of conversation {c}")
                routed.append(time.perf_counter() - t0)
                fired += turn.outcome == "fired"
        cpu_routed = time.process_time() - cpu0
        out.append(row("backend calls only (tokenize+P+D), seq", direct,
                       len(direct) / sum(direct), "turns/s", cpu_direct))
        out.append(row("through router, sequential", routed,
                       len(routed) / sum(routed), "turns/s", cpu_routed))
        added = [r - d for r, d in zip(sorted(routed), sorted(direct))]
        out.append(row("  router overhead per turn (quantile diff)", added, None, "",
                       cpu_routed - cpu_direct))
        out.append(f"{'  reuse fired':<52} {fired}/{len(routed)} turns")
    # Through the router, many conversations in flight.
    async with make_router(n_prefill=2, n_decode=2) as h:
        agents = [h.conversation(f"par-{i}") for i in range(concurrency)]
        lat: list[float] = []
        rounds = max(1, n_turns // concurrency)

        async def one(a: Any, i: int) -> None:
            t0 = time.perf_counter()
            await a.say(f"round {i}")
            lat.append(time.perf_counter() - t0)

        t0, cpu0 = time.perf_counter(), time.process_time()
        for i in range(rounds):
            await asyncio.gather(*(one(a, i) for a in agents))
        wall = time.perf_counter() - t0
        out.append(row(f"through router, {concurrency} conversations at once", lat,
                       len(lat) / wall, "turns/s", time.process_time() - cpu0))
    # Streamed turns with the control channel (handle fetched after the stream).
    async with make_router(control=True) as h:
        lat = []
        cpu0 = time.process_time()
        for c in range(n_conv):
            a = h.conversation(f"stream-{c}")
            for t in range(turns_per_conv):
                t0 = time.perf_counter()
                await a.say(f"step {t}", stream=True)
                lat.append(time.perf_counter() - t0)
        out.append(row("through router, streamed + control channel", lat,
                       len(lat) / sum(lat), "turns/s", time.process_time() - cpu0))
    return out


async def bench_heartbeats(n: int, n_sessions: int) -> list[str]:
    out = []
    for control in (False, True):
        async with make_router(control=control) as h:
            for i in range(n_sessions):
                await h.conversation(f"hb-{i}").say("hello")
            body = json.dumps({"phase": "tool_running", "expected_duration_s": 30}).encode()
            label = "kvtether connector" if control else "upstream connector"
            lat: list[float] = []
            t0, cpu0 = time.perf_counter(), time.process_time()
            for i in range(n):
                s = time.perf_counter()
                status = await asgi_call(h.app, "POST", f"/v1/sessions/hb-{i % n_sessions}"
                                         "/heartbeat", body)
                lat.append(time.perf_counter() - s)
                assert status == 200, status
            wall = time.perf_counter() - t0
            out.append(row(f"heartbeat, raw ASGI, {label}", lat, n / wall, "hb/s",
                           time.process_time() - cpu0))
            lat = []
            t0, cpu0 = time.perf_counter(), time.process_time()
            for i in range(n):
                s = time.perf_counter()
                r = await h.client.post(f"/v1/sessions/hb-{i % n_sessions}/heartbeat",
                                        content=body)
                lat.append(time.perf_counter() - s)
                assert r.status_code == 200
            wall = time.perf_counter() - t0
            out.append(row(f"heartbeat, httpx client, {label}", lat, n / wall, "hb/s",
                           time.process_time() - cpu0))
            # Concurrent heartbeats (many tools running at once).
            lat = []

            async def one(i: int, body: bytes = body, lat: list[float] = lat) -> None:
                s = time.perf_counter()
                await asgi_call(h.app, "POST", f"/v1/sessions/hb-{i % n_sessions}/heartbeat",
                                body)
                lat.append(time.perf_counter() - s)

            t0, cpu0 = time.perf_counter(), time.process_time()
            for start in range(0, n, 100):
                await asyncio.gather(*(one(i) for i in range(start, min(n, start + 100))))
            wall = time.perf_counter() - t0
            out.append(row(f"heartbeat, raw ASGI, 100 in flight, {label}", lat, n / wall,
                           "hb/s", time.process_time() - cpu0))
            router_side = await h.metric("kvtether_heartbeat_seconds_sum")
            count = await h.metric("kvtether_heartbeat_seconds_count")
            out.append(f"{'  handler time (router histogram), mean':<52} "
                       f"{router_side / count * 1e3:.3f} ms over {count:.0f}")
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=400)
    ap.add_argument("--turns-per-conversation", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--heartbeats", type=int, default=3000)
    ap.add_argument("--quick", action="store_true", help="a few iterations (smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.turns, args.heartbeats, args.concurrency = 40, 200, 8
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"kvtether router overhead (in-process, fake vLLM backend; python "
          f"{sys.version.split()[0]}, {os.cpu_count()} cpus, load avg {load:.1f})")
    print(f"protocol {p.PROTOCOL_VERSION}; latency = wall clock on one event loop; cpu = process "
          "CPU time per op (robust to other load on the machine)\n")
    for line in await bench_turns(args.turns, args.turns_per_conversation, args.concurrency):
        print(line)
    print()
    for line in await bench_heartbeats(args.heartbeats, n_sessions=50):
        print(line)


if __name__ == "__main__":
    asyncio.run(main())
