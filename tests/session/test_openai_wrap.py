"""The OpenAI SDK drop-in: requests are tagged, responses are accounted, the API is unchanged."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from kvtether.protocol import (
    HEADER_CONVERSATION_ID,
    HEADER_HINTS,
    HEADER_PARENT_CONVERSATION_ID,
    Phase,
    parse_hints_header,
)
from kvtether.session import AsyncSession, Session
from tests.support.fake_router import FAST, FakeRouter

SYSTEM = {"role": "system", "content": "You are a coding agent."}


def ask(client: OpenAI, messages: list[Any], **kwargs: Any) -> Any:
    return client.chat.completions.create(model="fake", messages=messages, **kwargs)


def test_each_request_carries_the_conversation_id_and_valid_hints(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    messages: list[Any] = [SYSTEM, {"role": "user", "content": "hi"}]
    reply = ask(client, messages)
    assert reply.choices[0].message.content == "ok 0"  # the SDK's normal return value
    messages += [reply.choices[0].message, {"role": "user", "content": "and then?"}]
    ask(client, messages)

    sent = router.requests_to("/chat/completions")
    assert [r.headers[HEADER_CONVERSATION_ID.lower()] for r in sent] == [
        session.conversation_id
    ] * 2
    hints = [parse_hints_header(r.headers[HEADER_HINTS.lower()]) for r in sent]
    assert all(h.next_prompt_tokens and h.next_turn_gap_s is not None for h in hints)
    assert hints[0].phase is Phase.IDLE  # no tools offered: a person answers next


def test_turn_records_follow_the_router_headers_and_usage(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    messages: list[Any] = [SYSTEM, {"role": "user", "content": "hi"}]
    first = ask(client, messages)
    messages += [first.choices[0].message, {"role": "user", "content": "more"}]
    second = ask(client, messages)

    t1, t2 = session.turns
    assert (t1.turn, t1.outcome, t1.reused_tokens) == (1, "miss:first_turn", 0)
    assert (t2.turn, t2.outcome, t2.fired) == (2, "fired", True)
    assert t2.reused_tokens == t1.prompt_tokens + t1.output_tokens
    assert (t1.reusable_tokens, t2.reusable_tokens) == (0, t2.reused_tokens)
    assert (t1.eligible, t2.eligible) == (False, True)
    assert t2.prompt_tokens == second.usage.prompt_tokens  # type: ignore[union-attr]
    assert t1.output_tokens == first.usage.completion_tokens  # type: ignore[union-attr]
    assert t2.router_turn == 2 and t2.gap_before_s is not None and t2.latency_s > 0
    assert t2.prefix_status == "extends"


def test_stream_without_usage_request_hides_the_injected_usage_chunk(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    router.replies.append({"content": "streamed answer"})
    chunks = list(ask(client, [SYSTEM, {"role": "user", "content": "hi"}], stream=True))

    # Caller code written for plain streams keeps working: every chunk has a choice.
    assert all(chunk.choices for chunk in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "streamed answer"
    body = router.requests_to("/chat/completions")[0].body
    assert body["stream_options"] == {"include_usage": True}
    turn = session.turns[0]
    assert turn.stream and turn.completed and turn.output_tokens > 0 and turn.prompt_tokens > 0
    assert turn.ttft_s is not None and 0 < turn.ttft_s <= turn.latency_s


def test_stream_with_caller_requested_usage_passes_it_through(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    chunks = list(
        ask(
            client,
            [SYSTEM, {"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )

    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert session.turns[0].output_tokens == chunks[-1].usage.completion_tokens


def test_stream_options_without_include_usage_are_merged(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    chunks = list(
        ask(
            client,
            [SYSTEM, {"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": False},
        )
    )
    assert all(chunk.choices for chunk in chunks)
    assert router.requests_to("/chat/completions")[0].body["stream_options"] == {
        "include_usage": True
    }
    assert session.turns[0].output_tokens > 0


def test_a_stream_the_caller_abandons_is_recorded_as_incomplete(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    router.replies.append({"content": "a fairly long answer that the caller stops reading"})
    stream = ask(client, [SYSTEM, {"role": "user", "content": "hi"}], stream=True)
    next(iter(stream))
    stream.close()
    (turn,) = session.turns
    assert not turn.completed and turn.outcome == "miss:first_turn"


def test_completions_endpoint_streamed_and_not(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    router.replies.extend([{"content": " world"}, {"content": " again"}])
    done = client.completions.create(model="fake", prompt="hello")
    chunks = list(
        client.completions.create(
            model="fake", prompt="hello" + done.choices[0].text + "!", stream=True
        )
    )
    assert all(c.choices for c in chunks)
    t1, t2 = session.turns
    assert (t1.endpoint, t1.outcome, t2.outcome) == ("completions", "miss:first_turn", "fired")
    assert t2.prefix_status == "extends" and t2.output_tokens > 0


def test_other_endpoints_pass_through_untouched(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    assert [m.id for m in client.models.list()] == ["fake"]
    (request,) = router.received
    assert HEADER_CONVERSATION_ID.lower() not in request.headers
    assert session.turns == []


def test_error_status_is_the_sdks_error_and_a_recorded_turn(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    import openai

    router.chat_status = 400
    with pytest.raises(openai.BadRequestError):
        ask(client, [SYSTEM, {"role": "user", "content": "hi"}])
    (turn,) = session.turns
    assert turn.outcome == "error" and turn.http_status == 400 and "scripted" in (turn.error or "")


def test_sdk_retries_replace_the_failed_attempt(router: FakeRouter, session: Session) -> None:
    base = OpenAI(base_url=router.url + "/v1", api_key="t", max_retries=1)
    client = session.wrap(base)
    router.chat_status = 500
    ask(client, [SYSTEM, {"role": "user", "content": "hi"}])
    (turn,) = session.turns
    assert (turn.turn, turn.attempts, turn.outcome) == (1, 2, "miss:first_turn")
    base.close()


def test_plain_vllm_without_kvtether_headers_still_works(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    router.send_headers = False
    ask(client, [SYSTEM, {"role": "user", "content": "hi"}])
    with session.tool_call("grep"):
        pass
    session.close()
    assert session.turns[0].outcome == "unknown"
    # No lease was ever created, so there is nothing to renew or release.
    assert router.requests_to("/heartbeat") == [] and len(router.received) == 1


def test_the_callers_http_client_settings_still_apply(router: FakeRouter, session: Session) -> None:
    seen: list[str] = []
    http = httpx.Client(
        headers={"X-Trace": "t-1"}, event_hooks={"request": [lambda r: seen.append(r.url.path)]}
    )
    # openai 3 uses httpx2 but also accepts httpx clients: this also covers the httpx path.
    client = session.wrap(
        OpenAI(base_url=router.url + "/v1", api_key="t", http_client=http)  # type: ignore[arg-type]
    )
    ask(client, [SYSTEM, {"role": "user", "content": "hi"}])
    request = router.requests_to("/chat/completions")[0]
    assert request.headers["x-trace"] == "t-1" and seen == ["/v1/chat/completions"]
    assert session.turns[0].outcome == "miss:first_turn"
    http.close()


def test_wrapping_twice_does_not_count_twice(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    other = Session(router.url, settings=FAST)
    rewrapped = other.wrap(client)
    ask(rewrapped, [SYSTEM, {"role": "user", "content": "hi"}])
    assert session.turns == [] and len(other.turns) == 1
    assert router.received[0].headers["x-conversation-id"] == other.conversation_id
    other.close()


def test_base_url_defaults_to_the_wrapped_clients(router: FakeRouter, base_client: OpenAI) -> None:
    s = Session(settings=FAST)
    s.wrap(base_client)
    assert s.base_url == router.url


async def test_async_client_streams_and_records(
    router: FakeRouter, asession: AsyncSession, aclient: AsyncOpenAI
) -> None:
    router.replies.append({"content": "async answer", "reasoning": "think first"})
    messages: list[Any] = [SYSTEM, {"role": "user", "content": "hi"}]
    stream = await aclient.chat.completions.create(model="fake", messages=messages, stream=True)
    chunks = [chunk async for chunk in stream]
    assert all(chunk.choices for chunk in chunks)
    messages = asession.stable_history(
        [
            *messages,
            {"role": "assistant", "content": "async answer"},
            {"role": "user", "content": "ok"},
        ]
    )
    reply = await aclient.chat.completions.create(model="fake", messages=messages)
    assert reply.choices[0].message.content
    t1, t2 = asession.turns
    assert (t1.outcome, t2.outcome, t2.prefix_status) == ("miss:first_turn", "fired", "extends")
    assert t1.ttft_s is not None and t1.output_tokens > 0
    sent = router.requests_to("/chat/completions")[1].body["messages"][2]
    assert sent["reasoning_content"] == "think first"  # restored by stable_history


def test_hints_are_json_of_turn_hints(router: FakeRouter, session: Session, client: OpenAI) -> None:
    session.mark_final()
    ask(client, [SYSTEM, {"role": "user", "content": "bye"}])
    raw = router.requests_to("/chat/completions")[0].headers[HEADER_HINTS.lower()]
    assert json.loads(raw)["phase"] == "final"
    session.close()
    # A final turn leaves nothing retained, so close() has nothing to release.
    assert router.requests_to(session.conversation_id) == []


def test_a_subagent_session_is_its_own_conversation_linked_to_its_parent(
    router: FakeRouter, session: Session, base_client: OpenAI
) -> None:
    with session.subagent("explore") as sub:
        assert sub.conversation_id == f"{session.conversation_id}:agent:explore"
        assert sub.parent_id == session.conversation_id and session.parent_id is None
        client = sub.wrap(base_client)
        ask(client, [SYSTEM, {"role": "user", "content": "look around"}])
    (sent,) = router.requests_to("/chat/completions")
    assert sent.headers[HEADER_CONVERSATION_ID.lower()] == sub.conversation_id
    assert sent.headers[HEADER_PARENT_CONVERSATION_ID.lower()] == session.conversation_id


def test_a_bad_subagent_name_is_a_typed_error(session: Session) -> None:
    from kvtether.errors import KVTetherError

    with pytest.raises(KVTetherError, match="conversation_id"):
        session.subagent("has space")
