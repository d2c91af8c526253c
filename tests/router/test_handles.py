"""The life of a decode handle: single use, owned, released, reported honestly."""

from __future__ import annotations

import asyncio

import pytest

from kvtether.protocol import _kv_params as kv_keys
from tests.support.fake_vllm import BLOCK_SIZE
from tests.support.router_harness import Harness, make_router
from tests.support.waiting import await_for


async def test_each_handle_forwarded_at_most_once(hx: Harness) -> None:
    a = hx.conversation("once")
    for i in range(5):
        await a.say(f"turn {i}", stream=(i == 2))
    fwd = [(h["remote_engine_id"], h["remote_request_id"])
           for h in hx.p.prefill_handles if h is not None]
    assert len(fwd) == len(set(fwd))
    hx.assert_kv_correct()


async def test_prefill_rejection_keeps_the_handle(h: Harness) -> None:
    """A 4xx from P means vLLM rejected the request before scheduling it: the handle was not
    read and still fires next turn."""
    a = h.conversation("keep")
    await a.say("one")
    h.p.fail_next("400")
    await a.say("two", expect=400)
    t = await a.say("two again")
    assert t.outcome == "fired"
    h.assert_kv_correct()


async def test_handle_not_reused_after_prefill_failed_mid_request(h: Harness) -> None:
    a = h.conversation("reuse-after-500")
    await a.say("one")
    h.p.fail_next("500_after_read")
    await a.say("two", expect=500)
    await a.say("two again")
    h.assert_kv_correct()


async def test_failed_pull_reported_when_prefix_cache_hides_it() -> None:
    async with make_router(fake={"kvtether_connector": True}) as h:
        a = h.conversation("hidden")
        t1 = await a.say("one")
        # P's own prefix cache holds most of turn 1's prompt (it prefilled it); the pull of
        # the rest (its last whole block, the partial one and turn 1's answer) fails and P
        # recomputes more than a block of what it could have reused.
        prompt1 = t1.usage["prompt_tokens"]
        h.p.local_hit_tokens = lambda prompt: (prompt1 // BLOCK_SIZE - 1) * BLOCK_SIZE
        h.p.pull_failure = True
        t2 = await a.say("two")
        assert h.p.responses[-1]["kv_transfer_params"][kv_keys.KV_PARAM_PULL] == "failed"
        assert t2.outcome == "miss:transfer_failed"


async def test_failed_pull_detected_from_cached_tokens(h: Harness) -> None:
    a = h.conversation("failed")
    await a.say("one")
    h.p.pull_failure = True
    t = await a.say("two")
    assert t.outcome == "miss:transfer_failed"
    assert t.reused == 0
    h.p.pull_failure = False
    assert (await a.say("three")).outcome == "fired"


@pytest.mark.parametrize("how", ["budget", "delete"])
async def test_no_release_of_a_handle_in_flight(how: str) -> None:
    async with make_router(control=True) as h:
        a, b = h.conversation("a"), h.conversation("b")
        await a.say("one")
        h.app.state.runner.s.max_retained_tokens = h.d.held_leases()[0].num_tokens + 20
        gate = h.p.hold_next()  # a's next prefill waits in P's queue with a's handle
        a_turn = asyncio.create_task(a.say("two"))
        await await_for(lambda: h.p.holding, interval_s=0.005)
        if how == "budget":
            await b.say("one")  # b's retention pushes D over its budget
        else:
            await h.client.delete("/v1/sessions/a")
        gate.set()
        await a_turn
        h.assert_kv_correct()


async def test_kv_a_failed_read_left_on_decode_is_released_at_once() -> None:
    # The hand-off lease is long (a loaded prefill may queue the read for minutes); when P
    # declined or failed the read and recomputed, nobody will read that KV: freed now.
    async with make_router(control=True, fake={"kvtether_connector": True}) as h:
        a = h.conversation("declined")
        await a.say("one")
        key = h.d.decode_params[-1][kv_keys.KV_PARAM_HANDLE_KEY]
        h.p.pull_failure = True
        assert (await a.say("two")).outcome == "miss:transfer_failed"
        await await_for(lambda: key in h.d.releases, message=f"{key} released")
        h.p.pull_failure = False
        assert (await a.say("three")).outcome == "fired"
