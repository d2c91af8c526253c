"""Responses and Messages through the router on real vLLM P/D (tiny model), with the official
SDKs: turn 2+ reuse decode's KV and every answer equals the colocated reference's (greedy).

Also a coding-agent-shaped replay: a main agent and two parallel subagents under one Claude
Code session id, over ``/v1/messages``, with Claude Code's own headers.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import anthropic
import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.vllm

SYSTEM = "you are a careful coding agent that reads files and runs tests. " * 8
TOOL_OUTPUT = "ok tests run result found file path value true " * 3


def _release(stack, cid: str) -> None:
    httpx.delete(f"{stack.base_url}/v1/sessions/{cid}", timeout=60)


def _records(stack, cid: str) -> list[dict]:
    r = httpx.get(f"{stack.base_url}/v1/sessions/{cid}", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["turns"]


# ------------------------------------------------------------------ Responses
def _responses_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                         timeout=600)


def _respond(client: openai.OpenAI, model: str, items: list, *, stream: bool,
             cid: str | None) -> tuple[dict, str, list[str]]:
    """One Responses turn: (headers, output text, event types)."""
    headers = {"X-Conversation-Id": cid} if cid else {}
    kwargs = dict(model=model, input=items, max_output_tokens=12, temperature=0, store=False,
                  extra_headers=headers)
    if not stream:
        raw = client.responses.with_raw_response.create(**kwargs)
        return dict(raw.headers), raw.parse().output_text, []
    raw = client.responses.with_raw_response.create(stream=True, **kwargs)
    text, types = "", []
    for event in raw.parse():
        types.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
    return dict(raw.headers), text, types


def _runs(types: list[str]) -> list[str]:
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_turns_fire_and_match_reference(pd_stack, reference_vllm, stream):
    router = _responses_client(pd_stack.base_url)
    reference = _responses_client(reference_vllm.base_url)
    cid = f"responses-{uuid.uuid4().hex[:8]}"
    items: list = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "please read the files and run the tests then tell me"},
    ]
    try:
        for turn in range(1, 5):
            headers, text, types = _respond(router, pd_stack.model, items, stream=stream, cid=cid)
            _, ref_text, ref_types = _respond(reference, pd_stack.model, items, stream=stream,
                                              cid=None)
            assert text == ref_text, (turn, text, ref_text)
            # The event sequence is vLLM's own (how many deltas carry the text depends on
            # timing, so runs of one event type count once).
            assert _runs(types) == _runs(ref_types)
            if stream:
                assert types[-1] == "response.completed"
            expected = "miss:first_turn" if turn == 1 else "fired"
            assert headers["x-kvtether-reuse"] == expected, (turn, headers)
            items += [{"role": "assistant", "content": text},
                      {"role": "user", "content": f"{TOOL_OUTPUT} (step {turn})"}]
        records = _records(pd_stack, cid)
        assert [r["outcome"] for r in records[1:]] == ["fired"] * 3
        assert all(r["output_tokens"] > 0 for r in records)
    finally:
        _release(pd_stack, cid)


def test_stateful_responses_are_refused_with_a_clear_400(pd_stack):
    client = _responses_client(pd_stack.base_url)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=pd_stack.model, input="hi", previous_response_id="resp_1")
    assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert "stateless" in err.value.message


# ------------------------------------------------------------------ Messages
def _anthropic(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=600)


def _message(client: anthropic.Anthropic, model: str, msgs: list, *, stream: bool,
             headers: dict[str, str]) -> tuple[dict, str]:
    kwargs = dict(model=model, system=SYSTEM, messages=msgs, max_tokens=12,
                  extra_body={"temperature": 0}, extra_headers=headers)
    if not stream:
        raw = client.messages.with_raw_response.create(**kwargs)
        message = raw.parse()
        return dict(raw.headers), "".join(b.text for b in message.content if b.type == "text")
    with client.messages.stream(**kwargs) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
        assert final.stop_reason in ("max_tokens", "end_turn")
        return dict(s.response.headers), text


@pytest.mark.parametrize("stream", [False, True])
def test_messages_turns_fire_and_match_reference(pd_stack, reference_vllm, stream):
    router = _anthropic(pd_stack.base_url)
    reference = _anthropic(reference_vllm.base_url)
    session = f"cc-{uuid.uuid4().hex[:8]}"
    msgs: list = [{"role": "user", "content": "please read the files and run the tests"}]
    try:
        for turn in range(1, 5):
            headers, text = _message(router, pd_stack.model, msgs, stream=stream,
                                     headers={"X-Claude-Code-Session-Id": session})
            _, ref_text = _message(reference, pd_stack.model, msgs, stream=stream, headers={})
            assert text == ref_text, (turn, text, ref_text)
            expected = "miss:first_turn" if turn == 1 else "fired"
            assert headers["x-kvtether-reuse"] == expected, (turn, headers)
            assert headers["x-conversation-id"] == session
            msgs += [{"role": "assistant", "content": text or "."},
                     {"role": "user", "content": f"{TOOL_OUTPUT} (step {turn})"}]
    finally:
        _release(pd_stack, session)


def test_messages_errors_have_anthropics_shape(pd_stack):
    client = _anthropic(pd_stack.base_url)
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=pd_stack.model, max_tokens=5,
                               messages=[{"role": "robot", "content": "hi"}])  # type: ignore[list-item]
    assert err.value.body["type"] == "error"  # type: ignore[index]
    assert err.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    # vLLM's own refusal (an unknown model) comes back in Anthropic's shape too.
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="no-such-model", max_tokens=5,
                               messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["type"] == "error"  # type: ignore[index]
    assert httpx.get(f"{pd_stack.base_url}/health", timeout=30).status_code == 200


# ------------------------------------------------------------------ a coding agent's session
async def _agent(client: anthropic.AsyncAnthropic, reference: anthropic.AsyncAnthropic,
                 model: str, system: str, msgs: list, headers: dict[str, str],
                 turns: int) -> list[tuple[str, str, str]]:
    """One agent's loop, extending ``msgs``: (reuse header, text, reference text) a turn."""
    out = []
    for step in range(turns):
        kwargs = dict(model=model, system=system, max_tokens=10,
                      extra_body={"temperature": 0})
        raw = await client.messages.with_raw_response.create(messages=msgs, extra_headers=headers,
                                                             **kwargs)
        message = await raw.parse()
        text = "".join(b.text for b in message.content if b.type == "text")
        ref = await reference.messages.create(messages=msgs, **kwargs)
        ref_text = "".join(b.text for b in ref.content if b.type == "text")
        out.append((raw.headers["x-kvtether-reuse"], text, ref_text))
        msgs += [{"role": "assistant", "content": text or "."},
                 {"role": "user", "content": f"{TOOL_OUTPUT} (tool {step})"}]
    return out


