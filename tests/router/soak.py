"""A simulated day of agent sessions against the router's conversation table and retention.

Drives :class:`~kvtether.router.conversations.InMemoryConversationStore` and
:class:`~kvtether.router.retention.Retention` directly (no HTTP: a million lifecycles through
the ASGI app would take far longer than the minutes a test may), with a fake decode-side lease
table standing in for the connectors, and the router's clock injected so a day passes in
minutes. Each lifecycle: create, one to four turns with tool gaps, heartbeats while the tool
runs, then release (DELETE) or abandon (the lease lapses). Events of all sessions interleave in
simulated time, so thousands are alive at once, as in a busy deployment.
"""

from __future__ import annotations

import gc
import heapq
import random
import sys
from dataclasses import dataclass, field
from typing import Any

import psutil

from kvtether import protocol as p
from kvtether.router._deps import RouterDeps
from kvtether.router.backends import Backend, BackendPool
from kvtether.router.conversations import InMemoryConversationStore
from kvtether.router.leases import RenewResult, RenewStatus
from kvtether.router.metrics import RouterMetrics
from kvtether.router.retention import Retention
from kvtether.router.settings import RouterSettings

from .clock import ManualClock

DAY_S = 86_400.0


class FakeLeases:
    """The decode instances' lease tables (what the kvtether connector holds), in memory."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.held: dict[tuple[str, str], float] = {}  # (decode, key) -> deadline

    def hold(self, decode: Backend, key: str, ttl_s: float) -> None:
        self.held[(decode.name, key)] = self.clock.now_unix_s() + ttl_s

    def lapse(self) -> None:
        """What each connector does on its own: free leases past their deadline."""
        now = self.clock.now_unix_s()
        for k in [k for k, deadline in self.held.items() if deadline <= now]:
            del self.held[k]

    async def renew(self, decode: Backend, key: str | None, ttl_s: float) -> RenewResult:
        k = (decode.name, key or "")
        if k not in self.held or self.held[k] <= self.clock.now_unix_s():
            self.held.pop(k, None)
            return RenewResult(RenewStatus.GONE)
        deadline = self.clock.now_unix_s() + ttl_s
        self.held[k] = deadline
        return RenewResult(RenewStatus.RENEWED, p.LeaseInfo(
            key=key or "", request_id=key or "", state="active", retained_blocks=1,
            retained_tokens=16, deadline_unix_s=deadline, remaining_s=ttl_s,
            remote_blocks_expiry_time=deadline, created_unix_s=deadline - ttl_s))

    async def release(self, decode: Backend, key: str | None) -> bool:
        return self.held.pop((decode.name, key or ""), None) is not None


@dataclass(order=True)
class _Event:
    at_s: float
    seq: int
    kind: str = field(compare=False)  # "turn" | "heartbeat" | "end"
    session: dict[str, Any] = field(compare=False)


@dataclass
class SoakResult:
    lifecycles: int
    turns: int
    heartbeats: int
    released: int
    abandoned: int
    max_table: int
    # (lifecycles started, table size, allocated Python blocks, RSS bytes)
    samples: list[tuple[int, int, int, int]]
    warm_blocks: int
    end_blocks: int
    warm_rss: int
    end_rss: int
    leases_held_at_end: int
    leases_counted_at_end: int


async def soak_table(
    lifecycles: int = 1_000_000, max_conversations: int = 5_000, seed: int = 12,
    lease_ttl_s: float = 60.0, warm_up_share: float = 0.1, samples: int = 20,
) -> SoakResult:
    clock = ManualClock(1_800_000_000.0)
    settings = RouterSettings(
        prefill_urls=["http://p0"], decode_urls=["http://d0", "http://d1"],
        decode_control_urls=["http://d0c", "http://d1c"], lease_ttl_s=lease_ttl_s,
        max_conversations=max_conversations, max_turn_records=8,
    )
    leases = FakeLeases(clock)
    dropped: list[Any] = []
    store = InMemoryConversationStore(max_conversations, dropped.append, clock.now_unix_s,
                                      max_turn_records=settings.max_turn_records)
    pool = BackendPool(settings)
    deps = RouterDeps(settings, pool, store, leases, RouterMetrics(), clock)  # type: ignore[arg-type]
    retention = Retention(deps)
    rng = random.Random(seed)
    events: list[_Event] = []
    seq = 0
    interval_s = DAY_S / lifecycles  # arrivals spread over a day

    def push(at_s: float, kind: str, session: dict[str, Any]) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, _Event(at_s, seq, kind, session))

    started = turns = heartbeats = released = abandoned = max_table = 0
    sample_every = max(1, lifecycles // samples)
    # Warm: the table has filled up (every later lifecycle replaces one) and then some.
    warm_at = max(int(lifecycles * warm_up_share), 2 * max_conversations)
    samples_out: list[tuple[int, int, int, int]] = []
    warm_blocks = warm_rss = 0
    proc = psutil.Process()

    def sample() -> tuple[int, int, int, int]:
        # Allocated blocks count every live Python object (no tracing cost on a million
        # lifecycles, unlike tracemalloc); RSS is what the operator sees.
        gc.collect()
        return started, len(store), sys.getallocatedblocks(), proc.memory_info().rss
    next_reap_s = clock.t + 1.0
    t0 = clock.t
    try:
        while started < lifecycles or events:
            arrival_s = t0 + started * interval_s
            if started < lifecycles and (not events or arrival_s <= events[0].at_s):
                ev = _Event(arrival_s, 0, "turn", {
                    "id": f"conv-{started}", "turns_left": rng.randint(1, 4),
                    "abandon": rng.random() < 0.3, "tokens": 0})
                started += 1
                if started % sample_every == 0 or started == warm_at:
                    samples_out.append(sample())
                    if started == warm_at:
                        _, _, warm_blocks, warm_rss = samples_out[-1]
            else:
                ev = heapq.heappop(events)
            clock.t = max(clock.t, ev.at_s)
            while clock.t >= next_reap_s:  # the router's housekeeping, every 60 s of the day
                next_reap_s += 60.0
                leases.lapse()
                await retention.reap_expired()
            s = ev.session
            if ev.kind == "turn":
                turns += 1
                conv = store.get_or_create(s["id"])
                for gone in dropped:  # what the app's on_drop does, as a task
                    await retention.release(gone, p.MissCause.EVICTED)
                dropped.clear()
                max_table = max(max_table, len(store))
                # The turn consumed the old handle (P read it); D retains the longer sequence.
                retention.take(conv)
                s["tokens"] += rng.randint(200, 1200)
                decode = pool.decode[hash(s["id"]) % 2]
                key = f"{s['id']}-{conv.next_turn}"
                conv.add_turn(p.TurnRecord(turn=conv.next_turn, outcome="fired",
                                           prompt_tokens=s["tokens"], reused_tokens=s["tokens"]))
                conv.last_active_unix_s = clock.t
                leases.hold(decode, key, lease_ttl_s)
                handle = {"do_remote_decode": True, "remote_block_ids": [[1, 2, 3]],
                          "remote_num_tokens": s["tokens"]}
                retention.retain(conv, decode, handle, list(range(16)), key, lease_ttl_s)
                s["turns_left"] -= 1
                gap_s = rng.uniform(1.0, 90.0)
                if s["turns_left"] > 0:
                    for hb_s in range(20, int(gap_s), 20):
                        push(clock.t + hb_s, "heartbeat", s)
                    push(clock.t + gap_s, "turn", s)
                else:
                    push(clock.t + gap_s, "end", s)
            elif ev.kind == "heartbeat":
                heartbeats += 1
                conv = store.get(s["id"])
                if conv is not None and conv.retained is not None:
                    await retention.renew(conv, lease_ttl_s)
            else:  # end of the session
                if s["abandon"]:
                    abandoned += 1  # the client crashed: its lease lapses by itself
                else:
                    released += 1
                    held = await store.try_lock(s["id"], "", release_after_turn=True)
                    if held is not None:
                        await retention.release_by_client(held)
                        await held.commit()
        # Let every abandoned lease lapse, as a crashed client's would.
        clock.advance(2 * lease_ttl_s)
        leases.lapse()
        await retention.reap_expired()
        _, _, end_blocks, end_rss = sample()
    finally:
        await pool.aclose()
    counted = sum(b.retained_tokens for b in pool.decode)
    return SoakResult(started, turns, heartbeats, released, abandoned, max_table, samples_out,
                      warm_blocks, end_blocks, warm_rss, end_rss, len(leases.held), counted)
