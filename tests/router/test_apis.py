"""Responses and Messages on the router (fake instances): the requests it refuses and how, the
conversation it derives from coding agents' headers, and Anthropic's error shape.

The turns themselves, on real vLLM with the official SDKs: tests/integration/test_apis_real.py.
"""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from kvtether.router._errors import RouterHTTPError
from kvtether.router.apis import API_PATHS, api_for
from kvtether.router.identity import identify
from tests.support.router_harness import make_router


# --------------------------------------------------------------------------- identity
@pytest.mark.parametrize(("headers", "body", "expected"), [
    ({}, {}, (None, None, None)),
    ({"X-Conversation-Id": "c1", "X-Session-Id": "s1", "X-Claude-Code-Session-Id": "cc"},
     {"conversation_id": "b1"}, ("c1", None, "X-Conversation-Id")),
    ({"X-Conversation-Id": "c1", "X-Parent-Conversation-Id": "p1"}, {},
     ("c1", "p1", "X-Conversation-Id")),
    # OpenCode: x-session-id with x-parent-session-id.
    ({"x-session-id": "oc1", "x-parent-session-id": "oc0"}, {}, ("oc1", "oc0", "X-Session-Id")),
    ({"X-Claude-Code-Session-Id": "cc"}, {"conversation_id": "b1"},
     ("b1", None, "conversation_id")),
    # Claude Code: the main agent, a subagent, a subagent's subagent.
    ({"X-Claude-Code-Session-Id": "cc"}, {}, ("cc", None, "X-Claude-Code-Session-Id")),
    ({"X-Claude-Code-Session-Id": "cc", "X-Claude-Code-Agent-Id": "a1"}, {},
     ("cc:agent:a1", "cc", "X-Claude-Code-Agent-Id")),
    ({"X-Claude-Code-Session-Id": "cc", "X-Claude-Code-Agent-Id": "a2",
      "X-Claude-Code-Parent-Agent-Id": "a1"}, {},
     ("cc:agent:a2", "cc:agent:a1", "X-Claude-Code-Agent-Id")),
    # Codex: a thread id (newer builds) wins over the session id; a spawned thread's parent.
    ({"session_id": "s-old"}, {}, ("s-old", None, "session_id")),
    ({"session-id": "s-old", "thread-id": "t1", "x-codex-parent-thread-id": "t0"}, {},
     ("t1", "t0", "thread-id")),
])
def test_one_precedence_for_every_harness(headers, body, expected):
    who = identify(Headers(headers), body)
    assert (who.conversation_id, who.parent_id, who.source) == expected
    assert not who.end


@pytest.mark.parametrize(("value", "end"), [("true", True), ("1", True), ("False", False)])
def test_the_end_header(value, end):
    assert identify(Headers({"X-KVTether-End": value}), {}).end is end


@pytest.mark.parametrize("headers", [
    {"X-KVTether-End": "maybe"},
    {"X-Claude-Code-Session-Id": "has space"},
    {"X-Claude-Code-Session-Id": "cc", "X-Claude-Code-Agent-Id": "a/b"},
    {"thread-id": "x" * 300},
])
def test_a_bad_id_names_its_header(headers):
    with pytest.raises(RouterHTTPError) as err:
        identify(Headers(headers), {})
    assert err.value.status == 400
    assert err.value.param in headers


# --------------------------------------------------------------------------- request checks
@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
])
def test_responses_the_router_refuses(body, param):
    with pytest.raises(RouterHTTPError) as err:
        api_for("/v1/responses").check(body)
    assert (err.value.status, err.value.param) == (400, param)