def test_a_coding_agent_session_with_parallel_subagents(pd_stack, reference_vllm):
    """Claude Code's shape: the main agent, then two subagents in parallel under the same
    session id (each with its own system prompt and agent id), then the main agent again."""
    session = f"cc-{uuid.uuid4().hex[:8]}"
    base = {"X-Claude-Code-Session-Id": session}

    async def run() -> dict[str, list[tuple[str, str, str]]]:
        client = anthropic.AsyncAnthropic(base_url=pd_stack.base_url, api_key="unused",
                                          max_retries=0, timeout=600)
        reference = anthropic.AsyncAnthropic(base_url=reference_vllm.base_url, api_key="unused",
                                             max_retries=0, timeout=600)
        model = pd_stack.model
        history: list = [{"role": "user", "content": "plan the refactor"}]
        main = await _agent(client, reference, model, SYSTEM, history, base, 2)
        subs = await asyncio.gather(*(
            _agent(client, reference, model, f"you are subagent {name}. " * 10,
                   [{"role": "user", "content": f"search the code for {name}"}],
                   {**base, "X-Claude-Code-Agent-Id": name}, 3)
            for name in ("explore-a", "explore-b")
        ))
        main += await _agent(client, reference, model, SYSTEM, history, base, 2)
        return {"main": main, "explore-a": subs[0], "explore-b": subs[1]}

    try:
        results = asyncio.run(run())
        for agent, turns in results.items():
            for i, (_, text, ref_text) in enumerate(turns):
                assert text == ref_text, (agent, i, text, ref_text)
        for name in ("explore-a", "explore-b"):
            assert [t[0] for t in results[name]] == ["miss:first_turn", "fired", "fired"]
            status = httpx.get(f"{pd_stack.base_url}/v1/sessions/{session}:agent:{name}",
                               timeout=30).json()
            assert status["parent_id"] == session
            assert all("prefix_break" not in r["outcome"] for r in status["turns"])
        # The main agent picks up where it left off while its subagents ran.
        assert [t[0] for t in results["main"]] == ["miss:first_turn"] + ["fired"] * 3
    finally:
        _release(pd_stack, session)
        for name in ("explore-a", "explore-b"):
            _release(pd_stack, f"{session}:agent:{name}")


