"""The conversation store contract, on both stores (in-memory, and a real redis-server); what
only a shared store has to do (fencing, lock expiry, the watchdog, an outage)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from kvtether import protocol as p
from kvtether.router.conversations import (
    ConversationBusyError,
    ConversationStore,
    InMemoryConversationStore,
    RetainedKV,
    StoreFencedError,
    StoreUnavailableError,
)
from kvtether.router.metrics import RouterMetrics
from kvtether.router.store_redis import RedisConversationStore
from kvtether.router.tool_leases import AwaitingTools
from tests.support.redis_server import RedisServer, redis_port
from tests.support.waiting import await_for


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer.running(redis_port(0), tmp_path_factory.mktemp("redis")) as server:
        yield server


def redis_store(server: RedisServer, **kw) -> RedisConversationStore:  # noqa: ANN003
    # A prefix of its own per test: no flush, no leftovers between tests.
    kw.setdefault("key_prefix", f"t{uuid.uuid4().hex[:8]}:")
    return RedisConversationStore(server.url, **kw)


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[ConversationStore]:
    if request.param == "memory":
        yield InMemoryConversationStore()
        return
    s = redis_store(request.getfixturevalue("redis_server"), metrics=RouterMetrics())
    try:
        yield s
    finally:
        await s.aclose()


def retained(decode: str = "decode-0", tokens: int = 48, deadline: float = 2e9) -> RetainedKV:
    return RetainedKV(
        decode_instance=decode,
        params={"do_remote_decode": True, "remote_block_ids": [[1, 2, 3]],
                "remote_num_tokens": tokens, "remote_engine_id": "e"},
        token_ids=list(range(tokens + 5)), retained_tokens=tokens,
        lease_deadline_unix_s=deadline, handle_key="k1", created_unix_s=1.5,
    )


async def test_a_turn_saves_what_the_next_one_loads(store: ConversationStore) -> None:
    held = await store.lock("c1", "alice", wait_s=1)
    assert not held.busy and held.writable
    conv = held.conv
    assert conv.turn_count == 0 and conv.retained is None
    conv.add_turn(p.TurnRecord(turn=1, outcome="miss:first_turn", prompt_tokens=40))
    conv.remember_sequence(list(range(53)) + [2**33])
    conv.decode_instance = "decode-0"
    conv.retained = retained()
    conv.phase = p.Phase.TOOL_RUNNING
    conv.tool_gaps.observe(["Bash:pytest"], 120.0)  # a client without hints (tool_leases)
    conv.awaiting_tools = AwaitingTools(("Bash:pytest", "Read"), 1234.5, 1)
    conv.lease_basis = "tool_calls"
    assert await held.commit() is False
    assert await held.commit() is False  # idempotent

    seen = await store.read("c1", "alice")
    assert seen is not None
    assert seen.turn_count == 1 and seen.turns[0].outcome == "miss:first_turn"
    assert list(seen.last_token_ids) == list(range(53)) + [2**33]
    assert seen.retained is not None and seen.retained.params["remote_block_ids"] == [[1, 2, 3]]
    assert seen.retained.token_ids == list(range(53))
    assert seen.phase == p.Phase.TOOL_RUNNING
    assert seen.tool_gaps == conv.tool_gaps and seen.tool_gaps.estimate_s("Bash:pytest") > 60
    assert seen.awaiting_tools == AwaitingTools(("Bash:pytest", "Read"), 1234.5, 1)
    assert seen.status(0).lease_state == "active" and seen.status(0).lease_basis == "tool_calls"
    # A heartbeat, release or reap holds less of it (a shared store's partial load), and
    # what it saves leaves the learned tool gaps alone.
    beat = await store.try_lock("c1", "alice")
    assert beat is not None
    beat.conv.phase = p.Phase.IDLE
    await beat.commit()
    again = await store.read("c1", "alice")
    assert again is not None and again.phase == p.Phase.IDLE
    assert again.tool_gaps == conv.tool_gaps and again.awaiting_tools == seen.awaiting_tools
    assert await store.read("c1", "bob") is None  # another tenant's id is another conversation


async def test_a_second_turn_waits_then_is_refused_busy(store: ConversationStore) -> None:
    first = await store.lock("c2", "", wait_s=1)
    with pytest.raises(ConversationBusyError):
        await store.lock("c2", "", wait_s=0.05)
    waiter = asyncio.create_task(store.lock("c2", "", wait_s=60))
    await asyncio.sleep(0)
    first.conv.add_turn(p.TurnRecord(turn=1, outcome="miss:first_turn"))
    await first.commit()
    second = await waiter
    assert second.conv.turn_count == 1  # loaded after the first one saved
    await second.commit()


async def test_try_lock_sees_a_turn_in_flight_and_unknown_ids(store: ConversationStore) -> None:
    assert await store.try_lock("nobody", "") is None
    turn = await store.lock("c3", "", wait_s=1)
    beat = await store.try_lock("c3", "")
    assert beat is not None and beat.busy
    await beat.commit()
    await turn.commit()
    beat = await store.try_lock("c3", "")
    assert beat is not None and not beat.busy
    await beat.commit()


async def test_a_release_during_a_turn_is_done_when_it_settles(store: ConversationStore) -> None:
    await (await store.lock("c4", "", wait_s=1)).commit()  # an earlier turn retained nothing
    turn = await store.lock("c4", "", wait_s=1)
    deleting = await store.try_lock("c4", "", release_after_turn=True)
    assert deleting is not None and deleting.busy
    await deleting.commit()
    turn.conv.retained = retained()
    assert await turn.commit() is True  # still held: free the KV, then commit again
    assert (await store.try_lock("c4", "")).busy  # type: ignore[union-attr]
    turn.conv.retained = None
    turn.conv.gone_cause = p.MissCause.RELEASED
    assert await turn.commit() is False
    nxt = await store.lock("c4", "", wait_s=1)
    assert nxt.conv.gone_cause == p.MissCause.RELEASED and nxt.conv.retained is None
    assert await nxt.commit() is False  # the request was used up


async def test_holders_lapsed_and_counts_follow_saves(store: ConversationStore) -> None:
    for cid, tenant, decode, tokens, deadline in [
        ("a", "t1", "decode-0", 32, 100.0), ("b", "t1", "decode-1", 64, 300.0),
        ("c", "t2", "decode-0", 16, 200.0),
    ]:
        held = await store.lock(cid, tenant, wait_s=1)
        held.conv.retained = retained(decode, tokens, deadline)
        await held.commit()
    assert {c.conversation_id for c in await store.holders(decode_instance="decode-0")} == {
        "a", "c"}
    assert {c.conversation_id for c in await store.holders(tenant="t1")} == {"a", "b"}
    assert sorted(await store.lapsed(250.0)) == [("t1", "a"), ("t2", "c")]
    # The turn of "a" moves it to decode-1 with more tokens; "c" lets go of its KV.
    held = await store.lock("a", "t1", wait_s=1)
    held.conv.retained = retained("decode-1", 40, 500.0)
    await held.commit()
    held = await store.lock("c", "t2", wait_s=1)
    held.conv.retained = None
    await held.commit()
    assert await store.holders(decode_instance="decode-0") == []
    assert await store.lapsed(250.0) == []
    counts = await store.shared_counts()
    if store.kind == "memory":
        assert counts is None  # the router's own counts are exact
    else:
        assert counts == ({"decode-0": 0, "decode-1": 104}, {"t1": 104})


# ------------------------------------------------------------------ shared store only
async def test_a_stalled_holder_cannot_overwrite_a_newer_turn(redis_server: RedisServer) -> None:
    store = redis_store(redis_server, lock_ttl_s=0.2)
    try:
        stalled = await store.lock("f", "", wait_s=1)
        stalled._watchdog.cancel()  # type: ignore[attr-defined]  # the process stalls
        newer = await store.lock("f", "", wait_s=30)  # once the stalled lock expired
        newer.conv.add_turn(p.TurnRecord(turn=1, outcome="miss:first_turn"))
        newer.conv.retained = retained()
        stalled.conv.decode_instance = "stale"
        with pytest.raises(StoreFencedError):
            await stalled.commit()  # the newer holder still holds it
        await newer.commit()
        # Stalled again; this time the newer holder has saved and gone when it wakes up.
        stalled = await store.lock("f", "", wait_s=1)
        stalled._watchdog.cancel()  # type: ignore[attr-defined]
        newer = await store.lock("f", "", wait_s=30)
        await newer.commit()
        stalled.conv.decode_instance = "stale"
        with pytest.raises(StoreFencedError):
            await stalled.commit()  # nobody holds it, but a newer token wrote it
        conv = await store.read("f", "")
        assert conv is not None and conv.turn_count == 1 and conv.decode_instance is None
        assert (await store.shared_counts())[0] == {"decode-0": 48}  # type: ignore[index]
    finally:
        await store.aclose()


async def test_the_watchdog_keeps_a_long_turn_locked(redis_server: RedisServer) -> None:
    store = redis_store(redis_server, lock_ttl_s=0.3)
    try:
        turn = await store.lock("w", "", wait_s=1)
        await asyncio.sleep(1.0)  # three lock lifetimes
        with pytest.raises(ConversationBusyError):
            await store.lock("w", "", wait_s=0)
        assert await turn.commit() is False
        other = await store.lock("w", "", wait_s=0)
        await other.commit()
    finally:
        await store.aclose()


async def test_store_down_is_a_typed_error_and_recovery_is_automatic(
    tmp_path: Path,
) -> None:
    with RedisServer.running(redis_port(1), tmp_path) as server:
        store = redis_store(server, timeout_s=0.5)
        try:
            held = await store.lock("d", "", wait_s=1)
            server.stop()
            with pytest.raises(StoreUnavailableError):
                await held.commit()
            with pytest.raises(StoreUnavailableError):
                await store.lock("d", "", wait_s=1)
            assert await store.check() is False
            server.start()
            assert await store.check() is True
            held = await store.lock("d", "", wait_s=1)
            await held.commit()
        finally:
            await store.aclose()


async def test_round_trips_per_turn_are_counted(redis_server: RedisServer) -> None:
    metrics = RouterMetrics()
    store = redis_store(redis_server, metrics=metrics)
    try:
        for _ in range(3):
            held = await store.lock("m", "", wait_s=1)
            held.conv.retained = retained()
            await held.commit()
        text = metrics.render().decode()
        assert 'kvtether_store_ops_total{op="lock"} 3.0' in text
        assert 'kvtether_store_ops_total{op="save"} 3.0' in text
    finally:
        await store.aclose()


async def test_an_expired_conversation_leaves_the_reaper_list(redis_server: RedisServer) -> None:
    store = redis_store(redis_server, conversation_ttl_s=0.2)
    try:
        held = await store.lock("gone", "", wait_s=1)
        held.conv.retained = retained(deadline=100.0)
        await held.commit()

        async def expired() -> bool:  # Redis expires the idle conversation
            return await store.read("gone", "") is None

        await await_for(expired, interval_s=0.05)
        assert await store.lapsed(200.0) == [("", "gone")]
        assert await store.try_lock("gone", "") is None
        assert await store.lapsed(200.0) == []
    finally:
        await store.aclose()


def test_store_setting_takes_memory_or_a_redis_url() -> None:
    from pydantic import ValidationError

    from kvtether.router import RouterSettings

    for ok in ("memory", "redis://cache:6379/2", "rediss://cache:6380/0", "unix:///run/r.sock"):
        assert RouterSettings(store=ok).store == ok
    with pytest.raises(ValidationError, match="store must be 'memory' or a Redis/Valkey URL"):
        RouterSettings(store="http://cache:6379")


async def test_letting_go_in_the_background_never_leaves_a_lock(
    store: ConversationStore,
) -> None:
    turn = await store.lock("bg", "", wait_s=1)
    deleting = await store.try_lock("bg", "", release_after_turn=True)
    assert deleting is not None and deleting.busy
    turn.conv.retained = retained()  # e.g. a failed turn that put its handle back
    turn.commit_soon()
    nxt = await store.lock("bg", "", wait_s=30)
    assert await nxt.commit() is True  # the release is still asked for: free, then commit
    nxt.conv.retained = None
    assert await nxt.commit() is False
