"""Bad input everywhere: random headers, ids, hints and bodies on every router endpoint.

Whatever arrives, the router answers 2xx or 4xx (never 5xx: the fake instances behind it are
healthy), every 4xx is OpenAI-style JSON that names nothing internal, and ``/health`` still
answers afterwards. One router (with API keys, a control channel and its secret) serves every
example of a test, so state left by one example meets the next.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvtether import protocol as p
from tests.support.router_harness import SYSTEM_PROMPT, Harness, make_router

KEY = "fuzz-key-alice"
OTHER_KEY = "fuzz-key-bob"
FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
# What an internal detail looks like: a traceback, a source path, an exception's repr.
_INTERNAL = re.compile(
    r"Traceback|File \"|\.py\b|site-packages|/src/kvtether|\b[A-Z]\w*(Error|Exception)\(|"
    r"object at 0x"
)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[asyncio.AbstractEventLoop,
                                                                     Harness]]:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"alice {KEY}\nbob {OTHER_KEY}\n")
    loop = asyncio.new_event_loop()
    router = make_router(control=True, api_key_file=keys, control_secret="cs",
                         fake={"control_secret": "cs"}, max_request_body_bytes=64 * 1024)
    h = loop.run_until_complete(router.__aenter__())
    try:
        yield loop, h
    finally:
        loop.run_until_complete(router.__aexit__(None, None, None))
        loop.close()


# --- strategies ------------------------------------------------------------------------------
_header_bytes = st.binary(max_size=300).map(
    lambda b: b.replace(b"\r", b"").replace(b"\n", b"").replace(b"\0", b""))
_text = st.text(max_size=300)
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=12,
)
_ids = st.one_of(_text, st.text(min_size=200, max_size=600),
                 st.sampled_from(["c1", "c2", "", " ", "a/b", "%2F", "..", "x" * 300]))
_good_ids = st.sampled_from(["c1", "c2", "c3", "shared"]).map(str.encode)
_good_hints = st.fixed_dictionaries({}, optional={
    "next_prompt_tokens": st.integers(0, 5000), "next_turn_gap_s": st.floats(0, 100),
    "phase": st.sampled_from(["thinking", "tool_running", "idle", "final"]),
}).map(lambda d: json.dumps(d).encode())


_hints = st.one_of(
    _header_bytes,
    _json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({}, optional={
        "next_prompt_tokens": _json_values, "next_turn_gap_s": _json_values,
        "phase": st.sampled_from(["thinking", "tool_running", "idle", "final", "nope"]),
    }).map(lambda d: json.dumps(d).encode()),
)
_bad_auth = st.one_of(
    st.sampled_from(["Bearer wrong", "Bearer", f"Basic {KEY}", KEY, "", f"Bearer {KEY}x",
                     f"bearer  {KEY} "]).map(str.encode),
    _header_bytes,
)


@st.composite
def headers(draw: st.DrawFn) -> list[tuple[bytes, bytes]]:
    out: list[tuple[bytes, bytes]] = []
    # Mostly a valid key (of one of two tenants), so the requests get past authentication.
    auth = draw(st.sampled_from(["alice"] * 5 + ["bob"] * 2 + ["bad", "none"]))
    if auth in ("alice", "bob"):
        out.append((b"authorization", f"Bearer {KEY if auth == 'alice' else OTHER_KEY}".encode()))
    elif auth == "bad":
        out.append((b"authorization", draw(_bad_auth)))
    for name, good, bad in [
        (p.HEADER_CONVERSATION_ID, _good_ids, _ids.map(lambda s: s.encode("utf-8", "replace"))),
        ("X-Session-Id", _good_ids, _header_bytes),
        (p.HEADER_HINTS, _good_hints, _hints),
        ("Content-Type", st.just(b"application/json"),
         st.sampled_from([b"text/plain", b"", b"\xff"])),
    ]:
        which = draw(st.sampled_from(["absent", "absent", "good", "good", "bad"]))
        if which != "absent":
            out.append((name.lower().encode(), draw(good if which == "good" else bad)))
    return out


_messages = st.one_of(
    _json_values,
    st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"])},
        optional={"content": _json_values | _text}), max_size=4),
    st.just([{"role": "user", "content": "hello there"}]),
)
_completion_body = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["tiny", "tiny", "other"]) | _json_values,
    "messages": _messages,
    "prompt": _text | st.lists(st.integers(-5, 10**6), max_size=40) | _json_values,
    "max_tokens": st.integers(-3, 8) | _json_values,
    "stream": st.booleans() | _json_values,
    "stream_options": _json_values,
    "conversation_id": _ids | _json_values,
    "kvtether_hints": _json_values,
    "kv_transfer_params": _json_values,
    "temperature": _json_values,
    "n": st.integers(-1, 2),
})
# Valid but for a few random fields: these reach the turn runner, leases and the relay.
_plausible_body = st.fixed_dictionaries(
    {"model": st.just("tiny"),
     "messages": st.lists(st.sampled_from(["run the tests", "read the file", "ok"]),
                          min_size=1, max_size=3).map(
         lambda said: [{"role": "system", "content": SYSTEM_PROMPT}]
         + [{"role": "user", "content": x} for x in said]),
     "prompt": st.just("the agent calls a tool " * 8),
     "max_tokens": st.integers(1, 4)},
    optional={"stream": st.booleans(), "conversation_id": _good_ids.map(bytes.decode),
              "kvtether_hints": _good_hints.map(json.loads),
              "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
              "kv_transfer_params": _json_values, "return_token_ids": st.booleans()},
)
_bodies = st.one_of(
    st.none(), st.binary(max_size=500), _json_values.map(lambda v: json.dumps(v).encode()),
    _completion_body.map(lambda b: json.dumps(b).encode()),
    _plausible_body.map(lambda b: json.dumps(b).encode()),
    _plausible_body.map(lambda b: json.dumps(b).encode()),
)


_items = st.one_of(
    _json_values,
    st.lists(st.one_of(
        _json_values,
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"])},
                              optional={"content": _json_values | _text,
                                        "type": st.sampled_from(["message", "function_call",
                                                                 "nope"]) | _json_values}),
    ), max_size=4),
    st.just([{"role": "user", "content": "hello there"}]),
)
_responses_body = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["tiny", "tiny", "other"]) | _json_values,
    "input": _text | _items,
    "instructions": _text | _json_values,
    "max_output_tokens": st.integers(-3, 8) | _json_values,
    "stream": st.booleans() | _json_values,
    "store": st.booleans() | _json_values,
    "previous_response_id": st.none() | _text | _json_values,
    "background": st.booleans() | _json_values,
    "conversation_id": _ids | _json_values,
    "kv_transfer_params": _json_values,
    "tools": _json_values,
})
_blocks = st.lists(st.one_of(
    _json_values,
    st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_use", "tool_result", "image",
                                                    "nope"]) | _json_values},
                          optional={"text": _text | _json_values, "id": _text,
                                    "content": _json_values, "input": _json_values}),
), max_size=3)
_messages_body = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["tiny", "tiny", "other"]) | _json_values,
    "messages": st.one_of(_json_values, st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "x"]) | _json_values},
        optional={"content": _text | _blocks | _json_values}), max_size=4)),
    "system": _text | _blocks | _json_values,
    "max_tokens": st.integers(-3, 8) | _json_values,
    "stream": st.booleans() | _json_values,
    "stop_sequences": _json_values,
    "tools": _json_values,
    "thinking": _json_values,
    "kv_transfer_params": _json_values,
})
_plausible_messages = st.fixed_dictionaries(
    {"model": st.just("tiny"), "max_tokens": st.integers(1, 4),
     "messages": st.lists(st.sampled_from(["run the tests", "read the file", "ok"]),
                          min_size=1, max_size=3).map(
         lambda said: [{"role": "user", "content": x} for x in said])},
    optional={"stream": st.booleans(), "system": st.just(SYSTEM_PROMPT)},
)
_api_bodies = st.one_of(
    st.none(), st.binary(max_size=300), _json_values.map(lambda v: json.dumps(v).encode()),
    _responses_body.map(lambda b: json.dumps(b).encode()),
    _messages_body.map(lambda b: json.dumps(b).encode()),
    _plausible_messages.map(lambda b: json.dumps(b).encode()),
)


# --- checks ----------------------------------------------------------------------------------
def check(r: httpx.Response, sent: list[str], *, anthropic: bool = False) -> None:
    event(f"HTTP {r.status_code}")
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert r.headers["content-type"].startswith("application/json"), r.headers
        body = r.json()
        if anthropic:  # Anthropic's shape: {"type": "error", "error": {"type", "message"}}
            assert body["type"] == "error", body
        error = body["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str) and (anthropic or "code" in error)
        message = error["message"]
        for echoed in sent:  # a client's own id, echoed back, is not an internal detail
            if echoed:
                message = message.replace(repr(echoed), "").replace(echoed, "")
        assert not _INTERNAL.search(message), message


def alive(loop: asyncio.AbstractEventLoop, h: Harness) -> None:
    health = loop.run_until_complete(h.client.get("/health"))
    assert health.status_code == 200, health.text


def run(loop: asyncio.AbstractEventLoop, h: Harness, method: str, path: str,
        hdrs: list[tuple[bytes, bytes]], body: bytes | None) -> httpx.Response:
    # Bytes, as sent: no encoding, no validation on the client's side.
    request = h.client.build_request(method, path, content=body, headers=hdrs)
    return loop.run_until_complete(h.client.send(request))


# --- the fuzz --------------------------------------------------------------------------------
@FUZZ
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
       hdrs=headers(), body=_bodies)
def test_completions_endpoints(live: Any, path: str, hdrs: list, body: bytes | None) -> None:
    loop, h = live
    r = run(loop, h, "POST", path, hdrs, body)
    ids = [v.decode("utf-8", "replace") for k, v in hdrs if k == b"x-conversation-id"]
    check(r, ids)
    alive(loop, h)


@FUZZ
@given(path=st.sampled_from(["/v1/responses", "/v1/messages"]), hdrs=headers(), body=_api_bodies,
       agent=st.sampled_from([None, "explore", "a b", ""]))
def test_responses_and_messages_endpoints(live: Any, path: str, hdrs: list,
                                          body: bytes | None, agent: str | None) -> None:
    loop, h = live
    if agent is not None:
        hdrs = [*hdrs, (b"x-claude-code-session-id", b"cc-fuzz"),
                (b"x-claude-code-agent-id", agent.encode())]
    r = run(loop, h, "POST", path, hdrs, body)
    ids = [v.decode("utf-8", "replace") for k, v in hdrs
           if k in (b"x-conversation-id", b"x-claude-code-agent-id")]
    check(r, ids, anthropic=path == "/v1/messages")
    alive(loop, h)


@FUZZ
@given(method=st.sampled_from(["GET", "POST", "DELETE", "PUT", "PATCH"]),
       route=st.sampled_from(["/v1/sessions/{}", "/v1/sessions/{}/heartbeat", "/v1/models",
                              "/health", "/metrics", "/v1/{}", "/{}"]),
       cid=_ids, raw_path=st.booleans(), hdrs=headers(), body=_bodies)
def test_session_api_and_the_other_endpoints(
    live: Any, method: str, route: str, cid: str, raw_path: bool, hdrs: list,
    body: bytes | None,
) -> None:
    loop, h = live
    if method in ("GET", "DELETE") and body is not None and len(body) % 2:
        body = None
    segment = quote(cid, safe="") if not raw_path else quote(cid, safe="/:@!$&'()*+,;=")
    r = run(loop, h, method, route.format(segment), hdrs, body)
    check(r, [cid])
    alive(loop, h)


def test_the_fuzzed_router_still_serves_a_real_conversation(live: Any) -> None:
    loop, h = live

    async def conversation() -> list[str]:
        auth = {"Authorization": f"Bearer {KEY}"}
        history = [{"role": "system", "content": SYSTEM_PROMPT},
                   {"role": "user", "content": "after the fuzz"}]
        outcomes = []
        for _ in range(2):
            r = await h.client.post("/v1/chat/completions", headers={
                **auth, p.HEADER_CONVERSATION_ID: "post-fuzz"},
                json={"model": "tiny", "messages": history})
            assert r.status_code == 200, r.text
            outcomes.append(r.headers[p.HEADER_REUSE])
            history += [{"role": "assistant", "content": r.json()["choices"][0]["message"][
                "content"]}, {"role": "user", "content": "more"}]
        return outcomes

    assert loop.run_until_complete(conversation()) == ["miss:first_turn", "fired"]
    h.assert_kv_correct()


def test_the_fuzz_keys_file_is_not_readable_in_errors(tmp_path: Path) -> None:
    # A key-file problem names the line, never the key.
    from kvtether.errors import ConfigError
    from kvtether.router.access import read_key_file

    bad = tmp_path / "k"
    bad.write_text(f"alice {KEY}\nbob {KEY}\n")
    with pytest.raises(ConfigError) as exc:
        read_key_file(bad)
    assert KEY not in str(exc.value)
