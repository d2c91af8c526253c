"""Faults on fake backends: what the client sees when an instance dies mid-answer, when a lease
is released while its turn is in flight, and that the OpenAI SDK retries the router's 5xx."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from kvtether import protocol as p
from tests.support.router_harness import make_router
from tests.support.waiting import await_for


async def test_decode_dying_mid_stream_ends_it_with_an_error_event_the_sdk_raises() -> None:
    async with make_router(control=True) as h:
        a = h.conversation("cut")
        await a.say("one")
        h.d.cut_streams_after = 400
        t = await h.chat(a.messages + [{"role": "user", "content": "two"}], "cut", stream=True)
        assert t.status == 200  # the status went out with the first chunk
        assert t.lines[-1].startswith("data: {") and "data: [DONE]" not in t.lines
        err = t.chunks[-1]["error"]  # type: ignore[index]
        assert err["code"] == "upstream_unavailable" and "retry" in err["message"]
        # The same through the OpenAI SDK: a clear APIError, not a silently short answer.
        sdk = openai.AsyncOpenAI(base_url="http://router/v1", api_key="-",
                                 http_client=h.client, max_retries=0)
        stream = await sdk.chat.completions.create(
            model="tiny", messages=a.messages + [{"role": "user", "content": "two"}],
            stream=True, extra_headers={p.HEADER_CONVERSATION_ID: "cut"})
        with pytest.raises(openai.APIError, match="failed while streaming"):
            async for _ in stream:
                pass
        h.d.cut_streams_after = None
        assert (await a.say("three")).status == 200  # the next turn is served
        assert len(h.d.held_leases()) == 1  # only the last turn's KV is held
        h.assert_kv_correct()


async def test_release_while_the_turn_is_in_flight_frees_what_that_turn_retains() -> None:
    async with make_router(control=True) as h:
        a = h.conversation("rel")
        await a.say("one")
        release = h.d.hold_next()
        turn = asyncio.create_task(a.say("two"))
        await await_for(lambda: h.d.holding)
        deleted = await h.client.delete("/v1/sessions/rel")
        assert deleted.status_code == 200
        release.set()
        t = await turn
        assert t.status == 200  # the turn in flight is answered
        assert h.d.held_leases() == []  # and its KV freed as soon as it settled
        st = (await h.client.get("/v1/sessions/rel")).json()
        assert st["lease_state"] == "released" and st["retained_tokens"] == 0
        assert (await a.say("three")).outcome == "miss:released"
        assert len(h.d.held_leases()) == 1  # a later turn retains again
        h.assert_kv_correct()


@pytest.mark.parametrize("down", ["prefill", "decode"])
async def test_the_openai_sdk_retries_a_dead_instance_answer(down: str) -> None:
    async with make_router(control=True) as h:
        attempts = 0

        async def count(request: httpx.Request) -> None:
            nonlocal attempts
            attempts += request.url.path.endswith("/chat/completions")

        client = httpx.AsyncClient(transport=h.client._transport, base_url="http://router",
                                   event_hooks={"request": [count]})
        sdk = openai.AsyncOpenAI(base_url="http://router/v1", api_key="-", http_client=client,
                                 max_retries=2)
        (h.p if down == "prefill" else h.d).down = True
        with pytest.raises(openai.APIStatusError) as info:
            await sdk.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}],
                extra_headers={p.HEADER_CONVERSATION_ID: "retry"})
        assert info.value.status_code in (502, 503)
        assert info.value.body["code"] == "upstream_unavailable"  # type: ignore[index]
        assert attempts == 3  # the SDK retried it twice
        await client.aclose()


async def test_a_streamed_turn_whose_handle_fetch_fails_leaves_no_kv_on_decode() -> None:
    async with make_router(control=True) as h:
        a = h.conversation("nofetch")
        h.d.fail_control_next(500)  # the handle fetch after the stream
        t = await a.say("one", stream=True)
        assert t.status == 200
        assert h.d.held_leases() == []  # released by its key, not left to lapse
        assert (await a.say("two")).outcome == "miss:not_retained"


async def test_no_prefill_leg_while_every_decode_instance_is_down() -> None:
    async with make_router(control=True) as h:
        a = h.conversation("nodecode")
        await a.say("one")
        h.d.down = True
        first = await h.chat(a.messages + [{"role": "user", "content": "two"}], "nodecode")
        assert first.status == 503  # found out by the decode leg
        legs = len(h.p.requests)
        again = await h.chat(a.messages + [{"role": "user", "content": "two"}], "nodecode")
        assert again.status == 503 and again.body["error"]["code"] == "upstream_unavailable"
        assert len(h.p.requests) == legs  # prefill did not compute KV nobody could read
        h.d.down = False
        await h.client.get("/health")  # the health probe takes it back
        assert (await a.say("two")).status == 200


async def test_prefill_down_mid_conversation_keeps_decode_kv_for_the_retry() -> None:
    """A prefill instance that refuses the connection fails the turn (502) before the router
    decides about the conversation's KV: decode keeps it, and the retry reads it."""
    async with make_router(control=True) as h:
        a = h.conversation("pdown")
        await a.say("one")
        h.p.down = True
        t = await h.chat(a.messages + [{"role": "user", "content": "two"}], "pdown")
        assert t.status == 502 and t.body["error"]["code"] == "upstream_unavailable"
        assert len(h.d.held_leases()) == 1 and h.d.releases == []
        h.p.down = False
        await h.client.get("/health")  # the health probe takes it back
        assert (await a.say("two")).outcome == "fired"
        h.assert_kv_correct()


