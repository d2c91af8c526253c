"""Where the conversation id comes from, and what happens without one."""

from __future__ import annotations

import pytest

from kvtether import protocol as p
from tests.support.router_harness import Harness


def _assert_kvtether_fields_stripped(h: Harness) -> None:
    for body in h.all_received():
        for field in p.KVTETHER_BODY_FIELDS:
            assert field not in body, (field, body.keys())
    for inst in (*h.prefill, *h.decode):
        for r in inst.requests:
            assert "x-conversation-id" not in r.headers
            assert "x-session-id" not in r.headers


@pytest.mark.parametrize("source", ["X-Conversation-Id", "X-Session-Id", "body"])
async def test_conversation_id_sources(hx: Harness, source: str) -> None:
    messages = [{"role": "system", "content": "be brief " * 20}]
    for i in range(3):
        messages.append({"role": "user", "content": f"question {i}"})
        headers, extra = {}, {}
        if source == "body":
            extra = {"conversation_id": "abc-1", "kvtether_hints": {"phase": "thinking"}}
        else:
            headers = {source: "abc-1"}
        t = await hx.chat(list(messages), headers=headers, **extra)
        assert t.status == 200
        assert t.headers[p.HEADER_CONVERSATION_ID] == "abc-1"
        assert t.outcome == ("miss:first_turn" if i == 0 else "fired")
        messages.append(t.assistant_message())
    _assert_kvtether_fields_stripped(hx)
    status = (await hx.client.get("/v1/sessions/abc-1")).json()
    assert len(status["turns"]) == 3


async def test_conversation_id_precedence(h: Harness) -> None:
    a = h.conversation(None)
    a.messages.append({"role": "user", "content": "one"})
    t1 = await h.chat(a.messages, "main")
    a.messages.append(t1.assistant_message())
    a.messages.append({"role": "user", "content": "two"})
    # X-Conversation-Id wins over X-Session-Id and the body field.
    t2 = await h.chat(a.messages, headers={"X-Conversation-Id": "main", "X-Session-Id": "other"},
                      conversation_id="third")
    assert t2.headers[p.HEADER_CONVERSATION_ID] == "main" and t2.outcome == "fired"
    a.messages.append(t2.assistant_message())
    a.messages.append({"role": "user", "content": "three"})
    # X-Session-Id wins over the body field.
    t3 = await h.chat(a.messages, headers={"X-Session-Id": "main"}, conversation_id="third")
    assert t3.headers[p.HEADER_CONVERSATION_ID] == "main" and t3.outcome == "fired"
    assert (await h.client.get("/v1/sessions/other")).status_code == 404
    assert (await h.client.get("/v1/sessions/third")).status_code == 404
    _assert_kvtether_fields_stripped(h)


async def test_conversation_id_is_trimmed(h: Harness) -> None:
    t = await h.chat([{"role": "user", "content": "x"}], headers={"X-Session-Id": "  pad  "})
    assert t.status == 200 and t.headers[p.HEADER_CONVERSATION_ID] == "pad"


async def test_without_conversation_id_plain_pd(hx: Harness) -> None:
    a = hx.conversation(None)
    for stream in (False, True, False):
        t = await a.say("what now", stream=stream)
        assert t.outcome == "miss:no_conversation_id"
        assert t.reused == 0
        assert p.HEADER_CONVERSATION_ID not in t.headers
        assert t.headers[p.HEADER_TURN] == "1"
    # Still real P/D: P prefilled with fresh params, D read P's blocks.
    assert hx.p.prefill_handles == [None, None, None]
    for params in hx.p.requests:
        kvp = params.body["kv_transfer_params"]
        assert kvp["do_remote_decode"] is True and kvp["do_remote_prefill"] is False
    assert [kvp["remote_engine_id"] for kvp in hx.d.decode_params] == [hx.p.engine_id] * 3
    assert (await hx.client.get("/health")).json()["conversations"] == 0
    hx.assert_kv_correct()


async def test_without_conversation_id_nothing_stays_retained(hc: Harness) -> None:
    t = await hc.chat([{"role": "user", "content": "one-shot question"}])
    assert t.status == 200
    assert hc.d.held_leases() == []