# ------------------------------------------------------------------ the README runs as written
# ------------------------------------------------------------------ branches of one conversation
def test_parallel_workers_under_one_conversation_id_run_on_their_own_branches(
    pd_stack, reference_vllm
):
    """A supervisor fans out to two workers that share its thread id (one conversation):
    each worker's turns go to its own branch, in parallel, and reuse its own KV."""
    cid = f"fanout-{uuid.uuid4().hex[:8]}"

    async def worker(n: int, client: httpx.AsyncClient) -> list[tuple[str, str, str]]:
        msgs = [{"role": "system", "content": f"you are worker {n}. do the task. " * 10},
                {"role": "user", "content": f"task {n}: read the files"}]
        out = []
        for step in range(3):
            body = {"model": pd_stack.model, "messages": msgs, "max_tokens": 8,
                    "temperature": 0}
            r = await client.post(f"{pd_stack.base_url}/v1/chat/completions", json=body,
                                  headers={"X-Conversation-Id": cid})
            assert r.status_code == 200, r.text  # never 409: the branches run side by side
            ref = await client.post(f"{reference_vllm.base_url}/v1/chat/completions", json=body)
            text = r.json()["choices"][0]["message"]["content"] or "."
            out.append((r.headers["x-kvtether-reuse"], text,
                        ref.json()["choices"][0]["message"]["content"] or "."))
            msgs += [{"role": "assistant", "content": text},
                     {"role": "user", "content": f"{TOOL_OUTPUT} (step {step})"}]
        return out

    async def run() -> list[list[tuple[str, str, str]]]:
        async with httpx.AsyncClient(timeout=600) as client:
            return list(await asyncio.gather(worker(1, client), worker(2, client)))

    try:
        for turns in asyncio.run(run()):
            assert all(text == ref for _, text, ref in turns), turns
            assert [t[0] for t in turns][1:] == ["fired", "fired"]
        status = httpx.get(f"{pd_stack.base_url}/v1/sessions/{cid}", timeout=30).json()
        assert len(status["branches"]) == 1
        assert status["turn_count"] + status["branches"][0]["turn_count"] == 6
    finally:
        _release(pd_stack, cid)


# ------------------------------------------------------------------ no stricter than vLLM
# What the harnesses send (docs/coding-agents.md), recombined: the router must answer every
# such body as vLLM itself does (both 200, or both refuse), whatever fields it carries.
_text = st.sampled_from(["plan the fix", "run the tests", "ok", "read the file a.py"])
_cache = st.sampled_from([{}, {"cache_control": {"type": "ephemeral"}}])


