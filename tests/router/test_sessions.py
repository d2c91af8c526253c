"""The session API: GET shows where the KV is, heartbeats renew, DELETE releases, leases lapse."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvtether import protocol as p
from kvtether.protocol import _kv_params as kv_keys
from tests.support.router_harness import Harness, make_router

from .clock import ManualClock


async def two_turns(h: Harness, cid: str = "sess", stream: bool = False):
    # A kvtether client: it sends hints (here none in particular), so its leases start at
    # lease_ttl_s and heartbeats extend them. A harness's: tests/router/test_tool_leases.py.
    a = h.conversation(cid, hints={})
    await a.say("first", stream=stream)
    await a.say("second", stream=stream)
    return a


async def test_get_unknown_session_404(h: Harness) -> None:
    r = await h.client.get("/v1/sessions/nope")
    assert r.status_code == 404
    assert r.json()["error"]["type"]


@pytest.mark.parametrize("stream", [False, True])
async def test_get_session_after_turns(hx: Harness, stream: bool) -> None:
    control = hx.d.control
    before = time.time()
    a = await two_turns(hx, stream=stream)
    r = await hx.client.get("/v1/sessions/sess")
    assert r.status_code == 200
    s = p.SessionStatus.model_validate(r.json())
    assert s.conversation_id == "sess"
    assert s.decode_instance == "decode-0"
    assert [t.turn for t in s.turns] == [1, 2]
    assert [t.outcome for t in s.turns] == [
        "miss:first_turn", "fired" if control or not stream else "miss:not_retained"]
    assert all(t.stream is stream for t in s.turns)
    last = a.turns[-1]
    assert s.turns[-1].prompt_tokens == int(last.headers[p.HEADER_PROMPT_TOKENS])
    assert s.turns[-1].output_tokens > 0
    assert s.turns[-1].reused_tokens == last.reused
    assert s.turns[-1].decode_instance == "decode-0" and s.turns[-1].prefill_instance
    if stream and not control:
        assert s.lease_state == "none" and s.retained_tokens == 0
        return
    assert s.lease_state == "active"
    held = hx.d.held_leases()
    assert len(held) == 1
    assert s.retained_tokens == held[0].num_tokens
    ttl = hx.settings.lease_ttl_s if control else hx.settings.decoder_kv_blocks_ttl_s
    assert before < s.lease_deadline_unix_s <= time.time() + ttl
    assert s.lease_basis == ("default" if control else None)  # no connector: vLLM's TTL


async def test_heartbeat_unknown_404(h: Harness) -> None:
    r = await h.client.post("/v1/sessions/nope/heartbeat", json={})
    assert r.status_code == 404


@pytest.mark.parametrize("body", [
    b"{not json", b"[1]", b'{"expected_duration_s": -5}', b'{"phase": "napping"}',
    b'{"lease_extension_s": "long"}', b'{"unknown": 1}', b'{"tool_name": "' + b"x" * 300 + b'"}',
    b"\x80", b'{"lease_extension_s": NaN}',
], ids=["malformed", "not-object", "negative-duration", "bad-phase", "bad-extension",
        "unknown-field", "tool-name-too-long", "not-utf8", "nan"])
async def test_heartbeat_bad_body_400(h: Harness, body: bytes) -> None:
    await two_turns(h)
    r = await h.client.post("/v1/sessions/sess/heartbeat", content=body,
                            headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]
    # Nothing changed; the session still reuses.
    assert (await h.client.post("/v1/sessions/sess/heartbeat", json={})).status_code == 200


async def test_heartbeat_renews_with_control_channel(hc: Harness) -> None:
    await two_turns(hc)
    before = (await hc.client.get("/v1/sessions/sess")).json()["lease_deadline_unix_s"]
    key = hc.d.decode_params[-1][kv_keys.KV_PARAM_HANDLE_KEY]
    r = await hc.client.post("/v1/sessions/sess/heartbeat",
                             json={"phase": "tool_running", "tool_name": "pytest",
                                   "expected_duration_s": 120})
    assert r.status_code == 200
    hb = p.HeartbeatResponse.model_validate(r.json())
    s = hc.settings
    want = 120 * 1.5 + s.lease_safety_margin_s
    assert hb.lease_deadline_unix_s > before
    assert hb.lease_remaining_s == pytest.approx(want, abs=2)
    assert hb.retained_tokens == hc.d.held_leases()[0].num_tokens
    assert hc.d.renewals[-1] == (key, pytest.approx(want))  # earlier: renewals at hand-off
    status = (await hc.client.get("/v1/sessions/sess")).json()
    assert status["lease_deadline_unix_s"] == pytest.approx(hb.lease_deadline_unix_s)
    # An empty body renews too; an explicit extension is capped by max_lease_s.
    assert (await hc.client.post("/v1/sessions/sess/heartbeat")).status_code == 200
    r = await hc.client.post("/v1/sessions/sess/heartbeat", json={"lease_extension_s": 1e6})
    assert r.json()["lease_remaining_s"] == pytest.approx(s.max_lease_s, abs=2)


async def test_heartbeat_without_control_channel_capped_by_vllm_ttl() -> None:
    async with make_router(decoder_kv_blocks_ttl_s=100.0, lease_ttl_s=30.0) as h:
        await two_turns(h)
        r = await h.client.post("/v1/sessions/sess/heartbeat", json={"expected_duration_s": 500})
        assert r.status_code == 200
        # vLLM's fixed decoder_kv_blocks_ttl cannot be extended.
        assert r.json()["lease_remaining_s"] <= 100.0
        assert h.d.control_calls == []


async def test_delete_releases(hx: Harness) -> None:
    a = await two_turns(hx)
    held = hx.d.held_leases()
    r = await hx.client.delete("/v1/sessions/sess")
    assert r.status_code == 200
    body = r.json()
    assert body["released"] is True and body["retained_tokens_freed"] == held[0].num_tokens
    if hx.d.control:
        assert hx.d.releases == [held[0].lease_key]
        assert hx.d.held_leases() == []
    status = (await hx.client.get("/v1/sessions/sess")).json()
    assert status["lease_state"] == "released" and status["retained_tokens"] == 0
    hb = await hx.client.post("/v1/sessions/sess/heartbeat", json={})
    assert hb.status_code == 410 and hb.json()["error"]["code"] == "lease_released"
    # DELETE is idempotent.
    assert (await hx.client.delete("/v1/sessions/sess")).status_code == 200
    t = await a.say("again")
    assert t.outcome == "miss:released"
    assert int(t.headers[p.HEADER_REUSABLE_TOKENS]) > t.reused == 0
    assert hx.p.prefill_handles[-1] is None
    hx.assert_kv_correct()


async def test_delete_unknown_404(h: Harness) -> None:
    assert (await h.client.delete("/v1/sessions/nope")).status_code == 404


@pytest.mark.parametrize("control", [False, True])
async def test_lease_expiry(control: bool) -> None:
    ttl = {"lease_ttl_s": 30.0} if control else {"decoder_kv_blocks_ttl_s": 30.0}
    clock = ManualClock()
    async with make_router(control=control, lease_safety_margin_s=0.0, clock=clock,
                           **ttl) as h:
        a = await two_turns(h, "exp")
        clock.advance(45.0)
        hb = await h.client.post("/v1/sessions/exp/heartbeat", json={})
        assert hb.status_code == 410
        assert hb.json()["error"]["code"] == "lease_expired"
        status = (await h.client.get("/v1/sessions/exp")).json()
        assert status["lease_state"] == "expired"
        t = await a.say("back after a long tool")
        assert t.outcome == "miss:lease_expired"
        assert h.p.prefill_handles[-1] is None
        h.assert_kv_correct()


async def test_a_lease_within_the_safety_margin_is_renewed_before_its_handle_goes() -> None:
    """A turn back in the last seconds of its lease keeps its KV: the lease is renewed to
    ``handoff_lease_s`` first, and the handle carries the renewed deadline (the fake prefill,
    like vLLM's, declines a handle within 5 s of its expiry)."""
    async with make_router(control=True, lease_ttl_s=5.0, lease_safety_margin_s=10.0,
                           handoff_lease_s=60.0) as h:
        a = await two_turns(h, "margin")
        (held,) = h.d.held_leases()
        t = await a.say("third")
        assert t.outcome == "fired"
        # (turn 2 came back within turn 1's margin too)
        assert len(h.d.renewals) == 2 and h.d.renewals[-1] == (held.lease_key, 60.0)
        fwd = h.p.prefill_handles[-1]
        assert fwd is not None and fwd["remote_blocks_expiry_time"] == held.expiry_perf
        h.assert_kv_correct()


@pytest.mark.parametrize("late", ["within_late_renewal", "handoff_renewals_off"])
async def test_a_handle_about_to_expire_is_never_forwarded(late: str) -> None:
    """Too close to its end to renew (D would refuse, after waiting for a step), or with
    hand-off renewals off: no handle is forwarded (P would decline it, or read freed blocks)."""
    ttl = {"lease_ttl_s": 1.0} if late == "within_late_renewal" else {
        "lease_ttl_s": 5.0, "handoff_lease_s": 0.0}
    async with make_router(control=True, lease_safety_margin_s=10.0, **ttl) as h:
        a = await two_turns(h, "margin")
        t = await a.say("third")
        assert t.outcome == "miss:lease_expired"
        assert h.p.prefill_handles[-1] is None
        assert h.d.renewals == []
        h.assert_kv_correct()


async def test_renewed_lease_is_readable_after_original_expiry() -> None:
    async with make_router(control=True, lease_ttl_s=2.0, lease_safety_margin_s=1.6,
                           fake={"read_margin_s": 1.5}) as h:
        a = await two_turns(h, "renew")
        await asyncio.sleep(0.6)
        assert (await h.client.post("/v1/sessions/renew/heartbeat", json={})).status_code == 200
        t = await a.say("after the tool")
        assert t.outcome == "fired", [r.result for r in h.cluster.reads]


async def test_heartbeat_during_a_turn_is_accepted(hc: Harness) -> None:
    a = hc.conversation("busy")
    await a.say("first")
    hc.d.delay_s = 0.2
    turn = asyncio.create_task(a.say("slow one"))
    await asyncio.sleep(0.05)
    r = await hc.client.post("/v1/sessions/busy/heartbeat", json={})
    assert r.status_code == 200
    await turn


async def test_lease_is_extended_at_handoff_so_a_slow_prefill_still_reads() -> None:
    """A short lease is renewed to ``handoff_lease_s`` before its handle goes to prefill, and
    the handle carries the renewed deadline (P compares it before reading)."""
    async with make_router(control=True, lease_ttl_s=10, handoff_lease_s=60) as hc:
        a = hc.conversation("handoff", hints={})
        await a.say("first")
        (held,) = hc.d.held_leases()
        old_expiry = held.expiry_perf
        t = await a.say("second")
        assert t.outcome == "fired"
        assert hc.d.renewals == [(held.lease_key, 60.0)]
        fwd = hc.p.prefill_handles[-1]
        assert fwd is not None and fwd["remote_blocks_expiry_time"] == held.expiry_perf
        assert held.expiry_perf >= old_expiry + 45
        metrics = (await hc.client.get("/metrics")).text
        assert 'kvtether_lease_events_total{event="extended_at_handoff"} 1.0' in metrics
        hc.assert_kv_correct()


async def test_lease_gone_at_handoff_is_a_lease_expired_miss() -> None:
    """D dropped the KV behind the router's back: the hand-off renewal finds out, nothing is
    forwarded, and the turn recomputes."""
    async with make_router(control=True, lease_ttl_s=10, handoff_lease_s=60) as hc:
        a = hc.conversation("gone")
        await a.say("first")
        (held,) = hc.d.held_leases()
        held.end("expired")
        t = await a.say("second")
        assert t.status == 200 and t.outcome == "miss:lease_expired"
        assert hc.p.prefill_handles[-1] is None
        hc.assert_kv_correct()


async def test_long_lease_is_not_renewed_at_handoff() -> None:
    async with make_router(control=True, lease_ttl_s=300, handoff_lease_s=60) as hc:
        a = hc.conversation("long")
        await a.say("first")
        assert (await a.say("second")).outcome == "fired"
        assert hc.d.renewals == []
