"""Soak: a simulated day of session lifecycles leaves memory flat and the table bounded.

A quarter of a million lifecycles go through the conversation table and retention directly
(:mod:`tests.router.soak`), filling the 5,000-conversation table 50 times over; set
``KVTETHER_SOAK_LIFECYCLES=1000000`` for a million (~7 minutes). A smaller number go through
the whole HTTP app in front of fake vLLM instances, turns, heartbeats, releases and abandoned sessions alike. Memory is measured as
live Python allocations (``sys.getallocatedblocks``) after warm-up and at the end: the end may
not exceed warm-up by more than a small factor. No timing is asserted.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import sys

import pytest

from tests.support.router_harness import Harness, make_router

from .clock import ManualClock
from .soak import soak_table

pytestmark = pytest.mark.soak

LIFECYCLES = int(os.environ.get("KVTETHER_SOAK_LIFECYCLES", "250000"))
HTTP_LIFECYCLES = int(os.environ.get("KVTETHER_SOAK_HTTP_LIFECYCLES", "3000"))
# Live allocations at the end may exceed those after warm-up by this factor at most.
FLAT_FACTOR = 1.2


@pytest.mark.timeout(600)
async def test_many_lifecycles_keep_the_table_bounded_and_memory_flat() -> None:
    r = await soak_table(LIFECYCLES, max_conversations=5_000)
    print(f"\nsoak (table): {r.lifecycles} lifecycles, {r.turns} turns, {r.heartbeats} "
          f"heartbeats, {r.released} released, {r.abandoned} abandoned; table max {r.max_table}; "
          f"allocated blocks warm {r.warm_blocks} -> end {r.end_blocks}; "
          f"RSS warm {r.warm_rss / 2**20:.1f} MiB -> end {r.end_rss / 2**20:.1f} MiB")
    for started, size, blocks, rss in r.samples:
        print(f"  {started:>8} lifecycles: table {size:>5}  blocks {blocks:>8}  "
              f"RSS {rss / 2**20:6.1f} MiB")
    assert r.lifecycles == LIFECYCLES
    assert r.max_table == 5_000  # reached, never passed
    assert r.end_blocks <= r.warm_blocks * FLAT_FACTOR
    assert r.end_rss <= r.warm_rss * FLAT_FACTOR
    # Every lease, released, abandoned or dropped with its conversation, is gone on D and in
    # the router's per-instance accounting.
    assert r.leases_held_at_end == 0
    assert r.leases_counted_at_end == 0


def _forget_fake_history(h: Harness) -> None:
    """The fake instances record every request for other tests; drop that, keep live state."""
    for inst in (*h.prefill, *h.decode):
        for name in ("requests", "prefill_handles", "decode_params", "responses",
                     "stream_chunks", "control_calls", "renewals", "releases",
                     "forwarded_prompt_ids"):
            getattr(inst, name).clear()
        for key in [k for k, r in inst.leases.items() if r.state != "held"]:
            del inst.leases[key]
        inst.published.clear()
    c = h.cluster
    c.reads.clear()
    for key in [k for k, r in c.retentions.items() if r.state != "held"]:
        del c.retentions[key]


@pytest.mark.timeout(600)
async def test_lifecycles_through_the_router_leave_memory_flat() -> None:
    clock = ManualClock()
    rng = random.Random(3)
    max_conversations = 200
    async with make_router(control=True, n_decode=2, clock=clock, lease_ttl_s=60,
                           max_conversations=max_conversations, max_turn_records=4) as h:

        async def lifecycle(i: int) -> None:
            # A kvtether client: hints with each turn, heartbeats while its tool runs.
            a = h.conversation(f"soak-{i}", hints={})
            for t in range(rng.randint(1, 3)):
                await a.say(f"step {t} of {i}", stream=rng.random() < 0.5)
                hb = await h.client.post(f"/v1/sessions/soak-{i}/heartbeat",
                                         json={"phase": "tool_running"})
                assert hb.status_code in (200, 410), hb.text
            if rng.random() < 0.7:
                assert (await h.client.delete(f"/v1/sessions/soak-{i}")).status_code == 200

        batch, warm_blocks, done = 20, 0, 0
        while done < HTTP_LIFECYCLES:
            await asyncio.gather(*(lifecycle(done + j) for j in range(batch)))
            done += batch
            clock.advance(30)  # abandoned sessions' leases lapse as the day goes on
            await h.app.state.sessions.reap_expired()
            assert len(h.app.state.store) <= max_conversations
            _forget_fake_history(h)
            if done == HTTP_LIFECYCLES // 5:
                gc.collect()
                warm_blocks = sys.getallocatedblocks()
        clock.advance(120)
        await h.app.state.sessions.reap_expired()
        _forget_fake_history(h)
        gc.collect()
        end_blocks = sys.getallocatedblocks()
        print(f"\nsoak (HTTP): {done} lifecycles; allocated blocks warm {warm_blocks} -> "
              f"end {end_blocks}")
        assert end_blocks <= warm_blocks * FLAT_FACTOR
        assert not [r for d in h.decode for r in d.held_leases()]  # no KV held on any D
        assert await h.metric("kvtether_active_leases") == 0
        assert all(len(c.turns) <= 4 for c in h.app.state.store.values())
        h.assert_kv_correct()
