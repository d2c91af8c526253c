"""The recorded coding-agent sessions (tests/fixtures/harnesses): how
scripts/record-harness-traffic.py scrubs and packs them and how its stand-in model answers, and
how tests/support/harness_replay.py replays them: each earlier answer put back where the API
keeps it, then through the router over fake vLLM, where every turn after an agent's first
fires. On real vLLM: tests/integration/test_harness_replays_real.py.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import importlib.util
import itertools
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import harness_replay as hr
from tests.support.router_harness import make_router

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = hr.fixture_paths()


def _load_script() -> Any:
    spec = importlib.util.spec_from_file_location(
        "record_harness_traffic", ROOT / "scripts" / "record-harness-traffic.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


rec = _load_script()


# --------------------------------------------------------------------------- scrubbing
def test_the_scrubber_replaces_what_is_of_this_machine_or_run_the_same_way_everywhere():
    day = dt.date(2026, 12, 7)
    scrub = rec.Scrubber([("/tmp/kvt-rec-x/project", "<CWD>"), ("/tmp/kvt-rec-x", "<TMP>"),
                          ("-tmp-kvt-rec-x-project", "-CWD-")],
                         day=day, host="build-host-7", os_release="6.1.0-test")
    session = "4c5621b4-063c-438a-80e5-c4e161f127a3"
    now_ms = str(int(time.time() * 1000))
    raw = {
        "cwd /tmp/kvt-rec-x/project": [f"under /tmp/kvt-rec-x/other and {session}"],
        "headers": {"x-claude-code-session-id": session,
                    "x-session-id": "ses_db0e398aaffe5553sudsyxPRVv"},
        "env": f"Today's date: Mon Dec 07 2026 ({day.isoformat()}) on build-host-7, "
               "Linux 6.1.0-test",
        "key": "Authorization: Bearer sk-ant-abcdef123456",
        "meta": f'{{"turn_started_at_unix_ms":{now_ms},"version":"1796623522"}}',
        "slug": "~/.claude/projects/-tmp-kvt-rec-x-project/x.jsonl",
        "device": "a2092ac36b1c178c9726af1967421299075787ced435da1db753c10f006b8a52",
        "agent": "a4b7517226f21f9f5", "n": 3, "other": ["msg_01a24f1c-0d2d-7430-9fe0-dee5b5088675"],
    }
    out = scrub(raw)
    assert out == {
        "cwd <CWD>": ["under <TMP>/other and id-1"],
        "headers": {"x-claude-code-session-id": "id-1", "x-session-id": "ses_id-2"},
        "env": "Today's date: <DATE> (<DATE>) on <HOST>, Linux <OS-RELEASE>",
        "key": "Authorization: Bearer <KEY>",
        "meta": '{"turn_started_at_unix_ms":<UNIX-MS>,"version":"1796623522"}',
        "slug": "~/.claude/projects/-CWD-/x.jsonl",
        "device": "id-3", "agent": "id-4", "n": 3, "other": ["msg_id-5"],
    }
    # The same id becomes the same placeholder in every later request of the recording.
    assert scrub({"again": session}) == {"again": "id-1"}
    # An id of the conversation-id alphabet stays one (the router reads it from a header).
    assert re.fullmatch(r"[A-Za-z0-9._:@~+=-]+", out["headers"]["x-session-id"])


def test_packing_stores_repeated_parts_once_and_unpacks_exactly():
    system = "you are a coding agent. " * 100
    tools = [{"name": f"tool{i}", "description": "does things " * 20} for i in range(5)]
    bodies = [{"model": "m", "system": system, "tools": tools,
               "messages": [{"role": "user", "content": "hi"}] * (i + 1)} for i in range(3)]
    packed, blobs = rec.pack(bodies)
    assert [hr.unpack(b, blobs) for b in packed] == bodies
    # Key order too: the replay sends the bodies as the harness did.
    assert [json.dumps(hr.unpack(b, blobs)) for b in packed] == [json.dumps(b) for b in bodies]
    assert all(b["system"] == packed[0]["system"] and "$blob" in b["system"] for b in packed)
    assert len(json.dumps([packed, blobs])) < len(json.dumps(bodies)) / 2
    # A part under the threshold, or seen once, stays inline.
    assert packed[0]["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_a_fixture_is_small_clean_and_of_the_pinned_version(path: Path):
    text = path.read_text(encoding="utf-8")
    assert len(text) < 150_000
    pinned = json.loads((ROOT / "scripts" / "harnesses" / "package.json").read_text())
    fixture = hr.load_fixture(path)
    assert fixture.harness_version == rec.HARNESS_VERSIONS[fixture.harness]
    assert rec.HARNESS_VERSIONS[fixture.harness] in pinned["dependencies"].values()
    # No machine paths, keys, hosts or dates: placeholders only.
    assert not re.search(r"(?<![>\w])/(?:tmp|root)/|kvt-rec-|node_modules", text), path
    assert str(ROOT) not in text
    assert not re.search(r"\bsk-[A-Za-z0-9]|recording-only|127\.0\.0\.1|\b20\d\d-\d\d-\d\d\b",
                         text), path
    assert not re.search(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", text)
    data = json.loads(text)
    assert data["unexpected_requests"] == []
    assert data["scenario"] in rec.SCENARIOS and fixture.requests
    for r in fixture.requests:
        assert r.body["stream"] is True and r.api == rec.API_PATHS[r.path.split("?")[0]]
        assert set(r.headers) <= set(rec.IDENTITY_HEADERS)
        assert r.answer_text or r.answer_tool_ids
    agents = fixture.agents()
    assert "main" in agents
    if fixture.scenario == "subagents":
        assert {"sub-alpha", "sub-beta"} <= set(agents), sorted(agents)
        # The main agent called its subagent tool twice in one answer.
        assert len(agents["main"][0].answer_tool_ids) == 2
    if fixture.scenario == "resume":
        assert {r.invocation for r in agents["main"]} == {0, 1}


# --------------------------------------------------------------------------- the stand-in
def _post(url: str, path: str, body: dict[str, Any]) -> tuple[str, str]:
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.headers["content-type"], r.text


def _standin_calls(api: str, content_type: str, raw: str) -> list[tuple[str, str, dict]]:
    """(id, name, arguments) of the tool calls in a stand-in answer."""
    calls = []
    for event, data in hr._events(raw):
        if api == "messages" and data.get("type") == "content_block_start" \
                and data["content_block"]["type"] == "tool_use":
            calls.append([data["content_block"]["id"], data["content_block"]["name"], ""])
        elif api == "messages" and (data.get("delta") or {}).get("type") == "input_json_delta":
            calls[-1][2] += data["delta"]["partial_json"]
        elif api == "responses" and data.get("type") == "response.output_item.done" \
                and data["item"]["type"] == "function_call":
            calls.append([data["item"]["call_id"], data["item"]["name"],
                          data["item"]["arguments"]])
        elif api == "chat":
            for choice in data.get("choices") or []:
                for tc in (choice.get("delta") or {}).get("tool_calls") or []:
                    calls.append([tc["id"], tc["function"]["name"], tc["function"]["arguments"]])
    return [(i, n, json.loads(a)) for i, n, a in calls]


SHELL = {"messages": {"name": "Bash", "input_schema": {"properties": {
             "command": {"type": "string"}, "description": {"type": "string"}}}},
         "responses": {"type": "function", "name": "exec_command",
                       "parameters": {"properties": {"cmd": {"type": "string"}}}},
         "chat": {"type": "function", "function": {"name": "bash", "parameters": {
             "properties": {"command": {"type": "string"}}}}}}
PATHS = {"messages": "/v1/messages?beta=true", "responses": "/v1/responses",
         "chat": "/v1/chat/completions"}


def _grow(api: str, body: dict[str, Any], calls: list, output: str) -> None:
    """Append the stand-in's tool calls and their results, as the harness would."""
    if api == "messages":
        body["messages"] += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": i, "name": n, "input": a}
                                              for i, n, a in calls]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": i,
                                          "content": output} for i, _, _ in calls]}]
    elif api == "responses":
        for i, n, a in calls:
            body["input"] += [{"type": "function_call", "call_id": i, "name": n,
                               "arguments": json.dumps(a)},
                              {"type": "function_call_output", "call_id": i, "output": output}]
    else:
        body["messages"].append({"role": "assistant", "content": "", "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, n, a in calls]})
        body["messages"] += [{"role": "tool", "tool_call_id": i, "content": output}
                             for i, _, _ in calls]


@pytest.mark.parametrize("api", ["messages", "responses", "chat"])
def test_the_stand_in_runs_a_tool_loop_in_each_api_as_it_streams(api: str):
    recorder = rec.Recorder(rec.Script("x", "tool-loop"))
    prompt = "#kvt-main list the files"
    history = "input" if api == "responses" else "messages"
    body: dict[str, Any] = {"model": "m", "stream": True, "tools": [SHELL[api]],
                            "stream_options": {"include_usage": True},
                            history: [{"role": "user", "content": prompt}]}
    with rec.standin_server(recorder) as url:
        answers = []
        for _ in range(3):
            content_type, raw = _post(url, PATHS[api], body)
            assert content_type.startswith("text/event-stream")
            calls = _standin_calls(api, content_type, raw)
            answer = hr.parse_answer(api, content_type, raw)
            assert answer.error is None and answer.output_tokens
            answers.append((answer.text, [(n, a) for _, n, a in calls]))
            _grow(api, body, calls, "README.md notes.txt")
    command = "command" if api != "responses" else "cmd"
    assert [a[1] for a in answers] == [
        [(SHELL[api].get("name") or SHELL[api]["function"]["name"],
          {command: "ls", **({"description": "Run ls"} if api == "messages" else {})})],
        [(answers[1][1][0][0], {**answers[1][1][0][1], command: "echo tool loop step two"})],
        [],
    ]
    assert answers[0][0] == "" and "(kvt-a0003)" in answers[2][0]
    # Every exchange recorded, with the answer the replay will look for.
    assert [e["answer"]["text"] for e in recorder.exchanges] == [a[0] for a in answers]
    assert [e["agent"] for e in recorder.exchanges] == ["main"] * 3
    if api == "chat":  # include_usage: the last chunk before [DONE] carries the usage
        assert '"usage"' in raw.rsplit("data: [DONE]", 1)[0].rsplit("data: ", 1)[1]


def test_the_stand_in_spawns_codex_agents_and_waits_for_both():
    script = rec.Script("codex", "subagents")
    ns = {"type": "namespace", "name": "multi_agent_v1", "tools": [
        {"type": "function", "name": "spawn_agent", "parameters": {"properties": {
            "message": {"type": "string"}, "fork_context": {"type": "boolean"}}}},
        {"type": "function", "name": "wait_agent", "parameters": {"properties": {
            "targets": {"type": "array"}}}}]}
    body: dict[str, Any] = {"tools": [SHELL["responses"], ns], "input": [
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "#kvt-main start two agents"}]}]}
    spawn = script.decide("responses", body)
    assert [(c.name, c.namespace, c.arguments["fork_context"]) for c in spawn.tool_calls] == \
        [("spawn_agent", "multi_agent_v1", False)] * 2
    assert "#kvt-sub-alpha" in spawn.tool_calls[0].arguments["message"]
    for call, agent_id in zip(spawn.tool_calls, ["t-a", "t-b"], strict=True):
        body["input"] += [
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": json.dumps(call.arguments)},
            {"type": "function_call_output", "call_id": call.call_id,
             "output": json.dumps({"agent_id": agent_id, "nickname": "N"})}]
    wait = script.decide("responses", body)
    assert [(c.name, c.arguments["targets"]) for c in wait.tool_calls] == \
        [("wait_agent", ["t-a", "t-b"])]
    body["input"] += [
        {"type": "function_call", "call_id": wait.tool_calls[0].call_id, "name": "wait_agent",
         "arguments": "{}"},
        {"type": "function_call_output", "call_id": wait.tool_calls[0].call_id,
         "output": json.dumps({"status": {"t-b": {"completed": "done"}}, "timed_out": False})}]
    again = script.decide("responses", body)
    assert [c.arguments["targets"] for c in again.tool_calls] == [["t-a"]]
    body["input"].append({"type": "message", "role": "user", "content": [{
        "type": "input_text", "text": '<subagent_notification>\n{"agent_path":"t-a",'
                                      '"status":{"completed":"done"}}\n</subagent_notification>'}]})
    assert script.decide("responses", body).tool_calls == []
    # A subagent, by the marker of the prompt that started it, runs its shell tool.
    sub = script.decide("responses", {"tools": [SHELL["responses"]], "input": [
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": spawn.tool_calls[1].arguments["message"]}]}]})
    assert (sub.agent, sub.tool_calls[0].arguments) == \
        ("sub-beta", {"cmd": "echo subagent beta ran"})


# --------------------------------------------------------------------------- substitution
def _recorded(i: int, text: str = "", tool_ids: tuple[str, ...] = ()) -> hr.Recorded:
    return hr.Recorded(index=i, path="/", api="x", agent="main", invocation=0, headers={},
                       body={}, answer_text=text, answer_tool_ids=tool_ids, started_s=0,
                       ended_s=0)


def test_messages_the_real_text_goes_before_the_answers_tool_use_blocks():
    body = {"system": "s", "messages": [
        {"role": "user", "content": "#kvt-main go"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
            {"type": "tool_use", "id": "toolu_2", "name": "Bash", "input": {"command": "pwd"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "a"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "stand-in done",
                                           "cache_control": {"type": "ephemeral"}}]},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "stand-in string"},
    ]}
    earlier = {0: (_recorded(0, tool_ids=("toolu_1", "toolu_2")), "real one"),
               1: (_recorded(1, "stand-in done"), "real two"),
               2: (_recorded(2, "stand-in string"), ""),
               3: (_recorded(3, "never sent"), "x")}
    out, found = hr.substitute(body, "messages", earlier)
    assert found == [0, 1, 2]
    assert out["messages"][1]["content"] == [
        {"type": "text", "text": "real one"}, *body["messages"][1]["content"]]
    assert out["messages"][3]["content"] == [
        {"type": "text", "text": "real two", "cache_control": {"type": "ephemeral"}}]
    assert out["messages"][5]["content"] == "."  # Anthropic refuses an empty text
    assert out["messages"][:1] + out["messages"][2:3] + out["messages"][4:5] == \
        body["messages"][:1] + body["messages"][2:3] + body["messages"][4:5]
    assert body["messages"][1]["content"][0]["type"] == "tool_use"  # the input is untouched


def test_responses_the_real_text_is_an_assistant_message_before_the_function_calls():
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "exec_command",
            "arguments": "{}"}
    said = {"type": "message", "id": "msg_2", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": "stand-in", "annotations": []}]}
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text",
                                                              "text": "go"}]},
             call, {"type": "function_call_output", "call_id": "call_1", "output": "x"}, said]
    out, found = hr.substitute({"input": items}, "responses",
                               {0: (_recorded(0, tool_ids=("call_1",)), "real one"),
                                1: (_recorded(1, "stand-in"), "real two")})
    assert found == [0, 1]
    assert out["input"] == [
        items[0],
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "real one", "annotations": []}]},
        call, items[2],
        {**said, "content": [{"type": "output_text", "text": "real two", "annotations": []}]},
    ]
    # An empty real answer adds nothing before the calls.
    out, _ = hr.substitute({"input": items}, "responses",
                           {0: (_recorded(0, tool_ids=("call_1",)), "")})
    assert out["input"] == items


