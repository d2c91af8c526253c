"""Concurrent turns: one conversation's turns are serialised; many conversations run at once."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvtether import protocol as p
from tests.support.router_harness import make_router


@pytest.mark.parametrize("stream", [False, True])
async def test_same_conversation_turns_are_serialised(stream: bool) -> None:
    # One sequence per conversation (branches: tests/router/test_branches.py).
    async with make_router(control=True, fake={"delay_s": 0.05}, max_branches=1) as h:
        a = h.conversation("dup")
        first = await a.say("hello")
        messages = a.messages + [{"role": "user", "content": "go"}]
        t1, t2 = await asyncio.gather(
            h.chat(list(messages), "dup", stream=stream),
            h.chat(list(messages), "dup", stream=stream),
        )
        assert t1.status == t2.status == 200
        assert h.d.max_inflight == 1  # never two decode legs of one conversation at once
        assert h.p.max_inflight == 1
        assert sorted([t1.headers[p.HEADER_TURN], t2.headers[p.HEADER_TURN]]) == ["2", "3"]
        by_turn = {t.headers[p.HEADER_TURN]: t for t in (t1, t2)}
        # The first one extends turn 1; the second repeats the same prompt, so only its
        # whole matching blocks may be read: all it could reuse, so it fired too.
        assert by_turn["2"].outcome == "fired"
        assert by_turn["3"].outcome == "fired"
        salvaged = int(by_turn["3"].headers[p.HEADER_SALVAGED_TOKENS])
        assert 0 < salvaged == by_turn["3"].reused
        assert int(by_turn["3"].headers[p.HEADER_REUSABLE_TOKENS]) - salvaged < 16
        assert first.status == 200
        status = (await h.client.get("/v1/sessions/dup")).json()
        assert [t["turn"] for t in status["turns"]] == [1, 2, 3]
        h.assert_kv_correct()


async def test_many_conversations_concurrently() -> None:
    async with make_router(control=True, n_prefill=2, n_decode=2,
                           fake={"delay_s": 0.01}) as h:
        agents = [h.conversation(f"conv-{i}") for i in range(50)]
        for round_ in range(2):
            turns = await asyncio.gather(*(
                a.say(f"round {round_}", stream=(i % 2 == 1)) for i, a in enumerate(agents)
            ))
            want = "miss:first_turn" if round_ == 0 else "fired"
            assert [t.outcome for t in turns] == [want] * 50
        assert all(len(d.requests) > 0 for d in h.decode)
        for a in agents:  # each stayed on one decode instance
            assert len({t.headers[p.HEADER_DECODE_INSTANCE] for t in a.turns}) == 1
        assert h.d.max_inflight > 1  # they did run concurrently
        assert (await h.client.get("/health")).json()["conversations"] == 50
        h.assert_kv_correct()


async def _raw_call_then_disconnect(app, path: str, body: dict, headers: dict[str, str], *,
                                    send_yields: bool = False) -> list:
    """Drive the ASGI app like a server whose client hung up right after sending the request
    (e.g. a client timeout during a long prefill)."""
    pending = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict:
        if pending:
            return pending.pop(0)
        return {"type": "http.disconnect"}

    sent: list = []

    async def send(message: dict) -> None:
        sent.append(message)
        if send_yields:  # a server whose socket write waits (back-pressure)
            await asyncio.sleep(0)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 50000), "server": ("router", 80),
        "headers": [(b"content-type", b"application/json"),
                    *((k.lower().encode(), v.encode()) for k, v in headers.items())],
    }
    await app(scope, receive, send)
    return sent


@pytest.mark.parametrize("send_yields", [False, True], ids=["disconnect-mid-relay",
                                                            "disconnect-before-start"])
async def test_client_disconnect_from_stream_does_not_wedge_conversation(
    send_yields: bool,
) -> None:
    async with make_router(control=True) as h:
        a = h.conversation("wedge")
        await a.say("one")
        body = {"model": "tiny", "stream": True,
                "messages": a.messages + [{"role": "user", "content": "two"}]}
        await _raw_call_then_disconnect(h.app, "/v1/chat/completions", body,
                                        {p.HEADER_CONVERSATION_ID: "wedge"},
                                        send_yields=send_yields)
        # The request is over: nothing may still hold the conversation.
        assert not h.app.state.store.get("wedge").lock.locked()
        t = await asyncio.wait_for(a.say("two, retried"), timeout=5.0)
        assert t.status == 200


async def test_client_disconnect_non_streamed_turn_is_harmless(hc) -> None:
    a = hc.conversation("nowedge")
    await a.say("one")
    body = {"model": "tiny", "messages": a.messages + [{"role": "user", "content": "two"}]}
    await _raw_call_then_disconnect(hc.app, "/v1/chat/completions", body,
                                    {p.HEADER_CONVERSATION_ID: "nowedge"})
    assert not hc.app.state.store.get("nowedge").lock.locked()
    t = await asyncio.wait_for(a.say("two, retried"), timeout=5.0)
    assert t.status == 200


async def test_a_heartbeat_whose_client_hangs_up_mid_body_is_not_an_error(
    hc, caplog: pytest.LogCaptureFixture,
) -> None:
    # A session stops its heartbeat when the tool ends, possibly mid-request.
    a = hc.conversation("beat")
    await a.say("one")
    path = "/v1/sessions/beat/heartbeat"
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 50000), "server": ("router", 80),
        "headers": [(b"content-type", b"application/json")],
    }

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    sent: list = []

    async def send(message: dict) -> None:
        sent.append(message)

    with caplog.at_level("WARNING", logger="kvtether"):
        await hc.app(scope, receive, send)
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert sent[0]["status"] == 400
    assert (await hc.client.post(path, json={})).status_code == 200  # the lease is fine