def test_responses_store_is_accepted_and_the_stateless_subset_named():
    api_for("/v1/responses").check({"input": [{"role": "user", "content": "hi"}], "store": True})
    with pytest.raises(RouterHTTPError) as err:
        api_for("/v1/responses").check({"input": "hi", "previous_response_id": "r"})
    assert "stateless" in err.value.message and "input" in err.value.message


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": True, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
])
def test_messages_the_router_refuses(body, param):
    # Only what the prefill leg (max_tokens 1) would let through and decode then refuse.
    with pytest.raises(RouterHTTPError) as err:
        api_for("/v1/messages").check(body)
    assert (err.value.status, err.value.param) == (400, param)


# What Claude Code 2.1 sends (docs/coding-agents.md): vLLM 0.32 accepts all of it.
CLAUDE_CODE_BODY = {
    "model": "tiny", "max_tokens": 32000, "stream": True,
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"},
               {"type": "text", "text": "You are Claude Code.",
                "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "fix the bug"}]},
        {"role": "system", "content": "<env>cwd: /repo</env> Today's date is 2026-12-07."},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py",
             "cache_control": {"type": "ephemeral"}}]},
    ],
    "tools": [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}}],
    "thinking": {"type": "adaptive"}, "context_management": {"edits": []},
    "output_config": {"effort": "high"}, "metadata": {"user_id": "u"},
}


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_harness_bodies_pass_the_router_s_check(path):
    body = CLAUDE_CODE_BODY if path == "/v1/messages" else {
        "model": "tiny", "stream": True, "store": False, "input": [
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "You are Codex."}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "fix it"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None},
            {"type": "function_call", "call_id": "c1", "name": "shell",
             "arguments": "{\"command\": [\"ls\"]}"},
            {"type": "function_call_output", "call_id": "c1", "output": "a.py"}],
        "reasoning": {"effort": "medium"}, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "t-1", "client_metadata": {"x": "y"}, "tool_choice": "auto",
        "parallel_tool_calls": True,
    }
    api_for(path).check(body)  # no exception: vLLM decides
    leg = api_for(path).prefill_body(body)
    assert {k: v for k, v in leg.items() if k not in ("stream", "max_tokens",
                                                       "max_output_tokens")} == \
        {k: v for k, v in body.items() if k not in ("stream", "max_tokens")}


@pytest.mark.parametrize("path", API_PATHS)
def test_the_prefill_leg_asks_for_one_token_and_no_stream(path):
    api = api_for(path)
    leg = api.prefill_body({"stream": True, api.max_tokens_field: 50, "model": "m"})
    assert leg[api.max_tokens_field] == 1 and "stream" not in leg
    # Only the APIs whose answers carry token ids are asked for them.
    assert ("return_token_ids" in leg) is api.token_ids_in_answer


# --------------------------------------------------------------------------- error shapes
async def test_messages_errors_come_in_anthropics_shape(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("alice k-alice\n")
    async with make_router(api_key_file=keys) as h:
        # No key: 401, in Anthropic's shape on /v1/messages, OpenAI's elsewhere.
        r = await h.client.post("/v1/messages", json={})
        assert r.status_code == 401
        assert r.json() == {"type": "error", "error": {
            "type": "authentication_error", "message": r.json()["error"]["message"]}}
        r = await h.client.post("/v1/responses", json={})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        # Anthropic's SDKs send the key as x-api-key.
        r = await h.client.post("/v1/messages", headers={"x-api-key": "k-alice"},
                                json={"model": "tiny", "messages": []})
        assert r.status_code == 400
        assert r.json()["error"] == {
            "type": "invalid_request_error",
            "message": "max_tokens: is required and must be a positive integer"}
        r = await h.client.post("/v1/messages", headers={"x-api-key": "k-alice"},
                                content=b"{not json")
        assert r.status_code == 400 and r.json()["type"] == "error"
        r = await h.client.post("/v1/responses", headers={"Authorization": "Bearer k-alice"},
                                json={"model": "tiny", "input": "hi",
                                      "previous_response_id": "resp_1"})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "previous_response_id"
        assert r.json()["error"]["code"] == "unsupported_parameter"
        assert (await h.client.get("/health")).status_code == 200