def test_chat_the_real_text_is_the_assistant_messages_content():
    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "bash", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "x"},
            {"role": "assistant", "content": "stand-in"}]
    out, found = hr.substitute({"messages": msgs}, "chat",
                               {0: (_recorded(0, tool_ids=("call_1",)), "real one"),
                                1: (_recorded(1, "stand-in"), "real two")})
    assert found == [0, 1]
    assert out["messages"] == [msgs[0], {**msgs[1], "content": "real one"}, msgs[2],
                               {"role": "assistant", "content": "real two"}]


def _fake_backend(texts: dict[int, str] | None = None) -> tuple[list, Any]:
    """A backend answering request k with "real answer k ..." in its API's stream shape."""
    sent: list[tuple[str, dict[str, str], dict[str, Any]]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        k = len(sent)
        sent.append((request.url.path, dict(request.headers), body))
        await asyncio.sleep(0.01)
        text = f"real answer {k} alpha bravo"
        frames: list[tuple[str | None, dict[str, Any]]]
        if request.url.path == "/v1/messages":
            frames = [("content_block_delta", {"type": "content_block_delta", "index": 0,
                                               "delta": {"type": "text_delta", "text": text}})]
        elif request.url.path == "/v1/responses":
            frames = [("response.output_text.delta",
                       {"type": "response.output_text.delta", "delta": text})]
        else:
            frames = [(None, {"choices": [{"index": 0, "delta": {"content": text}}]})]
        raw = "".join((f"event: {e}\n" if e else "") + f"data: {json.dumps(d)}\n\n"
                      for e, d in frames) + "data: [DONE]\n\n"
        return httpx.Response(200, text=raw, headers={"content-type": "text/event-stream",
                                                      "x-kvtether-reuse": "fired"})

    return sent, handler


def _assistant_texts(api: str, body: dict[str, Any]) -> list[str]:
    if api == "responses":
        return [c["text"] for it in body["input"] if it.get("role") == "assistant"
                for c in it["content"] if c.get("type") == "output_text"]
    out = []
    for m in body["messages"]:
        if m.get("role") == "assistant":
            c = m.get("content")
            out += [c] if isinstance(c, str) else [b["text"] for b in c or []
                                                   if b.get("type") == "text"]
    return [t for t in out if t]


def _tool_ids(body: dict[str, Any]) -> list[str]:
    return re.findall(r'"(?:id|call_id|tool_use_id|tool_call_id)": "((?:call|toolu)_kvt_[^"]+)"',
                      json.dumps(body))


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
async def test_a_replay_puts_each_real_answer_where_the_stand_ins_was(path: Path):
    fixture = hr.load_fixture(path)
    sent, handler = _fake_backend()
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler),
                                 base_url="http://router") as client:
        turns = await hr.replay(fixture, client, model="agents", tag="t1")
    assert [t.status for t in turns] == [200] * len(fixture.requests)
    real = {t.index: t.text for t in turns}
    for agent, requests in fixture.agents().items():
        for prev, r in itertools.pairwise(requests):
            turn = turns[r.index]
            # Each earlier answer of this agent is in its next request, as the stack said it.
            mine = [q.index for q in requests if q.index < r.index]
            assert set(mine) <= set(turn.substituted), (agent, r.index, turn.substituted)
            texts = _assistant_texts(r.api, turn.body)
            assert [real[i] for i in mine if real[i]] == texts, (agent, r.index)
            assert not any("(kvt-a" in t for t in texts)
            # The tool calls and results still pair up, ids as recorded.
            assert _tool_ids(turn.body) == _tool_ids(r.body)
            assert turns[prev.index].index in turn.substituted
    for r, turn in zip(fixture.requests, turns, strict=True):
        # Everything else as recorded: the fields around the history, the headers.
        history = "input" if r.api == "responses" else "messages"
        rest = {k: v for k, v in turn.body.items() if k not in (history, "model", "temperature")}
        assert rest == {k: v for k, v in r.body.items() if k not in (history, "model")}
        assert (turn.body["model"], turn.body["temperature"]) == ("agents", 0.0)
    by_body = {json.dumps(b, sort_keys=True): (p, h) for p, h, b in sent}
    for r, turn in zip(fixture.requests, turns, strict=True):
        sent_path, headers = by_body[json.dumps(turn.body, sort_keys=True)]
        assert sent_path == r.path.split("?")[0]
        assert {k: headers[k] for k in r.headers} == {
            k: (v if k == "x-openai-subagent" else f"t1-{v}") for k, v in r.headers.items()}


