"""Local prefill (``local_prefill_max_tokens``): a turn that adds few tokens to what its decode
instance holds skips the prefill leg; decode computes them on its retained KV and retains the
result under a new lease, and the old lease is released."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from kvtether import protocol as p
from kvtether.protocol import _kv_params as kv_keys
from tests.support.fake_vllm import BLOCK_SIZE
from tests.support.router_harness import Agent, Harness, make_router

from .clock import ManualClock

FAKE = {"kvtether_connector": True}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_short_turn_is_computed_on_decode_and_keeps_its_kv(stream: bool) -> None:
    async with make_router(control=True, fake=FAKE, local_prefill_max_tokens=200) as h:
        agent = h.conversation("local")
        await agent.say("first question " * 20, stream=stream)
        first_key = h.d.decode_params[0][kv_keys.KV_PARAM_HANDLE_KEY]
        prefills = len(h.p.prefill_requests)
        t2 = await agent.say("short tool output " * 10, stream=stream)
        t3 = await agent.say("another short result " * 10, stream=stream)

        # No prefill leg for turns 2 and 3: decode got the local-prefill flag and a new key.
        assert len(h.p.prefill_requests) == prefills
        sent = h.d.decode_params[1:]
        assert [d.get(kv_keys.KV_PARAM_LOCAL_PREFILL) for d in sent] == [True, True]
        assert all("remote_block_ids" not in d for d in sent)
        keys = [d[kv_keys.KV_PARAM_HANDLE_KEY] for d in sent]
        assert len({first_key, *keys}) == 3

        # Reuse fired: what decode held, in whole blocks, was not computed again.
        for turn in (t2, t3):
            assert turn.outcome == "fired"
            assert turn.reused > 0 and turn.reused % BLOCK_SIZE == 0
        status = p.SessionStatus.model_validate(
            (await h.client.get("/v1/sessions/local")).json())
        assert [t.local_prefill for t in status.turns] == [False, True, True]
        assert [t.prefill_instance for t in status.turns][1:] == [None, None]
        assert status.turns[2].reused_tokens == t3.reused  # decode's report agrees
        assert status.turns[2].timings.prefill_leg_s is None
        assert status.turns[2].timings.decode is not None
        # No handle goes to prefill, so the lease is not extended for a prefill queue (a
        # renewal waits for one of decode's steps).
        assert h.d.renewals == []
        assert [t.timings.plan_lease_s for t in status.turns] == [None, None, None]

        # One lease left: turn 3's. The earlier ones were released, not left to lapse.
        held = h.d.held_leases()
        assert [r.lease_key for r in held] == [keys[-1]]
        assert status.retained_tokens and status.retained_tokens > t3.reused
        assert await h.metric("kvtether_local_prefill_turns_total") == 2
        h.assert_kv_correct()


async def test_a_long_turn_still_goes_through_prefill() -> None:
    async with make_router(control=True, fake=FAKE, local_prefill_max_tokens=50) as h:
        agent = h.conversation("long", hints={})  # a client's lease: lease_ttl_s
        await agent.say("first question " * 20)
        t2 = await agent.say("a long tool output " * 40)
        assert t2.outcome == "fired"
        assert len(h.p.prefill_requests) == 2
        # Its handle went to prefill with the lease extended to outlive prefill's queue.
        assert len(h.d.renewals) == 1
        assert kv_keys.KV_PARAM_LOCAL_PREFILL not in h.d.decode_params[1]
        assert await h.metric("kvtether_local_prefill_turns_total") == 0


async def test_off_by_default_every_turn_goes_through_prefill() -> None:
    async with make_router(control=True, fake=FAKE) as h:
        agent = h.conversation("default")
        await agent.say("first question " * 20)
        assert (await agent.say("ok")).outcome == "fired"
        assert len(h.p.prefill_requests) == 2


async def test_a_rewritten_history_is_never_computed_locally() -> None:
    async with make_router(control=True, fake=FAKE, local_prefill_max_tokens=10_000) as h:
        agent = h.conversation("rewritten")
        await agent.say("first question " * 20)
        await agent.say("second question " * 5)
        agent.messages[1]["content"] = "an edited first question " * 20
        t3 = await agent.say("third")
        # What still matches (the system prompt) is read by prefill, checked block by block.
        assert int(t3.headers[p.HEADER_SALVAGED_TOKENS]) > 0
        assert kv_keys.KV_PARAM_LOCAL_PREFILL not in h.d.decode_params[-1]
        assert len(h.p.prefill_requests) == 2  # turn 1 and turn 3
        h.assert_kv_correct()


async def test_a_short_turn_whose_decode_died_is_answered_by_another() -> None:
    async with make_router(control=True, fake=FAKE, n_decode=2,
                           local_prefill_max_tokens=200) as h:
        agent = h.conversation("moved")
        t1 = await agent.say("first question " * 20)
        home = t1.headers[p.HEADER_DECODE_INSTANCE]
        h.decode[int(home[-1])].down = True  # not noticed yet: the local leg is refused
        t2 = await agent.say("short")
        assert t2.status == 200 and t2.outcome == "miss:decode_unavailable"
        assert t2.headers[p.HEADER_DECODE_INSTANCE] != home
        t3 = await agent.say("short again")
        assert t3.outcome == "fired"  # on the new decode instance, locally
        assert t3.headers[p.HEADER_DECODE_INSTANCE] == t2.headers[p.HEADER_DECODE_INSTANCE]
        h.assert_kv_correct()


# ---------------------------------------------------------------- after the lease has ended
async def test_a_short_turn_in_the_last_seconds_of_its_lease_is_computed_on_decode() -> None:
    """The safety margin guards a handle forwarded to prefill; a turn decode computes on its
    own retained KV forwards none, so it is neither renewed nor sent the lapsed way."""
    async with make_router(control=True, fake=FAKE, local_prefill_max_tokens=200,
                           lease_ttl_s=5.0, lease_safety_margin_s=10.0) as h:
        agent = h.conversation("late")
        await agent.say("first question " * 20)
        t2 = await agent.say("short tool output " * 10)
        assert t2.outcome == "fired" and t2.reused > 0
        assert h.d.decode_params[-1].get(kv_keys.KV_PARAM_LOCAL_PREFILL) is True
        assert h.d.renewals == [] and h.d.prefix_cache_queries == []
        h.assert_kv_correct()


@contextlib.asynccontextmanager
async def _lapsed(name: str) -> AsyncIterator[tuple[Harness, Agent]]:
    """A conversation of two turns whose lease then lapsed (a person thought for longer);
    decode's prefix cache keeps what it freed until a test says otherwise."""
    clock = ManualClock()
    async with make_router(control=True, fake=FAKE, local_prefill_max_tokens=200,
                           lease_ttl_s=30.0, clock=clock) as h:
        h.d.keeps_freed_kv = True
        agent = h.conversation(name)
        await agent.say("first question " * 20)
        await agent.say("a tool result " * 10)
        # Past the lease of an answer handed back to a person (at least vLLM's 480 s).
        clock.advance(h.settings.decoder_kv_blocks_ttl_s + 1.0)
        yield h, agent