@st.composite
def _claude_code_body(draw: st.DrawFn) -> dict:
    def content(text: str) -> str | list:
        if draw(st.booleans()):
            return text
        return [{"type": "text", "text": text, **draw(_cache)}]

    messages: list[dict] = [{"role": "user", "content": content(draw(_text))}]
    if draw(st.booleans()):  # Claude Code's environment / reminders as system messages
        messages.append({"role": "system", "content": content("<env>cwd: /repo</env>")})
    if draw(st.booleans()):
        messages += [
            {"role": "assistant", "content": [
                {"type": "text", "text": "I will look."},
                {"type": "tool_use", "id": "toolu_01", "name": "Bash",
                 "input": {"command": "ls"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": "a.py b.py",
                 **draw(_cache)}]},
        ]
        if draw(st.booleans()):
            messages.append({"role": "system", "content": "Today's date is 2026-12-07."})
            messages.append({"role": "user", "content": content(draw(_text))})
    body: dict = {
        "model": "tiny", "max_tokens": draw(st.sampled_from([4, 32000])), "messages": messages,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"},
                   {"type": "text", "text": SYSTEM, **draw(_cache)}],
    }
    optional = {
        "thinking": st.sampled_from([{"type": "adaptive"}, {"type": "disabled"}]),
        "context_management": st.just({"edits": [{"type": "clear_thinking_20251015",
                                                  "keep": "all"}]}),
        "output_config": st.just({"effort": "high"}),
        "metadata": st.just({"user_id": "user_abc_account_def_session_1"}),
        "temperature": st.sampled_from([0, 1]),
        "tools": st.just([{"name": "Bash", "description": "Run a command",
                           "input_schema": {"type": "object", "properties": {
                               "command": {"type": "string"}}, "required": ["command"]}}]),
        "stream": st.booleans(),
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            body[key] = draw(strategy)
    return body


@st.composite
def _codex_body(draw: st.DrawFn) -> dict:
    items: list[dict] = [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": SYSTEM}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                        "text": draw(_text)}]},
    ]
    if draw(st.booleans()):
        items += [
            {"type": "function_call", "call_id": "call_1", "name": "shell",
             "arguments": json.dumps({"command": ["ls"]})},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.py b.py"},
        ]
    body: dict = {"model": "tiny", "input": items, "max_output_tokens": 4,
                  "store": False, "stream": draw(st.booleans())}
    optional = {
        "reasoning": st.just({"effort": "medium", "summary": "auto"}),
        "include": st.just(["reasoning.encrypted_content"]),
        "prompt_cache_key": st.just("thread-1"),
        "tool_choice": st.just("auto"),
        "parallel_tool_calls": st.booleans(),
        "tools": st.just([{"type": "function", "name": "shell", "description": "run",
                           "parameters": {"type": "object", "properties": {
                               "command": {"type": "array", "items": {"type": "string"}}}}}]),
        "client_metadata": st.just({"originator": "codex_exec"}),
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            body[key] = draw(strategy)
    return body


def _same_verdict(pd_stack, reference_vllm, path: str, body: dict, headers: dict) -> None:
    with httpx.Client(timeout=600) as client:
        ref = client.post(f"{reference_vllm.base_url}{path}", json=body)
        got = client.post(f"{pd_stack.base_url}{path}", json=body, headers=headers)
    assert (got.status_code == 200) == (ref.status_code == 200), (
        got.status_code, got.text[:400], ref.status_code, ref.text[:400])
    if got.status_code != 200 and path == "/v1/messages":
        assert got.json()["type"] == "error", got.text


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_claude_code_body())
def test_what_claude_code_sends_is_answered_as_vllm_answers_it(pd_stack, reference_vllm, body):
    cid = f"cc-{uuid.uuid4().hex[:8]}"
    try:
        _same_verdict(pd_stack, reference_vllm, "/v1/messages", body,
                      {"X-Claude-Code-Session-Id": cid})
    finally:
        _release(pd_stack, cid)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_codex_body())
def test_what_codex_sends_is_answered_as_vllm_answers_it(pd_stack, reference_vllm, body):
    cid = f"codex-{uuid.uuid4().hex[:8]}"
    try:
        _same_verdict(pd_stack, reference_vllm, "/v1/responses", body, {"session-id": cid})
    finally:
        _release(pd_stack, cid)