# --------------------------------------------------------------------------- through the router
def _by_agent(fixture: hr.Fixture, turns: list[hr.ReplayedTurn]) -> dict[str, list]:
    out: dict[str, list[hr.ReplayedTurn]] = {}
    for t in turns:
        out.setdefault(fixture.requests[t.index].agent, []).append(t)
    return out


def _extends(prev: hr.ReplayedTurn, t: hr.ReplayedTurn) -> bool:
    """Whether ``t``'s prompt repeats all of ``prev``'s sequence (its prompt and what it
    generated, less the last token, whose KV no engine computed): the prefix check found no
    divergence."""
    assert prev.prompt_tokens and prev.output_tokens and t.reusable_tokens is not None
    return t.reusable_tokens >= prev.prompt_tokens + prev.output_tokens - 1


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
async def test_a_recorded_session_fires_through_the_router_over_fake_vllm(path: Path):
    fixture = hr.load_fixture(path)
    async with make_router(control=True, fake={"kvtether_connector": True}) as h:
        turns = await hr.replay(fixture, h.client, model="tiny")
        h.assert_kv_correct()
    assert [(t.status, t.error) for t in turns] == [(200, None)] * len(turns), turns
    for agent, agent_turns in _by_agent(fixture, turns).items():
        assert agent_turns[0].reuse == "miss:first_turn", (agent, agent_turns[0])
        for prev, t in itertools.pairwise(agent_turns):
            assert t.reuse == "fired", (agent, t)
            assert t.salvaged_tokens is None and _extends(prev, t), (agent, prev, t)
    # Subagents are conversations of their own, linked to the main agent's.
    conversations = {fixture.requests[t.index].agent: t.conversation_id for t in turns}
    if fixture.scenario == "subagents":
        assert len({conversations[a] for a in ("main", "sub-alpha", "sub-beta")}) == 3