async def test_a_turn_after_its_lease_lapsed_goes_back_to_decodes_prefix_cache() -> None:
    """vLLM keeps a freed block findable until it needs the space: the decode instance that
    held the conversation still has it, so the turn is computed there, not on prefill."""
    async with _lapsed("lapsed") as (h, agent):
        prefills = len(h.p.prefill_requests)
        t3 = await agent.say("back from lunch " * 5)
        assert t3.status == 200 and t3.outcome == "fired"
        assert t3.reused > 0 and t3.reused % BLOCK_SIZE == 0
        assert len(h.p.prefill_requests) == prefills  # no prefill leg
        assert h.d.decode_params[-1].get(kv_keys.KV_PARAM_LOCAL_PREFILL) is True
        assert "remote_block_ids" not in h.d.decode_params[-1]
        (asked,) = h.d.prefix_cache_queries  # what turn 2 left, as far as turn 3 repeats it
        assert len(asked) >= t3.reused
        status = p.SessionStatus.model_validate(
            (await h.client.get("/v1/sessions/lapsed")).json())
        last = status.turns[-1]
        assert last.local_prefill and last.outcome == "fired" and last.reused_tokens == t3.reused
        assert last.timings.plan_prefix_cache_s is not None
        assert status.retained_tokens  # retained again, under a new lease
        assert await h.metric("kvtether_prefix_cache_returns_total") == 1
        h.assert_kv_correct()


async def test_a_lapsed_conversation_whose_kv_was_evicted_goes_through_prefill() -> None:
    async with _lapsed("evicted") as (h, agent):
        prefills = len(h.p.prefill_requests)
        for held in h.d.held_leases():
            held.end("expired")
        h.d.evict_freed_kv()  # decode needed the space
        t3 = await agent.say("back from lunch " * 5)
        assert t3.status == 200 and t3.outcome == "miss:lease_expired"
        assert len(h.p.prefill_requests) == prefills + 1
        assert len(h.d.prefix_cache_queries) == 1
        assert await h.metric("kvtether_prefix_cache_returns_total") == 0
        h.assert_kv_correct()


