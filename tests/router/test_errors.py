"""Bad input and upstream failures: clear OpenAI-style errors, and the router keeps serving."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvtether import protocol as p
from tests.support.router_harness import Harness, Turn, make_router

CHAT = "/v1/chat/completions"
GOOD = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}


def assert_openai_error(t: Turn, status: int, *, param: str | None = None,
                        code: Any = None) -> dict[str, Any]:
    assert t.status == status, (t.status, t.response.text[:300])
    assert t.response.headers["content-type"].startswith("application/json")
    err = t.body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


async def assert_still_serves(h: Harness) -> None:
    t = await h.post(CHAT, GOOD, conv="after-error")
    assert t.status == 200, t.response.text[:300]


BAD_INPUTS = [
    pytest.param(CHAT, b"{not json", {}, 400, None, None, id="malformed-json"),
    pytest.param(CHAT, b"\xff\xfe", {}, 400, None, None, id="not-utf8"),
    pytest.param(CHAT, [1, 2], {}, 400, None, None, id="non-object"),
    pytest.param(CHAT, "just a string", {}, 400, None, None, id="json-string"),
    pytest.param(CHAT, {"model": "tiny"}, {}, 400, "messages", None, id="missing-messages"),
    pytest.param(CHAT, {"model": "tiny", "messages": []}, {}, 400, "messages", None,
                 id="empty-messages"),
    pytest.param(CHAT, {"model": "tiny", "messages": "hi"}, {}, 400, "messages", None,
                 id="messages-not-list"),
    pytest.param("/v1/completions", {"model": "tiny"}, {}, 400, "prompt", None,
                 id="missing-prompt"),
    pytest.param(CHAT, {**GOOD, "model": "gpt-9"}, {}, 404, "model", "model_not_found",
                 id="unknown-model"),
    pytest.param("/v1/completions", {"model": "gpt-9", "prompt": "x"}, {}, 404, "model",
                 "model_not_found", id="unknown-model-completions"),
    pytest.param(CHAT, GOOD, {p.HEADER_HINTS: "{nope"}, 400, p.BODY_HINTS, None,
                 id="hints-header-not-json"),
    pytest.param(CHAT, GOOD, {p.HEADER_HINTS: '{"phase": "sleeping"}'}, 400, p.BODY_HINTS, None,
                 id="hints-header-bad-phase"),
    pytest.param(CHAT, GOOD, {p.HEADER_HINTS: "[1]"}, 400, p.BODY_HINTS, None,
                 id="hints-header-not-object"),
    pytest.param(CHAT, {**GOOD, p.BODY_HINTS: {"next_prompt_tokens": -1}}, {}, 400,
                 p.BODY_HINTS, None, id="hints-body-negative"),
    pytest.param(CHAT, {**GOOD, p.BODY_HINTS: {"next_turn_gap_s": "soon"}}, {}, 400,
                 p.BODY_HINTS, None, id="hints-body-bad-type"),
    pytest.param(CHAT, {**GOOD, p.BODY_HINTS: {"typo": 1}}, {}, 400, p.BODY_HINTS, None,
                 id="hints-body-unknown-field"),
    pytest.param(CHAT, {**GOOD, p.BODY_HINTS: "fast"}, {}, 400, p.BODY_HINTS, None,
                 id="hints-body-not-object"),
    pytest.param(CHAT, GOOD, {p.HEADER_CONVERSATION_ID: "x" * 257}, 400, "X-Conversation-Id",
                 None, id="conversation-id-too-long"),
    pytest.param(CHAT, {**GOOD, "conversation_id": "y" * 300}, {}, 400, "conversation_id",
                 None, id="body-conversation-id-too-long"),
    pytest.param(CHAT, {**GOOD, "conversation_id": 42}, {}, 400, "conversation_id", None,
                 id="body-conversation-id-not-string"),
    pytest.param(CHAT, GOOD, {"X-Session-Id": "   "}, 400, "X-Session-Id", None,
                 id="blank-session-id"),
    # The client's rule, now the router's too: an id the session API's URLs can carry.
    pytest.param(CHAT, {**GOOD, "conversation_id": "my thread/42"}, {}, 400, "conversation_id",
                 None, id="body-conversation-id-bad-characters"),
    pytest.param(CHAT, {**GOOD, "conversation_id": "filé"}, {}, 400, "conversation_id", None,
                 id="body-conversation-id-not-ascii"),
]


@pytest.mark.parametrize("path,body,headers,status,param,code", BAD_INPUTS)
async def test_bad_input(h: Harness, path: str, body: Any, headers: dict[str, str],
                         status: int, param: str | None, code: str | None) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    t = await h.post(path, raw, headers=headers)
    assert_openai_error(t, status, param=param, code=code)
    # Rejected before any completion reached vLLM.
    assert h.p.requests == [] and h.d.requests == []
    await assert_still_serves(h)


async def test_max_conversation_id_length_accepted(h: Harness) -> None:
    t = await h.post(CHAT, GOOD, conv="z" * p.MAX_CONVERSATION_ID_LEN)
    assert t.status == 200


async def test_prompt_too_long_relays_vllm_error_and_keeps_the_handle() -> None:
    async with make_router(control=True, fake={"max_model_len": 400}) as h:
        a = h.conversation("long")
        await a.say("short one")
        t = await a.say(" ".join(["word"] * 500), expect=400)
        # vLLM's own error body, relayed unchanged.
        err = assert_openai_error(t, 400, param="input_tokens", code=400)
        assert set(t.body) == {"error"} and set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "BadRequestError"
        assert "maximum context length is 400 tokens" in err["message"]
        # vLLM rejected it before scheduling: the handle was not consumed and still fires.
        t3 = await a.say("a normal follow-up")
        assert t3.outcome == "fired"
        h.assert_kv_correct()


@pytest.mark.parametrize("where", ["prefill", "decode"])
@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_500_relayed(h: Harness, where: str, stream: bool) -> None:
    a = h.conversation("e500")
    await a.say("fine")
    (h.p if where == "prefill" else h.d).fail_next("500")
    t = await a.say("boom", stream=stream, expect=500)
    err = assert_openai_error(t, 500, code=500)
    assert err["type"] == "InternalServerError"
    await assert_still_serves(h)
    t3 = await a.say("and again")
    assert t3.status == 200
    if where == "decode":  # P read (consumed) the handle, D failed: nothing retained
        assert t3.outcome == "miss:not_retained"
    h.assert_kv_correct()


async def test_upstream_old_error_shape_relayed_as_openai_error(h: Harness) -> None:
    h.p.fail_next("object_error")
    t = await h.post(CHAT, GOOD)
    err = assert_openai_error(t, 400)
    assert err["message"] == "bad request (old shape)"
    await assert_still_serves(h)


async def test_upstream_400_relayed_unchanged(h: Harness) -> None:
    h.d.fail_next("400")
    t = await h.post(CHAT, GOOD)
    assert t.status == 400
    assert t.body == {"error": {"message": "a vLLM validation error (parameter=temperature)",
                                "type": "BadRequestError", "param": "temperature",
                                "code": 400}}
    await assert_still_serves(h)


async def test_prefill_down_then_back(h: Harness) -> None:
    h.p.down = True
    t = await h.post(CHAT, GOOD, conv="down")
    assert_openai_error(t, 502, code="upstream_unavailable")
    # Marked down, it is still tried (it is the only one): a clear error again, no hang.
    t2 = await h.post(CHAT, GOOD, conv="down")
    assert t2.status in (502, 503)
    assert_openai_error(t2, t2.status)
    h.p.down = False
    assert (await h.client.get("/health")).status_code == 200  # a health check marks it up
    await assert_still_serves(h)


@pytest.mark.parametrize("stream", [False, True])
async def test_decode_down(h: Harness, stream: bool) -> None:
    h.d.down = True
    t = await h.post(CHAT, {**GOOD, "stream": stream}, conv="ddown")
    assert t.status in (502, 503)
    assert_openai_error(t, t.status, code="upstream_unavailable")
    t2 = await h.post(CHAT, GOOD, conv="ddown")
    assert_openai_error(t2, 503)
    h.d.down = False
    assert (await h.client.get("/health")).status_code == 200
    await assert_still_serves(h)


@pytest.mark.parametrize("where", ["prefill", "decode"])
@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_hang_times_out(where: str, stream: bool) -> None:
    async with make_router(upstream_timeout_s=0.5) as h:
        (h.p if where == "prefill" else h.d).fail_next("hang")
        t = await h.post(CHAT, {**GOOD, "stream": stream}, conv="hang")
        if where == "prefill":
            # Decode answers alone (test_faults: the prefill leg's timeout).
            assert t.status == 200
        else:
            assert t.status in (502, 504)
            assert_openai_error(t, t.status)
        await h.client.get("/health")
        await assert_still_serves(h)


async def test_prefill_without_kv_transfer_params_is_misconfigured(h: Harness) -> None:
    h.p.fail_next("no_kv_params")
    t = await h.post(CHAT, GOOD)
    assert_openai_error(t, 502, code="upstream_misconfigured")
    await assert_still_serves(h)


async def test_decode_without_handle_is_not_retained(hx: Harness) -> None:
    a = hx.conversation("nohandle")
    await a.say("one")
    hx.d.fail_next("no_handle")
    t2 = await a.say("two")
    assert t2.outcome == "fired"
    t3 = await a.say("three")
    assert t3.outcome == "miss:not_retained"
    t4 = await a.say("four")
    assert t4.outcome == "fired"


@pytest.mark.parametrize("where", ["prefill", "decode"])
async def test_upstream_garbage_is_a_502(h: Harness, where: str) -> None:
    (h.p if where == "prefill" else h.d).fail_next("garbage")
    t = await h.post(CHAT, GOOD)
    assert_openai_error(t, 502)


async def test_upstream_garbage_does_not_break_the_router(h: Harness) -> None:
    h.d.fail_next("garbage")
    t = await h.post(CHAT, GOOD, conv="garbage")
    assert t.status >= 500
    await assert_still_serves(h)
    a = h.conversation("garbage")
    assert (await a.say("hello")).status == 200


async def test_malformed_decode_handle_does_not_fail_later_turns(h: Harness) -> None:
    a = h.conversation("flat")
    await a.say("one " * 40)
    h.d.fail_next("flat_block_ids")
    await a.say("two")
    a.messages[-1]["content"] = "edited answer"
    t = await a.say("three")
    assert t.status == 200


async def test_error_inside_stream_relayed_and_not_retained(hx: Harness) -> None:
    a = hx.conversation("midstream")
    await a.say("one")
    hx.d.fail_next("stream_error")
    t = await a.say("two", stream=True)
    assert t.lines[-1] == "data: [DONE]"
    assert t.chunks[-1]["error"]["type"] == "InternalServerError"
    t3 = await a.say("three")
    assert t3.outcome == "miss:not_retained"
    assert (await a.say("four")).outcome == "fired"
    hx.assert_kv_correct()


async def test_stream_handle_fetch_fails_when_control_channel_down(hc: Harness) -> None:
    a = hc.conversation("ctl-down")
    await a.say("one")
    hc.d.control_down = True
    t = await a.say("two", stream=True)
    assert t.status == 200 and t.outcome == "fired"
    hc.d.control_down = False
    assert (await a.say("three")).outcome == "miss:not_retained"
    assert (await a.say("four")).outcome == "fired"
    hc.assert_kv_correct()


async def test_heartbeat_never_reports_an_unrenewed_deadline(hc: Harness) -> None:
    await hc.conversation("hb-down").say("one")
    before = (await hc.client.get("/v1/sessions/hb-down")).json()["lease_deadline_unix_s"]
    hc.d.control_down = True
    r = await hc.client.post("/v1/sessions/hb-down/heartbeat", json={"expected_duration_s": 600})
    assert r.status_code != 200 or r.json()["lease_deadline_unix_s"] <= before + 1


async def test_transient_control_error_does_not_drop_the_lease(hc: Harness) -> None:
    a = hc.conversation("hb-500")
    await a.say("one")
    hc.d.fail_control_next(503)
    r = await hc.client.post("/v1/sessions/hb-500/heartbeat", json={})
    assert r.status_code != 410
    assert (await a.say("two")).outcome == "fired"


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
async def test_a_body_with_a_non_json_number_is_a_400(h, constant: str) -> None:
    # Found by the fuzz test: Python's json reads these, then re-encoding the prefill leg's
    # body for vLLM failed (500).
    body = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "x": %s}' % constant
    turn = await h.post("/v1/chat/completions", body, conv="nan")
    assert turn.status == 400 and constant in turn.body["error"]["message"]
