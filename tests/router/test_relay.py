"""The relay's parts without I/O (:mod:`kvtether.router.relay`): SSE lines in, events out; the
first-token splice; the observer that takes a streamed turn's timings."""

from __future__ import annotations

from typing import Any

import pytest

from kvtether import protocol as p
from kvtether.router.backends import Backend
from kvtether.router.legs import FirstToken
from kvtether.router.metrics import RouterMetrics
from kvtether.router.relay import (
    Chunk,
    Done,
    EventFramer,
    FirstTokenSplice,
    Frame,
    Passthrough,
    Splice,
    StreamObserver,
    TurnContext,
    greedy_single,
    parse_data_line,
)
from kvtether.router.apis import api_for
from tests.router.clock import ManualClock


# ---------------------------------------------------------------- parsing
def test_data_lines_become_chunks_done_or_lines_passed_through() -> None:
    assert parse_data_line('data: {"id":"c","choices":[]}') == Chunk({"id": "c", "choices": []})
    assert parse_data_line("data: [DONE]") == Done()
    assert parse_data_line("") is None
    assert parse_data_line(": keep-alive") == Passthrough(": keep-alive")
    assert parse_data_line("data: {not json") == Passthrough("data: {not json")
    assert parse_data_line("data: 5") == Passthrough("data: 5")
    assert Passthrough(": x").encode() == b": x\n\n"


def test_named_events_are_framed_at_blank_lines() -> None:
    framer = EventFramer()
    lines = ["event: response.created", 'data: {"a":1}', "", "", "event: response.completed",
             'data: {"b":2}', ""]
    frames = [f for f in map(framer.feed, lines) if f is not None]
    assert frames == [Frame("response.created", ("event: response.created", 'data: {"a":1}')),
                      Frame("response.completed", ("event: response.completed", 'data: {"b":2}'))]
    assert frames[0].encode() == b'event: response.created\ndata: {"a":1}\n\n'
    assert framer.flush() is None
    framer.feed("data: {}")  # a last event without its blank line
    assert framer.flush() == Frame("", ("data: {}",))


# ---------------------------------------------------------------- the first token from prefill
FIRST = FirstToken(token_id=7, text="Hel", chunk_id="chatcmpl-p", created=1, model="m",
                   prompt_token_ids=[1, 2])


def chunk(delta: dict[str, Any], token_ids: list[int] | None = None,
          finish: str | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": "chatcmpl-d", "choices": [choice]}


def test_decode_s_role_and_first_token_are_dropped_and_ids_take_prefill_s() -> None:
    splice = FirstTokenSplice(FIRST)
    role = chunk({"role": "assistant", "content": ""})
    assert splice.apply(role) is Splice.DROP and role["id"] == "chatcmpl-p"
    assert splice.apply(chunk({"content": "Hel"}, [7])) is Splice.DROP  # nothing else in it
    rest = chunk({"content": "Hello"}, [7, 8])
    splice = FirstTokenSplice(FIRST)
    assert splice.apply(rest) is Splice.KEEP
    assert rest["choices"][0]["token_ids"] == [8] and rest["choices"][0]["delta"]["content"] == "lo"
    later = chunk({"content": "Hel"}, [7])
    assert splice.apply(later) is Splice.KEEP and later["choices"][0]["token_ids"] == [7]


def test_a_different_first_token_is_a_mismatch() -> None:
    assert FirstTokenSplice(FIRST).apply(chunk({"content": "Bye"}, [9])) is Splice.MISMATCH


@pytest.mark.parametrize("body, relayed", [
    ({"temperature": 0}, True),
    ({"temperature": 0.0, "n": 1, "stream_options": {"include_usage": True}}, True),
    ({}, False),  # vLLM's default sampling (the model's generation config) may not be greedy
    ({"temperature": 0.7}, False),
    ({"temperature": 0, "stop": ["\n"]}, False),
    ({"temperature": 0, "n": 2}, False),
    ({"temperature": 0, "logprobs": True}, False),
    ({"temperature": 0, "tools": [{"type": "function", "function": {"name": "f"}}]}, False),
    ({"temperature": 0, "response_format": {"type": "json_object"}}, False),
    ({"temperature": 0, "stream_options": {"continuous_usage_stats": True}}, False),
    ({"temperature": True}, False),
])
def test_which_requests_prefill_s_token_may_lead(body: dict, relayed: bool) -> None:
    assert greedy_single(body) is relayed




# ---------------------------------------------------------------- the observer
def context(clock: ManualClock, endpoint: str = "/v1/chat/completions") -> TurnContext:
    record = p.TurnRecord(turn=1, outcome="fired", started_unix_s=clock.now_unix_s())
    decode = Backend("decode-0", "decode", "http://d", None, None)  # type: ignore[arg-type]
    return TurnContext(conv=None, decode=decode, slot=decode.slot(),
                       upstream=None,  # type: ignore[arg-type]
                       record=record, headers={}, handle_key=None, wants_token_ids=False,
                       decode_sent_unix_s=clock.now_unix_s() + 0.5, api=api_for(endpoint))


def test_the_first_decode_token_sets_ttft_once_and_ends_the_prompt_backlog() -> None:
    clock = ManualClock(100.0)
    ctx = context(clock)
    ctx.local_work = ctx.decode.prompt_work(40)
    observer = StreamObserver(ctx, clock, RouterMetrics())
    observer.chunk({"prompt_token_ids": [1, 2, 3], "choices": [{"delta": {"role": "assistant"}}]})
    assert ctx.record.ttft_s is None and ctx.decode.prompt_backlog_tokens == 40
    clock.advance(2.0)
    observer.chunk({"choices": [{"delta": {"content": "a"}, "token_ids": [5]}]})
    clock.advance(1.0)
    observer.chunk({"choices": [{"delta": {"content": "b"}, "token_ids": [6]}]})
    assert ctx.record.ttft_s == 2.0 and ctx.record.timings.decode_first_token_s == 1.5
    assert ctx.decode.prompt_backlog_tokens == 0
    assert (ctx.prompt_ids, ctx.output_ids) == ([1, 2, 3], [5, 6])
    observer.complete()
    assert ctx.record.output_tokens == 2 and ctx.record.latency_s == 3.0


def test_prefill_s_token_is_the_ttft_and_decode_s_only_its_own_timing() -> None:
    clock = ManualClock(100.0)
    ctx = context(clock)
    observer = StreamObserver(ctx, clock, RouterMetrics())
    clock.advance(0.25)
    observer.prefill_token_sent()
    clock.advance(1.0)
    observer.chunk({"choices": [{"delta": {"content": "a"}, "token_ids": [5]}]})
    assert ctx.record.ttft_s == 0.25 and ctx.record.timings.decode_first_token_s == 0.75


def test_a_named_event_stream_s_first_delta_is_its_first_token() -> None:
    clock = ManualClock(100.0)
    ctx = context(clock, "/v1/responses")
    observer = StreamObserver(ctx, clock, RouterMetrics())
    observer.event(Frame("response.created", ("event: response.created", "data: {}")))
    assert ctx.record.ttft_s is None
    clock.advance(1.0)
    observer.event(Frame("response.output_text.delta",
                         ("event: response.output_text.delta", 'data: {"delta":"a"}')))
    assert ctx.record.ttft_s == 1.0