def _down_after_tokenize(h, instances) -> list[str]:  # noqa: ANN001
    """Once one of ``instances`` has answered a /tokenize call, all of them refuse every
    connection: the turn's prefill leg is the first request refused (they died between the
    two). Returns the hosts that tokenized before going down."""
    inner = h.transport.handle_async_request
    tokenized: list[str] = []

    async def handle(request: httpx.Request) -> httpx.Response:
        r = await inner(request)
        if request.url.path == "/tokenize" and request.url.host in {i.host for i in instances}:
            tokenized.append(request.url.host)
            for inst in instances:
                inst.down = True
        return r

    h.transport.handle_async_request = handle
    return tokenized


async def test_a_prefill_instance_that_refuses_is_skipped_for_another() -> None:
    """2P: with one prefill instance gone, every turn goes to the other; nothing fails and the
    conversation's KV is still read from decode (any prefill instance can read it)."""
    async with make_router(control=True, n_prefill=2) as h:
        a = h.conversation("pskip")
        await a.say("one")
        h.prefill[0].down = True
        h.prefill[1].requests.clear()
        for text in ("two", "three", "four"):
            t = await a.say(text)
            assert t.outcome == "fired", t.outcome
        assert len(h.prefill[1].prefill_requests) == 3
        h.assert_kv_correct()


async def test_a_prefill_leg_refused_after_tokenize_goes_to_the_other_instance() -> None:
    async with make_router(control=True, n_prefill=2) as h:
        a = h.conversation("pleg")
        await a.say("one")
        tokenized = _down_after_tokenize(h, h.prefill[:1])
        h.prefill[0].requests.clear()
        h.prefill[1].requests.clear()
        # Picks alternate: prefill-0 tokenizes one of these turns and dies right after; that
        # turn's leg goes to prefill-1.
        for text in ("two", "three"):
            t = await a.say(text)
            assert t.outcome == "fired", t.outcome
        assert tokenized == [h.prefill[0].host]
        assert h.prefill[0].prefill_requests == []
        assert len(h.prefill[1].prefill_requests) == 2
        assert len(h.d.held_leases()) == 1  # each handle read once, the last turn's held
        h.assert_kv_correct()


async def test_every_prefill_instance_refusing_keeps_decode_kv_for_the_retry() -> None:
    async with make_router(control=True, n_prefill=2) as h:
        a = h.conversation("pall")
        await a.say("one")
        _down_after_tokenize(h, h.prefill)  # the handle is taken for the leg, then refused
        t = await h.chat(a.messages + [{"role": "user", "content": "two"}], "pall")
        assert t.status == 502 and t.body["error"]["code"] == "upstream_unavailable"
        assert "connection refused" in t.body["error"]["message"]
        assert len(h.d.held_leases()) == 1 and h.d.releases == []  # unread: still held
        h.transport.handle_async_request = type(h.transport).handle_async_request.__get__(
            h.transport)
        for inst in h.prefill:
            inst.down = False
        await h.client.get("/health")  # the health probe takes them back
        assert (await a.say("two")).outcome == "fired"
        h.assert_kv_correct()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prefill_leg_past_its_timeout_is_answered_by_decode_alone(stream: bool) -> None:
    async with make_router(control=True, prefill_leg_timeout_s=0.5) as h:
        a = h.conversation("frozen")
        assert (await a.say("one")).status == 200
        h.p.fail_next("hang")  # a frozen prefill worker: its leg never answers
        t = await a.say("two", stream=stream)
        assert t.status == 200  # answered, in bounded time, by decode recomputing the prompt
        assert t.outcome == "miss:transfer_failed"
        assert h.d.decode_requests[-1].body.get("kv_transfer_params") is None
        metrics = (await h.client.get("/metrics")).text
        assert "kvtether_prefill_leg_timeouts_total 1.0" in metrics
        rec = (await h.client.get("/v1/sessions/frozen")).json()["turns"][-1]
        assert rec["prefill_instance"] is None and rec["timings"]["prefill_leg_s"] == 0.5
        # Decode alone retained nothing; the next turn recomputes, the one after reads again.
        assert (await a.say("three")).outcome == "miss:not_retained"
        assert (await a.say("four")).outcome == "fired"
        h.assert_kv_correct()


async def test_a_decode_stream_that_goes_silent_ends_with_an_error_in_bounded_time() -> None:
    async with make_router(control=True, stream_idle_timeout_s=0.5) as h:
        a = h.conversation("silent")
        await a.say("one")
        h.d.freeze_streams_after_tokens = 2  # a frozen decode worker, mid-answer
        t = await h.chat(a.messages + [{"role": "user", "content": "two"}], "silent",
                         stream=True)
        # In-process fakes deliver a stream's head with its body: the silence shows before the
        # status went out (502) here, mid-stream (an error event, no [DONE]) on a real socket.
        if t.status == 200:
            assert t.chunks is not None and "data: [DONE]" not in t.lines
            assert t.chunks[-1]["error"]["code"] == "upstream_unavailable"
        else:
            assert t.status == 502 and t.body["error"]["code"] == "upstream_unavailable"
            assert "did not answer in time" in t.body["error"]["message"]
        h.d.freeze_streams_after_tokens = None
        assert (await a.say("three")).status == 200  # the router serves the next turn
        h.assert_kv_correct()