async def test_kv_evicted_after_the_lookup_is_recorded_as_the_miss_it_was() -> None:
    """The lookup is advice: decode may reuse the space before it schedules the turn. The turn
    record says what vLLM reported it computed."""
    async with _lapsed("raced") as (h, agent):
        h.d.cluster.held_prefix = lambda inst, prompt: 0  # evicted before it was scheduled
        t3 = await agent.say("back from lunch " * 5)
        assert t3.status == 200
        status = p.SessionStatus.model_validate(
            (await h.client.get("/v1/sessions/raced")).json())
        assert status.turns[-1].outcome == "miss:lease_expired"
        assert status.turns[-1].reused_tokens == 0


async def test_a_decode_that_cannot_look_up_its_cache_gets_the_turn_through_prefill() -> None:
    async with _lapsed("no-lookup") as (h, agent):
        h.d.prefix_cache_lookup = False
        prefills = len(h.p.prefill_requests)
        t3 = await agent.say("back from lunch " * 5)
        assert t3.status == 200 and t3.outcome == "miss:lease_expired"
        assert len(h.d.prefix_cache_queries) == 1
        assert len(h.p.prefill_requests) == prefills + 1


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_short_turn_goes_through_prefill_while_decode_has_one_queued(
        stream: bool) -> None:
    """Many conversations at once: while one short turn waits in decode's queue for its first
    token, the next conversation's short turn takes the prefill leg instead of queueing behind
    it (prefill would otherwise idle); once decode has answered, short turns stay there."""
    async with make_router(control=True, fake=FAKE, local_prefill_max_tokens=200) as h:
        a, b = h.conversation("queued-a"), h.conversation("queued-b")
        await a.say("first question " * 20, stream=stream)
        await b.say("another first question " * 20, stream=stream)
        prefills = len(h.p.prefill_requests)
        gate = h.d.hold_next()
        waiting = asyncio.create_task(a.say("short tool output " * 10, stream=stream))
        await _until(lambda: h.d.holding)

        tb = await b.say("short result " * 10, stream=stream)
        assert tb.outcome == "fired"
        assert len(h.p.prefill_requests) == prefills + 1  # b's turn, read from decode's KV
        assert kv_keys.KV_PARAM_LOCAL_PREFILL not in h.d.decode_params[-1]

        gate.set()
        ta = await waiting
        assert ta.outcome == "fired"
        status = p.SessionStatus.model_validate(
            (await h.client.get("/v1/sessions/queued-a")).json())
        assert status.turns[-1].local_prefill

        # Decode's queue is empty again: the next short turn is computed there.
        tb3 = await b.say("another short result " * 10, stream=stream)
        assert tb3.outcome == "fired"
        assert h.d.decode_params[-1].get(kv_keys.KV_PARAM_LOCAL_PREFILL) is True
        assert len(h.p.prefill_requests) == prefills + 1
        assert all(b.prompt_backlog_tokens == 0 for b in h.app.state.pool.all)
        h.assert_kv_correct()


async def test_short_turns_stay_on_decode_while_prefill_computes_a_long_first_turn() -> None:
    """The backlog is counted in prompt tokens, not turns: two short turns queued on decode
    are less work than one long first turn on prefill, so a third short turn joins decode's
    queue rather than waiting behind the long prompt (the tail of the 16-session bench)."""
    async with make_router(control=True, fake=FAKE, local_prefill_max_tokens=200) as h:
        agents = [h.conversation(f"short-{i}") for i in range(3)]
        for a in agents:
            await a.say("first question " * 20)
        prefills = len(h.p.prefill_requests)

        p_gate = h.p.hold_next()
        long_first = asyncio.create_task(h.conversation("long").say("a long document " * 150))
        await _until(lambda: h.p.holding)
        d_gates, queued = [], []
        for a in agents[:2]:
            d_gates.append(h.d.hold_next())
            queued.append(asyncio.create_task(a.say("short tool output " * 10)))
            await _until(lambda n=len(queued): h.d.inflight == n)
        pool = h.app.state.pool
        assert pool.prefill[0].inflight == 1 and pool.decode[0].prompt_backlog_tokens > 0
        assert pool.decode[0].prompt_backlog_tokens < pool.prefill[0].prompt_backlog_tokens
        for b in pool.all:
            assert await h.metric("kvtether_prompt_backlog_tokens",
                                  f'instance="{b.name}"') == b.prompt_backlog_tokens

        third = await agents[2].say("short result " * 10)
        assert third.outcome == "fired"
        assert h.d.decode_params[-1].get(kv_keys.KV_PARAM_LOCAL_PREFILL) is True
        assert len(h.p.prefill_requests) == prefills + 1  # the long turn's, still held

        p_gate.set()
        for g in d_gates:
            g.set()
        assert (await long_first).status == 200
        assert [(await t).outcome for t in queued] == ["fired", "fired"]
        assert len(h.p.prefill_requests) == prefills + 1
        assert all(b.prompt_backlog_tokens == 0 for b in pool.all)
        h.assert_kv_correct()


async def _until(cond: Callable[[], bool], timeout_s: float = 2.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met")
