"""What a shared store costs: turn latency, store round trips per turn and heartbeats per
second, in-memory vs a real redis-server, with fake vLLM instances (so the router's own time
is all there is to see).

    python -m tests.router.store_overhead [--turns 200] [--heartbeats 1000]

Starts (and stops) its own redis-server on port 26391.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support.redis_server import RedisServer, redis_port
from tests.support.router_harness import metric_value

from .test_replicas import two_replicas


async def _run(url: str | None, turns: int, heartbeats: int) -> dict[str, Any]:
    if url is None:
        from tests.support.router_harness import make_router

        ctx: Any = make_router(control=True)
    else:
        ctx = two_replicas(url)
    async with ctx as hs:
        routers = hs if isinstance(hs, tuple) else (hs, hs)
        agent = routers[0].conversation("bench")
        agent.messages = agent.messages[:1]
        latencies = []
        for i in range(turns):
            if len(agent.messages) > 9:  # keep prompts short and equal in cost
                agent.messages = agent.messages[:1]
                agent.cid = f"bench-{i}"
            agent.h = routers[i % 2]
            t0 = time.perf_counter()
            await agent.say(f"step {i}")
            latencies.append(time.perf_counter() - t0)
        ops = call_s = 0.0
        for h in set(routers):
            text = (await h.client.get("/metrics")).text
            for op in ("lock", "save", "holders", "try_lock", "extend", "read"):
                ops += metric_value(text, "kvtether_store_ops_total", f'op="{op}"')
                call_s += metric_value(text, "kvtether_store_call_seconds_sum", f'op="{op}"')
        t0 = time.perf_counter()
        for i in range(heartbeats):
            r = await routers[i % 2].client.post(f"/v1/sessions/{agent.cid}/heartbeat",
                                                 json={})
            assert r.status_code == 200, r.text
        hb_s = time.perf_counter() - t0
        return {
            "turn_ms_median": statistics.median(latencies) * 1000,
            "turn_ms_mean": statistics.fmean(latencies) * 1000,
            "store_ops_per_turn": ops / turns,
            "store_ms_per_turn": call_s / turns * 1000,
            "heartbeats_per_s": heartbeats / hb_s,
        }


async def main(turns: int, heartbeats: int) -> None:
    memory = await _run(None, turns, heartbeats)
    with tempfile.TemporaryDirectory() as tmp, \
            RedisServer.running(redis_port(12), Path(tmp)) as server:
        redis = await _run(server.url, turns, heartbeats)
    print(f"{'':28}{'memory':>10}{'redis':>10}")
    for k in memory:
        print(f"{k:28}{memory[k]:10.2f}{redis[k]:10.2f}")
    added_ms = redis["turn_ms_median"] - memory["turn_ms_median"]
    print(f"added latency per turn (median): {added_ms:.2f} ms")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--heartbeats", type=int, default=1000)
    a = ap.parse_args()
    asyncio.run(main(a.turns, a.heartbeats))
