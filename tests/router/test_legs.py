"""The two upstream legs (:mod:`kvtether.router.legs`): what is read of vLLM's answers, and
what a leg holds of its instance's load counts, given back however it ends."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kvtether.protocol import _kv_params as kv_keys
from kvtether.router import legs
from kvtether.router._errors import RouterHTTPError
from kvtether.router.backends import BackendPool
from kvtether.router.settings import RouterSettings


def chat_answer(**choice: Any) -> dict[str, Any]:
    base = {"message": {"role": "assistant", "content": "Hi"}, "token_ids": [42],
            "finish_reason": "length"}
    return {"id": "chatcmpl-1", "created": 5, "model": "m", "prompt_token_ids": [1, 2],
            "choices": [{**base, **choice}]}


def test_prefill_s_token_may_lead_only_as_plain_text() -> None:
    first = legs.first_token(chat_answer())
    assert first == legs.FirstToken(42, "Hi", "chatcmpl-1", 5, "m", [1, 2])
    assert legs.first_token(chat_answer(finish_reason="stop")) is None
    assert legs.first_token(chat_answer(token_ids=[42, 43])) is None
    assert legs.first_token(chat_answer(message={"content": "\ufffd"})) is None
    assert legs.first_token(chat_answer(message={"content": "x", "tool_calls": [{}]})) is None


def test_what_the_connectors_report_is_taken_out_of_the_handle() -> None:
    handle = {"do_remote_decode": True,
              kv_keys.KV_PARAM_PROMPT_TOKEN_IDS: [1, 2], kv_keys.KV_PARAM_OUTPUT_TOKEN_IDS: [3],
              kv_keys.KV_PARAM_CACHED_TOKENS: 16,
              kv_keys.KV_PARAM_TIMINGS: {"queue_s": 0.5}}
    assert legs.reported_token_ids(handle) == ([1, 2], [3])
    assert legs.reported_cached_tokens(handle) == 16
    timings = legs.engine_timings(handle)
    assert timings is not None and timings.queue_s == 0.5
    assert handle == {"do_remote_decode": True}  # what the other instance may read
    assert legs.reported_token_ids(handle) is None
    assert legs.reported_cached_tokens({kv_keys.KV_PARAM_CACHED_TOKENS: True}) is None
    assert legs.engine_timings(None) is None


def test_prompt_ids_of_chat_and_completions_answers() -> None:
    assert legs.prompt_ids({"prompt_token_ids": [1, 2]}) == [1, 2]
    assert legs.prompt_ids({"choices": [{"prompt_token_ids": [3]}]}) == [3]
    assert legs.prompt_ids({"choices": []}) == []


def test_upstream_failures_in_words_for_a_client() -> None:
    assert legs.failure_kind(httpx.ReadTimeout("t")) == "it did not answer in time"
    assert legs.failure_kind(httpx.ConnectError("c")) == "connection refused"
    assert legs.failure_kind(httpx.ReadError("r")) == "the connection broke off"


def pool(handler) -> BackendPool:  # noqa: ANN001
    settings = RouterSettings(prefill_urls=["http://p0"], decode_urls=["http://d0", "http://d1"])
    return BackendPool(settings, httpx.MockTransport(handler))


def test_an_answer_that_is_not_a_json_object_is_a_502() -> None:
    backend = pool(lambda _: httpx.Response(200)).prefill[0]
    with pytest.raises(RouterHTTPError) as err:
        legs.json_or_502(b"[1]", backend)
    assert err.value.status == 502
    assert legs.json_or_502(b'{"a": 1}', backend) == {"a": 1}


async def test_a_prefill_leg_counts_its_work_while_in_flight_and_not_after() -> None:
    seen: list[tuple[int, int]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((p.prefill[0].inflight, p.prefill[0].prompt_backlog_tokens))
        return httpx.Response(200, json={**chat_answer(), "kv_transfer_params": {
            "do_remote_prefill": True, "remote_block_ids": [[1]]}})

    p = pool(answer)
    leg = await legs.prefill(p.prefill[0], "/v1/chat/completions", {"messages": []}, "r", None,
                             work_tokens=300)
    assert seen == [(1, 300)] and leg.prompt_token_ids == [1, 2]
    assert (p.prefill[0].inflight, p.prefill[0].prompt_backlog_tokens) == (0, 0)

    p = pool(lambda _: httpx.Response(200, json={"choices": []}))  # no handle: misconfigured
    with pytest.raises(RouterHTTPError):
        await legs.prefill(p.prefill[0], "/v1/chat/completions", {}, "r", None, work_tokens=9)
    assert (p.prefill[0].inflight, p.prefill[0].prompt_backlog_tokens) == (0, 0)


async def test_a_decode_leg_holds_its_slot_for_the_relay_and_gives_back_failed_tries() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.host == "d0":
            raise httpx.ConnectError("refused")
        return httpx.Response(200, json={})

    p = pool(answer)
    opened = await legs.open_decode(p, "decode-0", "/v1/chat/completions", {}, "r")
    assert opened.backend.name == "decode-1"  # decode-0 refused: skipped
    assert [b.inflight for b in p.decode] == [0, 1]
    opened.slot.release()
    await opened.upstream.aclose()
    assert [b.inflight for b in p.decode] == [0, 0]

    p = pool(lambda _: httpx.Response(500, json={"error": {"message": "boom"}}))
    with pytest.raises(RouterHTTPError):
        await legs.open_decode(p, None, "/v1/chat/completions", {}, "r")
    assert [b.inflight for b in p.decode] == [0, 0]
