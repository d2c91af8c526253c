"""Two router replicas sharing one real redis-server, in front of the same fake P/D instances:
a conversation's turns, heartbeats and release may land on either; a store outage costs reuse,
never a turn."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtether import protocol as p
from kvtether.router import create_app
from tests.support.redis_server import RedisServer, redis_port
from tests.support.router_harness import Harness, make_router
from tests.support.waiting import await_for

from .clock import ManualClock
from .test_concurrency import _raw_call_then_disconnect


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer.running(redis_port(2), tmp_path_factory.mktemp("redis")) as server:
        yield server


@contextlib.asynccontextmanager
async def two_replicas(url: str, **settings: Any) -> AsyncIterator[tuple[Harness, Harness]]:
    """Replica ``a`` (the usual harness) and replica ``b``: another app, same instances, same
    store, same clock."""
    settings.setdefault("store_key_prefix", f"t{uuid.uuid4().hex[:8]}:")
    async with make_router(control=True, store=url, **settings) as a:
        app = create_app(a.settings, transport=a.transport, clock=a.app.state.clock)
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
            base_url="http://replica-b",
        )
        async with app.router.lifespan_context(app), client:
            yield a, Harness(a.cluster, a.prefill, a.decode, a.settings, app, client,
                             a.transport)


@pytest.mark.parametrize("stream", [False, True])
async def test_turns_alternating_between_replicas_reuse_every_time(
    redis_server: RedisServer, stream: bool
) -> None:
    async with two_replicas(redis_server.url) as (a, b):
        agent_a, agent_b = a.conversation("alt"), b.conversation("alt")
        agent_b.messages = agent_a.messages  # one history, two doors
        outcomes = []
        for i in range(6):
            agent = agent_a if i % 2 == 0 else agent_b
            outcomes.append((await agent.say(f"step {i}", stream=stream)).outcome)
        assert outcomes == ["miss:first_turn"] + ["fired"] * 5
        status = (await a.client.get("/v1/sessions/alt")).json()
        assert status["turn_count"] == 6 and status["fired_turns"] == 5
        assert len(a.d.held_leases()) == 1  # one lease: each turn's handle was used once
        a.assert_kv_correct()


async def test_heartbeat_on_one_replica_release_on_the_other(redis_server: RedisServer) -> None:
    async with two_replicas(redis_server.url) as (a, b):
        agent = a.conversation("hb")
        await agent.say("one")
        await agent.say("two")
        hb = await b.client.post("/v1/sessions/hb/heartbeat", json={"phase": "tool_running"})
        assert hb.status_code == 200, hb.text
        assert hb.json()["retained_tokens"] == a.d.held_leases()[0].num_tokens
        gone = await a.client.delete("/v1/sessions/hb")
        assert gone.status_code == 200 and gone.json()["retained_tokens_freed"] > 0
        assert a.d.held_leases() == []
        agent.h = b
        assert (await agent.say("three")).outcome == "miss:released"
        a.assert_kv_correct()


async def test_release_while_the_other_replica_runs_a_turn(redis_server: RedisServer) -> None:
    async with two_replicas(redis_server.url) as (a, b):
        agent = a.conversation("rel")
        await agent.say("one")
        gate = a.d.hold_next()
        turn = asyncio.create_task(agent.say("two"))
        await await_for(lambda: a.d.holding)
        gone = await b.client.delete("/v1/sessions/rel")
        assert gone.status_code == 200
        gate.set()
        assert (await turn).outcome == "fired"
        assert a.d.held_leases() == []  # what turn two retained went as it settled
        assert (await agent.say("three")).outcome == "miss:released"
        a.assert_kv_correct()


async def test_racing_turns_one_waits_or_is_refused(redis_server: RedisServer) -> None:
    async with two_replicas(redis_server.url, store_lock_wait_s=0, max_branches=1) as (a, b):
        agent = a.conversation("race")
        await agent.say("one")
        history = agent.messages + [{"role": "user", "content": "go"}]
        gate = a.d.hold_next()
        first = asyncio.create_task(a.chat(list(history), "race"))
        await await_for(lambda: a.d.holding)
        refused = await b.chat(list(history), "race")
        assert refused.status == 409
        assert refused.body["error"]["code"] == "conversation_busy"
        gate.set()
        assert (await first).outcome == "fired"
    async with two_replicas(redis_server.url, max_branches=1) as (a, b):
        agent = a.conversation("race2")
        await agent.say("one")
        history = agent.messages + [{"role": "user", "content": "go"}]
        gate = a.d.hold_next()
        first = asyncio.create_task(a.chat(list(history), "race2"))
        await await_for(lambda: a.d.holding)
        second = asyncio.create_task(b.chat(list(history), "race2", stream=True))
        await asyncio.sleep(0.1)
        assert not second.done()  # waiting for the lock
        gate.set()
        t1, t2 = await first, await second
        assert {t1.headers[p.HEADER_TURN], t2.headers[p.HEADER_TURN]} == {"2", "3"}
        assert t1.outcome == t2.outcome == "fired"
        a.assert_kv_correct()


async def test_budget_and_reaper_act_across_replicas(redis_server: RedisServer) -> None:
    clock = ManualClock()
    async with two_replicas(redis_server.url, clock=clock, lease_ttl_s=30.0) as (a, b):
        one = a.conversation("one")
        await one.say("hello")
        per_conv = a.d.held_leases()[0].num_tokens
        a.settings.max_retained_tokens = per_conv + 20
        await b.app.state.retention.refresh_shared_counts()
        assert b.decode[0] is a.decode[0]
        assert b.app.state.pool.decode[0].retained_tokens == per_conv  # a's, seen by b
        two = b.conversation("two")
        await two.say("hello")  # over the cap: b evicts what a's conversation holds
        assert (await one.say("again")).outcome == "miss:evicted"  # (and evicts two's)
        a.settings.max_retained_tokens = None
        clock.advance(a.settings.decoder_kv_blocks_ttl_s + 1.0)  # past a person's lease
        await b.app.state.retention.reap_expired()
        assert a.d.held_leases() == []
        assert (await one.say("late")).outcome == "miss:lease_expired"
        assert (await two.say("late")).outcome == "miss:evicted"
        a.assert_kv_correct()


async def test_store_down_turns_degrade_to_plain_pd(tmp_path: Path) -> None:
    with RedisServer.running(redis_port(3), tmp_path) as server:
        async with two_replicas(server.url, store_timeout_s=0.5) as (a, b):
            agent = a.conversation("down")
            await agent.say("one")
            kept = a.d.held_leases()
            server.stop()
            t = await agent.say("two")
            assert t.outcome == "miss:store_unavailable"
            # Turn two's KV, which nobody could find again, was freed at once; turn one's
            # lapses with its lease.
            assert a.d.held_leases() == kept
            hb = await b.client.post("/v1/sessions/down/heartbeat", json={})
            assert hb.status_code == 503 and hb.json()["error"]["code"] == "store_unavailable"
            gone = await b.client.delete("/v1/sessions/down")
            assert gone.status_code == 503
            health = await a.client.get("/health")
            assert health.status_code == 200 and health.json()["store"] == {
                "kind": "redis", "ok": False}
            assert await a.metric("kvtether_store_unavailable_total") >= 1
            server.start()  # empty: the outage lost the table
            assert (await agent.say("three")).outcome == "miss:first_turn"
            assert (await agent.say("four")).outcome == "fired"
            a.assert_kv_correct()


@pytest.mark.parametrize("stream", [False, True])
async def test_store_lost_mid_turn_the_answer_is_still_delivered(
    tmp_path: Path, stream: bool
) -> None:
    with RedisServer.running(redis_port(4), tmp_path) as server:
        async with two_replicas(server.url, store_timeout_s=0.5) as (a, b):
            agent = a.conversation("mid")
            await agent.say("one")
            gate = a.d.hold_next()
            turn = asyncio.create_task(agent.say("two", stream=stream))
            await await_for(lambda: a.d.holding)
            server.stop()
            gate.set()
            assert (await turn).outcome == "fired"  # decided before the store went away
            assert a.d.held_leases() == []  # its KV could not be recorded: freed at once
            a.assert_kv_correct()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_hangs_up_does_not_leave_the_conversation_locked(
    redis_server: RedisServer, stream: bool
) -> None:
    # A lock left behind would outlive the next turn's wait (30 s expiry, 2 s wait): 409.
    async with two_replicas(redis_server.url, store_lock_ttl_s=30,
                            store_lock_wait_s=2) as (a, b):
        agent = a.conversation("hangup")
        await agent.say("one")
        body = {"model": "tiny", "stream": stream,
                "messages": agent.messages + [{"role": "user", "content": "two"}]}
        await _raw_call_then_disconnect(a.app, "/v1/chat/completions", body,
                                        {p.HEADER_CONVERSATION_ID: "hangup"}, send_yields=True)
        agent.h = b
        assert (await agent.say("two, retried")).status == 200
        a.assert_kv_correct()
