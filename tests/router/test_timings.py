"""Where a turn's time went: the router's stages and the connectors' engine timings, in the turn
record, in Prometheus, and never forwarded to the other instance as part of a handle."""

from __future__ import annotations

import asyncio

import pytest

from kvtether import protocol as p
from kvtether.protocol import _kv_params as kv_keys
from tests.support.router_harness import make_router


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_each_turn_records_where_its_time_went(stream: bool) -> None:
    fake = {"kvtether_connector": True, "queue_delay_s": 0.05, "delay_s": 0.02}
    async with make_router(control=True, fake=fake) as h:
        agent = h.conversation("timed")
        await agent.say("first question " * 20, stream=stream)
        await agent.say("tool output " * 40, stream=stream)
        status = p.SessionStatus.model_validate(
            (await h.client.get("/v1/sessions/timed")).json())
        assert [t.outcome for t in status.turns] == ["miss:first_turn", "fired"]
        for turn in status.turns:
            t = turn.timings
            assert t.router_wait_s is not None
            assert t.plan_s is not None and t.prefill_leg_s is not None
            assert t.prefill_leg_s >= 0.05  # the fake prefill waited in its queue that long
            assert t.prefill is not None and t.prefill.queue_s == 0.05
            assert t.prefill.engine_s == pytest.approx(0.07)
            assert t.decode is not None and t.decode.queue_s == 0.05
            assert (t.decode_first_token_s is not None) is stream
            if stream:
                assert t.decode_first_token_s <= turn.ttft_s
        # Turn 2 had KV to reuse: its plan tokenized the prompt and checked the lease, each timed.
        plan2 = status.turns[1].timings
        assert plan2.plan_tokenize_s is not None and plan2.plan_lease_s is not None
        assert plan2.plan_lease_s <= plan2.plan_s
        # (with branches on, the default, it was tokenized while its branch was chosen)
        assert plan2.plan_tokenize_s <= plan2.router_wait_s
        assert status.turns[0].timings.plan_tokenize_s is None  # nothing retained to check
        # The stages known when the answer starts also travel in a header (for the client).
        sent = p.parse_timings_header(agent.turns[-1].headers[p.HEADER_TIMINGS])
        assert {"router_wait", "plan", "prefill_leg", "prefill_queue", "prefill_read"} <= set(sent)
        # Turn 2 read decode's KV; turn 1 had nothing to read.
        assert status.turns[0].timings.prefill.read_s is None
        assert status.turns[1].timings.prefill.read_s == 0.001
        # Timings are reports, not handle fields: never sent on to the other instance.
        assert all(kv_keys.KV_PARAM_TIMINGS not in d for d in h.d.decode_params)
        assert all(kv_keys.KV_PARAM_TIMINGS not in (hd or {}) for hd in h.p.prefill_handles)
        metrics = (await h.client.get("/metrics")).text
        for stage in ("router_wait", "plan", "prefill_leg", "prefill_queue", "prefill_read",
                      "decode_queue", "decode_engine"):
            assert f'kvtether_turn_stage_seconds_count{{stage="{stage}"}}' in metrics, stage


async def test_a_turn_that_waits_for_its_conversation_says_so() -> None:
    fake = {"kvtether_connector": True, "delay_s": 0.3}
    async with make_router(control=True, fake=fake, max_branches=1) as h:
        first = h.chat([{"role": "user", "content": "a " * 30}], conv="busy")
        second = h.chat([{"role": "user", "content": "b " * 30}], conv="busy")
        await asyncio.gather(first, second)
        status = p.SessionStatus.model_validate(
            (await h.client.get("/v1/sessions/busy")).json())
        waits = sorted(t.timings.router_wait_s for t in status.turns)
        # The second waited for the first turn's answer (0.3 s); the first for nothing.
        assert waits[1] >= 0.25 and waits[0] < waits[1], waits
        # Its wait is part of what the client waited for.
        later = max(status.turns, key=lambda t: t.timings.router_wait_s)
        assert later.latency_s >= later.timings.router_wait_s
