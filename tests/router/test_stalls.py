"""A stalled instance (its engine step waits for a frozen worker) never holds a turn for minutes.

The kvtether connector reports how long the engine's step in flight has waited for its worker
(``step_running_s`` in ``GET /kvtether/v1/status``); past ``stall_after_s`` the router gives up
the legs in flight on that instance and sends it nothing new until it steps again. The check
runs in the router's housekeeping every 5 s; these tests run it directly.
"""

from __future__ import annotations

import asyncio

import pytest

from kvtether.router.app import _check_stalls
from tests.support.router_harness import make_router


async def _check(h) -> None:  # noqa: ANN001
    await _check_stalls(h.app.state.retention.deps)


async def _started(h, turn) -> None:  # noqa: ANN001
    """Wait until the turn's decode leg reached a decode instance."""
    for _ in range(200):
        if any(d.inflight for d in h.decode):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the decode leg never started")


async def test_a_stalled_decode_gives_up_its_non_streamed_leg_with_a_503() -> None:
    async with make_router(control=True, stall_after_s=30) as h:
        a = h.conversation("frozen-d")
        assert (await a.say("one")).outcome == "miss:first_turn"
        h.d.fail_next("hang")  # decode's worker froze: the leg never answers
        turn = asyncio.create_task(a.say("two", expect=503))
        await _started(h, turn)
        h.d.step_running_s = 12.0
        await _check(h)
        assert not turn.done()  # below stall_after_s: a slow step, not a stall
        h.d.step_running_s = 75.0
        await _check(h)
        t = await asyncio.wait_for(turn, 5)  # given up at once, not after minutes
        assert t.body["error"]["code"] == "upstream_stalled"
        assert "decode-0 is stalled" in t.body["error"]["message"]
        health = await h.client.get("/health")
        assert health.status_code == 503 and health.json()["backends"]["decode-0"] is False
        metrics = (await h.client.get("/metrics")).text
        assert 'kvtether_instance_stalls_total{instance="decode-0"} 1.0' in metrics
        assert 'kvtether_instance_stalled{instance="decode-0"} 1.0' in metrics
        # While stalled, a new turn is answered at once, with the same clear 503.
        assert (await a.say("three", expect=503)).body["error"]["code"] == "upstream_stalled"
        # It steps again: back in service.
        h.d.step_running_s = None
        await _check(h)
        assert (await h.client.get("/health")).status_code == 200
        assert (await a.say("four")).status == 200
        assert 'kvtether_instance_stalled{instance="decode-0"} 0.0' in (
            await h.client.get("/metrics")).text
        h.assert_kv_correct()


async def test_a_stalled_decode_leg_moves_to_another_decode_instance() -> None:
    async with make_router(control=True, n_decode=2, stall_after_s=30) as h:
        a = h.conversation("moves")
        await a.say("one")
        first = next(d for d in h.decode if d.decode_requests)
        other = next(d for d in h.decode if d is not first)
        first.fail_next("hang")
        turn = asyncio.create_task(a.say("two"))
        await _started(h, turn)
        first.step_running_s = 90.0
        await _check(h)
        t = await asyncio.wait_for(turn, 5)
        assert t.status == 200  # prefill's KV for this turn read by the other instance
        assert other.decode_requests
        h.assert_kv_correct()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stalled_prefill_leg_is_answered_by_decode_alone(stream: bool) -> None:
    async with make_router(control=True, stall_after_s=30) as h:
        a = h.conversation("frozen-p")
        await a.say("one")
        h.p.fail_next("hang")
        turn = asyncio.create_task(a.say("two", stream=stream))
        for _ in range(200):
            if h.p.inflight:
                break
            await asyncio.sleep(0.01)
        # The harness's prefill instances have no control channel; mark it as the check would.
        h.app.state.pool.prefill[0].mark_stalled(80.0)
        t = await asyncio.wait_for(turn, 5)
        assert t.status == 200 and t.outcome == "miss:transfer_failed"
        assert h.d.decode_requests[-1].body.get("kv_transfer_params") is None
        rec = (await h.client.get("/v1/sessions/frozen-p")).json()["turns"][-1]
        assert rec["prefill_instance"] is None
        h.app.state.pool.prefill[0].mark_stepping()
        assert (await a.say("three")).status == 200
        h.assert_kv_correct()


async def test_a_decode_stream_that_stalls_ends_with_an_error() -> None:
    async with make_router(control=True, stall_after_s=30) as h:
        a = h.conversation("stalls-mid-stream")
        await a.say("one")
        h.d.freeze_streams_after_tokens = 2
        before = len(h.d.decode_requests)
        turn = asyncio.create_task(h.chat(a.messages + [{"role": "user", "content": "two"}],
                                          "stalls-mid-stream", stream=True))
        for _ in range(200):  # a stream's leg is in flight once decode has its request
            if len(h.d.decode_requests) > before:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        h.d.step_running_s = 61.0
        await _check(h)
        t = await asyncio.wait_for(turn, 5)
        # In-process fakes deliver a stream's head with its body: the stall shows before the
        # status went out (503) here, mid-stream (an error event, no [DONE]) on a real socket.
        if t.status == 200:
            assert t.chunks is not None and "data: [DONE]" not in t.lines
            assert t.chunks[-1]["error"]["code"] == "upstream_stalled"
        else:
            assert t.status == 503 and t.body["error"]["code"] == "upstream_stalled"
        h.d.freeze_streams_after_tokens = None
        h.d.step_running_s = None
        await _check(h)
        assert (await a.say("three")).status == 200


async def test_zero_turns_the_check_off_and_a_silent_control_channel_changes_nothing() -> None:
    async with make_router(control=True, stall_after_s=0) as h:
        h.d.step_running_s = 500.0
        await _check(h)
        assert h.app.state.pool.decode[0].available
    async with make_router(control=True, stall_after_s=30) as h:
        h.d.step_running_s = 500.0
        h.d.fail_control_next(500)
        await _check(h)  # not known: an unanswered status says nothing about the engine
        assert h.app.state.pool.decode[0].available


async def test_a_prefill_leg_reading_a_stalled_decodes_kv_is_given_up() -> None:
    # A frozen decode worker does not serve NIXL reads of the KV it holds either: prefill's
    # read of it would hang until prefill_leg_timeout_s. The leg watches that decode too.
    async with make_router(control=True, stall_after_s=30) as h:
        a = h.conversation("reads-frozen")
        await a.say("one")
        h.p.fail_next("hang")  # the prefill leg waits for its read of decode's KV
        turn = asyncio.create_task(a.say("two", expect=503))
        for _ in range(200):
            if h.p.inflight:
                break
            await asyncio.sleep(0.01)
        h.d.step_running_s = 45.0
        await _check(h)
        t = await asyncio.wait_for(turn, 5)  # not after prefill_leg_timeout_s (120 s)
        assert t.body["error"]["code"] == "upstream_stalled"
        h.d.step_running_s = None
        await _check(h)
        assert (await a.say("three")).status == 200
        h.assert_kv_correct()
