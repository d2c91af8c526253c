"""`stack up`'s warm-up: turns until one reuses KV, then the session is released; never fatal."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from kvtether.stack._warmup import warm_up


def _router(outcomes: list[str], seen: list[tuple[str, str, dict]],
            tokenizer: tuple[str, ...] = ("router",)) -> httpx.MockTransport:
    """Turn i has a 10*i-token prompt; "fired" reads 100 tokens, "fired:local" only 5 (what
    prefill's own prefix cache held: it proves no read of decode's KV). ``/health`` says
    ``tokenizer`` in turn, then its last state."""
    script = iter(outcomes)
    states = list(tokenizer)

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        seen.append((request.method, request.url.path, body))
        if request.method == "GET":
            return httpx.Response(200, json={"status": "ok", "tokenizer": (
                states.pop(0) if len(states) > 1 else states[0])})
        if request.method == "DELETE":
            return httpx.Response(200, json={})
        outcome = next(script)
        if outcome == "503":
            return httpx.Response(503, json={"error": {"message": "down"}})
        reused = {"fired": 100, "fired:local": 5}.get(outcome, 0)
        turn = sum(1 for m, _, _ in seen if m == "POST")
        return httpx.Response(
            200, headers={"X-KVTether-Reuse": outcome.split(":local")[0],
                          "X-KVTether-Reused-Tokens": str(reused),
                          "X-KVTether-Prompt-Tokens": str(10 * turn)},
            json={"choices": [{"message": {"role": "assistant", "content": "ok"}}]},
        )

    return httpx.MockTransport(handle)


def test_stops_at_the_first_fired_turn_and_releases_the_session() -> None:
    seen: list[tuple[str, str, dict]] = []
    report = warm_up("http://router", "tiny", transport=_router(
        ["miss:first_turn", "miss:transfer_failed", "fired", "fired"], seen))
    assert report.fired and report.outcomes == ["miss:first_turn", "miss:transfer_failed", "fired"]
    posts = [b for m, _, b in seen if m == "POST"]
    assert [len(b["messages"]) for b in posts] == [1, 3, 5]  # each turn extends the last one
    assert seen[-1][0] == "DELETE" and seen[-1][1].startswith("/v1/sessions/kvtether-warmup-")


def test_waits_for_the_routers_own_tokenizer_before_its_turns() -> None:
    seen: list[tuple[str, str, dict]] = []
    report = warm_up("http://router", "tiny", transport=_router(
        ["miss:first_turn", "fired"], seen, tokenizer=("loading", "loading", "router")))
    assert report.fired and report.tokenizer == "router"
    assert [m for m, _, _ in seen][:4] == ["GET", "GET", "GET", "POST"]


def test_a_turn_served_from_prefill_cache_alone_does_not_count() -> None:
    seen: list[tuple[str, str, dict]] = []
    report = warm_up("http://router", "tiny", transport=_router(
        ["miss:first_turn", "fired:local", "fired", "fired"], seen))
    assert report.fired and report.outcomes == ["miss:first_turn", "fired", "fired"]
    assert [b["max_tokens"] for m, _, b in seen if m == "POST"] == [24] * 3


def test_gives_up_after_max_turns() -> None:
    seen: list[tuple[str, str, dict]] = []
    report = warm_up("http://router", "tiny", max_turns=2,
                     transport=_router(["miss:first_turn"] + ["miss:transfer_failed"] * 3, seen))
    assert not report.fired and len(report.outcomes) == 2


def test_a_failing_router_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[tuple[str, str, dict]] = []
    with caplog.at_level(logging.WARNING, logger="kvtether.stack._warmup"):
        report = warm_up("http://router", "tiny", conversations=2,
                         transport=_router(["503", "503"], seen))
    assert not report.fired and report.conversations == 2
    assert "503" in caplog.text
    assert [m for m, _, _ in seen].count("DELETE") == 2


def test_sends_the_stacks_api_key_on_every_call() -> None:
    auth: list[str | None] = []
    inner = _router(["miss:first_turn", "fired"], [])

    def handle(request: httpx.Request) -> httpx.Response:
        auth.append(request.headers.get("authorization"))
        return inner.handle_request(request)

    report = warm_up("http://router", "tiny", api_key="k1", transport=httpx.MockTransport(handle))
    assert report.fired and auth == ["Bearer k1"] * 4  # /health, two turns and the release


def test_stack_warm_up_uses_the_first_key_of_the_key_file(tmp_path) -> None:  # noqa: ANN001
    from kvtether.stack.launcher import _client_api_key
    from kvtether.stack.settings import StackSettings

    keys = tmp_path / "keys"
    keys.write_text("ops first-key\nbob second-key\n")
    assert _client_api_key(StackSettings(api_key_file=keys)) == "first-key"
    assert _client_api_key(StackSettings(api_key_file=keys, api_key="solo")) == "solo"
    assert _client_api_key(StackSettings()) is None