@pytest.mark.parametrize("path", [p for p in FIXTURES if "tool-loop" in p.name],
                         ids=lambda p: p.stem)
async def test_without_the_substitution_the_prompts_break_from_what_decode_holds(path: Path):
    fixture = hr.load_fixture(path)
    async with make_router(control=True, fake={"kvtether_connector": True}) as h:
        turns = await hr.replay(fixture, h.client, model="tiny", substitute_answers=False)
    main = _by_agent(fixture, turns)["main"]
    assert not any(_extends(prev, t) for prev, t in itertools.pairwise(main)), main


# --------------------------------------------------------------------------- vLLM's request models
def test_every_replayed_body_is_one_vllm_accepts():
    pytest.importorskip("vllm")
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    models = {"messages": AnthropicMessagesRequest, "chat": ChatCompletionRequest,
              "responses": ResponsesRequest}
    for path in FIXTURES:
        fixture = hr.load_fixture(path)
        for r in fixture.requests:
            earlier = {j: (fixture.requests[j], "north south east")
                       for j in fixture.before(r.index)}
            body, _ = hr.substitute(r.body, r.api, earlier)
            models[r.api].model_validate({**body, "model": "agents", "temperature": 0.0})


def _prompt_ids(tokenizer: Any, api: str, body: dict[str, Any]) -> list[int]:
    """The prompt's token ids as vLLM makes them: its own Messages / Responses conversion to
    chat messages, then the model's chat template (content parts joined as vLLM joins text
    parts for a string-content template)."""
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import (
        construct_input_messages,
        construct_tool_dicts,
    )

    body = {**body, "model": "agents", "temperature": 0.0}
    tools: Any
    if api == "responses":
        req = ResponsesRequest.model_validate(body)
        messages: Any = construct_input_messages(request_instructions=req.instructions,
                                                 request_input=req.input)
        tools = construct_tool_dicts(req.tools, req.tool_choice)
    else:
        chat = (AnthropicServingMessages.to_chat_completion_request(
                    AnthropicMessagesRequest.model_validate(body))
                if api == "messages" else ChatCompletionRequest.model_validate(body))
        messages = chat.messages
        tools = [t.model_dump() for t in chat.tools] if chat.tools else None
    rendered = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = "\n".join(p.get("text", "") for p in m["content"])
        if m.get("tool_calls"):
            m["tool_calls"] = [{**tc, "function": dict(tc["function"])}
                               for tc in map(dict, m["tool_calls"])]
        rendered.append(m)
    ids = tokenizer.apply_chat_template(rendered, tools=tools, add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_each_replayed_prompt_extends_the_previous_one_and_its_answer_token_for_token():
    """The prompts the replay sends, rendered by vLLM's conversions and the `agents` model's
    chat template and tokenizer (the cpu-agents stack's): each agent's next prompt starts with
    its previous prompt and the tokens of the answer put in its place, so decode's KV is
    reusable whole. Left with the stand-in's answers, they would not be."""
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    from kvtether.stack.models import is_prepared, model_dir

    if not is_prepared(model_dir("agents")):
        pytest.skip("the agents model is not prepared (kvtether model prepare agents)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir("agents"))
    broken = []
    for path in FIXTURES:
        fixture = hr.load_fixture(path)
        answers = {r.index: f"north south east river {r.index}" for r in fixture.requests}
        for substituted in (True, False):
            ids = {}
            for r in fixture.requests:
                earlier = {j: (fixture.requests[j], answers[j]) for j in fixture.before(r.index)}
                body, _ = hr.substitute(r.body, r.api, earlier if substituted else {})
                ids[r.index] = _prompt_ids(tokenizer, r.api, body)
            for requests in fixture.agents().values():
                for prev, r in itertools.pairwise(requests):
                    answer = tokenizer.encode(answers[prev.index], add_special_tokens=False)
                    expected = ids[prev.index] + answer
                    extends = ids[r.index][:len(expected)] == expected
                    if extends != substituted:
                        broken.append((fixture.name, prev.index, r.index, substituted))
    assert broken == []
