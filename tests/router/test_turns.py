"""Multi-turn conversations through the router: reuse fires, headers, relayed bodies."""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import pytest

from kvtether import protocol as p
from kvtether.protocol import _kv_params as kv_keys
from tests.support.fake_vllm import BLOCK_SIZE, FakeVLLM
from tests.support.router_harness import Harness, make_router

TOOLS = [{
    "type": "function",
    "function": {"name": "search", "description": "search the repo",
                 "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}},
}]


def client_view(decode_body: dict[str, Any], wants_ids: bool) -> dict[str, Any]:
    """What the client must get: decode's answer minus the router's own fields."""
    body = copy.deepcopy(decode_body)
    body["kv_transfer_params"] = None
    if not wants_ids:
        body.pop("prompt_token_ids", None)
        for c in body["choices"]:
            c.pop("token_ids", None)
    return body


def client_chunks(decode_chunks: list[dict[str, Any]], wants_ids: bool) -> list[dict[str, Any]]:
    out = copy.deepcopy(decode_chunks)
    if not wants_ids:
        for chunk in out:
            chunk.pop("prompt_token_ids", None)
            for c in chunk.get("choices") or []:
                c.pop("token_ids", None)
    return out


def floor_blocks(n: int) -> int:
    return n // BLOCK_SIZE * BLOCK_SIZE


def check_relayed(h: Harness, turn, *, stream: bool, wants_ids: bool = False) -> None:
    d = next(d for d in h.decode if d.name == _decode_fake_name(turn))
    if stream:
        assert turn.chunks == client_chunks(d.stream_chunks[-1], wants_ids)
        assert turn.lines[-1] == "data: [DONE]"
        assert all(ln.startswith("data: ") for ln in turn.lines)
    else:
        assert turn.body == client_view(d.responses[-1], wants_ids)
        assert turn.body["kv_transfer_params"] is None


def _decode_fake_name(turn) -> str:
    # Router names are "decode-<i>"; the fakes are "decode<i>".
    return turn.headers[p.HEADER_DECODE_INSTANCE].replace("-", "")


@pytest.mark.parametrize(
    "control,stream",
    [(False, False), (True, False), (True, True)],
    ids=["upstream-nonstream", "control-nonstream", "control-stream"],
)
async def test_multi_turn_reuse_fires(control: bool, stream: bool) -> None:
    async with make_router(control=control) as h:
        a = h.conversation("conv-1")
        prev_seq = 0
        for i in range(4):
            extra = {"stream_options": {"include_usage": True}} if stream else {}
            t = await a.say(f"step {i} run the next command", stream=stream, **extra)
            assert t.headers[p.HEADER_TURN] == str(i + 1)
            assert t.headers[p.HEADER_CONVERSATION_ID] == "conv-1"
            assert t.headers[p.HEADER_DECODE_INSTANCE] == "decode-0"
            assert t.headers["X-Request-Id"]
            assert int(t.headers[p.HEADER_PROMPT_TOKENS]) == t.usage["prompt_tokens"]
            if i == 0:
                assert t.outcome == "miss:first_turn"
                assert t.reused == 0
                assert h.p.prefill_handles[-1] is None
            else:
                assert t.outcome == "fired", t.outcome
                # D computed every token of the previous turn but its last sampled one.
                assert t.reused == prev_seq - 1
                assert t.reused >= floor_blocks(prev_seq)
                fwd = h.p.prefill_handles[-1]
                assert fwd is not None and fwd["remote_engine_id"] == h.d.engine_id
                assert fwd["do_remote_decode"] is True
                assert fwd["remote_num_tokens"] == prev_seq - 1
            prev_seq = t.usage["prompt_tokens"] + t.usage["completion_tokens"]
            check_relayed(h, t, stream=stream)
            # Both legs carried the same request id; D got P's handle.
            p_req, d_req = h.p.requests[-1], h.d.requests[-1]
            assert p_req.headers["x-request-id"] == d_req.headers["x-request-id"]
            assert h.d.decode_params[-1]["remote_engine_id"] == h.p.engine_id
            assert p_req.body["max_tokens"] == 1 and "stream" not in p_req.body
            assert d_req.body.get("stream", False) is stream
        h.assert_kv_correct()
        assert [r.result for r in h.cluster.reads if r.reader == "prefill0"] == ["read"] * 3


async def test_streamed_turn_without_control_channel_is_not_retained(h: Harness) -> None:
    """vLLM 0.32 streams carry no kv_transfer_params: without the connector's control channel
    the router cannot learn D's handle, so the next turn recomputes."""
    a = h.conversation("s-1")
    t1 = await a.say("first, streamed", stream=True)
    assert t1.outcome == "miss:first_turn"
    t2 = await a.say("second, not streamed")
    assert t2.outcome == "miss:not_retained"
    assert h.p.prefill_handles[-1] is None
    t3 = await a.say("third")
    assert t3.outcome == "fired"
    h.assert_kv_correct()


async def test_streamed_turn_fetches_handle_over_control_channel(hc: Harness) -> None:
    a = hc.conversation("s-2")
    await a.say("first, streamed", stream=True)
    key = hc.d.decode_params[-1][kv_keys.KV_PARAM_HANDLE_KEY]
    assert ("GET", f"/kvtether/v1/handles/{key}") in hc.d.control_calls
    t2 = await a.say("second", stream=True)
    assert t2.outcome == "fired"
    assert hc.p.prefill_handles[-1]["remote_request_id"] == hc.d.leases[key].request_id
    hc.assert_kv_correct()


@pytest.mark.parametrize("stream", [False, True])
async def test_token_ids_kept_when_client_asks(hc: Harness, stream: bool) -> None:
    a = hc.conversation("ids")
    for _ in range(2):
        t = await a.say("go on", stream=stream, return_token_ids=True)
        check_relayed(hc, t, stream=stream, wants_ids=True)
        if stream:
            assert t.chunks[0]["prompt_token_ids"]
            ids = [i for c in t.chunks for ch in c["choices"] for i in ch.get("token_ids") or []]
            assert ids and ids[-1] == 3  # ends with EOS
        else:
            assert len(t.body["prompt_token_ids"]) == t.body["usage"]["prompt_tokens"]
            assert len(t.body["choices"][0]["token_ids"]) == t.body["usage"]["completion_tokens"]


@pytest.mark.parametrize("stream", [False, True])
async def test_token_ids_removed_when_client_did_not_ask(hc: Harness, stream: bool) -> None:
    a = hc.conversation("no-ids")
    t = await a.say("hello", stream=stream)
    # The router asked D for token ids for its own bookkeeping...
    assert hc.d.requests[-1].body["return_token_ids"] is True
    # ...and the client does not see them.
    text = t.response.text
    assert "prompt_token_ids" not in text and "token_ids" not in text
    assert "kv_transfer_params\":{" not in text.replace(" ", "")


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_calls_usage_and_finish_reason_relayed(hc: Harness, stream: bool) -> None:
    a = hc.conversation("tools")
    t1 = await a.say("please use_tool to find the bug", stream=stream, tools=TOOLS,
                     stream_options={"include_usage": True} if stream else None)
    assert t1.finish_reason == "tool_calls"
    check_relayed(hc, t1, stream=stream)
    call = a.messages[-1]["tool_calls"][0]
    assert call["function"]["name"] == "search"
    assert json.loads(call["function"]["arguments"])["query"]
    if stream:
        assert t1.usage == hc.d.stream_chunks[-1][-1]["usage"]
    else:
        assert t1.usage == hc.d.responses[-1]["usage"]
    # The tool result goes back; the history repeats D's sequence, so reuse fires.
    a.messages.append({"role": "tool", "tool_call_id": call["id"], "content": "found it"})
    t2 = await hc.chat(list(a.messages), "tools", tools=TOOLS, stream=stream)
    assert t2.status == 200 and t2.outcome == "fired"
    assert t2.finish_reason == "stop"
    hc.assert_kv_correct()


async def test_length_capped_turn_is_retained_and_reused(hc: Harness) -> None:
    a = hc.conversation("len")
    t1 = await a.say("write a lot", max_tokens=3)
    assert t1.finish_reason == "length"
    assert t1.usage["completion_tokens"] == 3
    t2 = await a.say("continue")
    assert t2.outcome == "fired"
    assert t2.reused == t1.usage["prompt_tokens"] + 3 - 1
    hc.assert_kv_correct()


async def test_client_kv_transfer_params_never_forwarded(hc: Harness) -> None:
    bogus = {"do_remote_decode": True, "remote_block_ids": [[1, 2, 3]],
             "remote_engine_id": "evil", "remote_request_id": "x", "remote_host": "h",
             "remote_port": 1, "remote_num_tokens": 96}
    a = hc.conversation("kvp")
    t = await a.say("hi", kv_transfer_params=bogus)
    assert t.status == 200
    assert hc.p.prefill_handles == [None]
    assert all(b["kv_transfer_params"].get("remote_engine_id") != "evil"
               for b in hc.all_received())


async def test_final_phase_hint_releases_kv_at_once(hc: Harness) -> None:
    a = hc.conversation("fin")
    await a.say("step one")
    t = await a.say("last one", kvtether_hints={"phase": "final"})
    assert t.outcome == "fired"
    key = hc.d.decode_params[-1][kv_keys.KV_PARAM_HANDLE_KEY]
    assert hc.d.releases == [key]
    assert hc.d.held_leases() == []
    status = (await hc.client.get("/v1/sessions/fin")).json()
    assert status["lease_state"] == "released" and status["retained_tokens"] == 0
    t3 = await a.say("actually one more")
    assert t3.outcome == "miss:released"


async def test_next_turn_gap_hint_sizes_the_lease(hc: Harness) -> None:
    a = hc.conversation("gap")
    before = time.time()
    await a.say("start a long build", kvtether_hints={"next_turn_gap_s": 100})
    ttl = hc.d.decode_params[-1][kv_keys.KV_PARAM_LEASE_TTL_S]
    s = hc.settings
    assert ttl == pytest.approx(100 * 1.5 + s.lease_safety_margin_s)
    status = (await hc.client.get("/v1/sessions/gap")).json()
    assert status["lease_deadline_unix_s"] >= before + ttl - 1
    # Capped by max_lease_s.
    await a.say("an even longer one", kvtether_hints={"next_turn_gap_s": 10_000})
    assert hc.d.decode_params[-1][kv_keys.KV_PARAM_LEASE_TTL_S] == pytest.approx(s.max_lease_s)


async def test_hints_header_accepted_and_not_forwarded(hc: Harness) -> None:
    a = hc.conversation("hh")
    t = await hc.chat(a.messages + [{"role": "user", "content": "x"}], "hh",
                      headers={p.HEADER_HINTS: json.dumps({"phase": "tool_running",
                                                           "next_prompt_tokens": 500})})
    assert t.status == 200
    for inst in (hc.p, hc.d):
        assert all(p.HEADER_HINTS.lower() not in r.headers for r in inst.requests)


@pytest.mark.parametrize("stream", [False, True])
async def test_completions_endpoint_serves_turns(h: Harness, stream: bool) -> None:
    t = await h.completion("Once upon a time", "cmpl", stream=stream, max_tokens=5)
    assert t.status == 200 and t.outcome == "miss:first_turn"
    assert len(t.text().split()) == 5
    assert t.finish_reason == "length"


async def test_completions_multi_turn_reuse_fires(h: Harness) -> None:
    prompt = "Once upon a time " + " ".join(f"w{i}" for i in range(60))
    t1 = await h.completion(prompt, "cmpl-2")
    assert int(t1.headers[p.HEADER_PROMPT_TOKENS]) == t1.usage["prompt_tokens"]
    t2 = await h.completion(prompt + t1.text() + " and then", "cmpl-2")
    assert t2.outcome == "fired"
    assert t2.reused == t1.usage["prompt_tokens"] + t1.usage["completion_tokens"] - 1


@pytest.mark.parametrize("stream", [False, True])
async def test_completions_prompt_token_ids_not_leaked(h: Harness, stream: bool) -> None:
    t = await h.completion("Once upon a time", "cmpl-3", stream=stream)
    assert t.status == 200
    assert "prompt_token_ids" not in t.response.text


async def test_decode_fake_rejects_unknown_model_like_vllm() -> None:
    """Sanity check of the fake itself: vLLM's error shape."""
    import httpx

    from tests.support.fake_vllm import Cluster

    fake = FakeVLLM(Cluster(), "x", "x", 1)
    async with httpx.AsyncClient(transport=fake.transport, base_url="http://x") as c:
        r = await c.post("/v1/chat/completions", json={"model": "nope", "messages": []})
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "The model `nope` does not exist.",
                                  "type": "NotFoundError", "param": None, "code": 404}}
