"""How an answer ends (router.answers), read from each API's answers as vLLM 0.32 writes them,
and the gaps a conversation's tool calls leave (router.tool_leases.ToolGaps)."""

from __future__ import annotations

import json
import math

import pytest

from kvtether.router.answers import MAX_ARGUMENT_CHARS, AnswerReader, tool_call_key
from kvtether.router.tool_leases import MAX_TOOL_KEYS, TOOL_GAP_DEFAULT_S, ToolGaps


# --------------------------------------------------------------------------- tool keys
@pytest.mark.parametrize(("name", "arguments", "key"), [
    ("Bash", {"command": "pytest -x", "description": "run the tests"}, "Bash:pytest"),
    ("Bash", json.dumps({"command": "cd src && uv run pytest -q"}), "Bash:uv run pytest"),
    ("bash", {"command": "git status --short"}, "bash:git status"),
    ("shell", {"command": ["bash", "-lc", "cargo test --all"], "workdir": "/w"},
     "shell:cargo test"),
    ("exec_command", {"cmd": "timeout 60 python -m pytest tests/"},
     "exec_command:python -m pytest"),
    ("exec_command", {"cmd": "FOO=1 /usr/bin/rg -n foo | head"}, "exec_command:rg"),
    ("local_shell", {"type": "exec", "command": ["ls", "-la"]}, "local_shell:ls"),
    ("shell", {"commands": ["npm run build"]}, "shell:npm run build"),
    ("Read", {"file_path": "/src/app.py"}, "Read"),
    ("Edit", json.dumps({"file_path": "x", "old_string": "a", "new_string": "b"}), "Edit"),
    ("Bash", '{"command": "pyt', "Bash"),  # cut short: the tool alone
    ("Bash", {"command": "cd /tmp"}, "Bash"),
    ("Write", json.dumps({"command": "x", "content": "y" * MAX_ARGUMENT_CHARS}), "Write"),
    (None, None, "tool"),
])
def test_a_tool_call_is_known_by_its_tool_and_command(name, arguments, key):
    assert tool_call_key(name, arguments) == key


# --------------------------------------------------------------------------- whole answers
def test_chat_answers() -> None:
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "Bash", "arguments": '{"command": "make test"}'}},
             {"id": "c2", "type": "function",
              "function": {"name": "Read", "arguments": '{"file_path": "a"}'}}]
    r = AnswerReader()
    r.body("chat", {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": calls}}]})
    assert r.end().tool_keys == ("Bash:make test", "Read")
    r = AnswerReader()
    r.body("chat", {"choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": "done"}}]})
    assert not r.end().tool_calls


def test_completions_never_end_in_tool_calls() -> None:
    r = AnswerReader()
    r.body("completions", {"choices": [{"text": " tool_calls", "finish_reason": "stop"}]})
    assert not r.end().tool_calls


def test_responses_answers_count_the_calls_the_client_runs() -> None:
    r = AnswerReader()
    r.body("responses", {"object": "response", "output": [
        {"type": "reasoning", "id": "rs", "summary": []},
        {"type": "function_call", "call_id": "c", "name": "shell",
         "arguments": json.dumps({"command": ["bash", "-lc", "pytest"]})},
        {"type": "custom_tool_call", "call_id": "d", "name": "apply_patch", "input": "*** x"},
        {"type": "local_shell_call", "call_id": "e",
         "action": {"type": "exec", "command": ["make"]}},
    ]})
    assert r.end().tool_keys == ("shell:pytest", "apply_patch", "local_shell:make")
    # A search the server ran itself, then a message: the person's turn.
    r = AnswerReader()
    r.body("responses", {"output": [
        {"type": "web_search_call", "id": "ws", "status": "completed"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "found it"}]}]})
    assert not r.end().tool_calls


def test_messages_answers() -> None:
    r = AnswerReader()
    r.body("messages", {"type": "message", "stop_reason": "tool_use", "content": [
        {"type": "text", "text": "running the tests"},
        {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "pytest"}}]})
    assert r.end().tool_keys == ("Bash:pytest",)
    r = AnswerReader()
    r.body("messages", {"type": "message", "stop_reason": "end_turn",
                        "content": [{"type": "text", "text": "all green"}]})
    assert not r.end().tool_calls


# --------------------------------------------------------------------------- streams
def test_chat_stream_arguments_come_in_pieces() -> None:
    r = AnswerReader()
    pieces = [{"index": 0, "id": "c1", "type": "function",
               "function": {"name": "Bash", "arguments": '{"comm'}},
              {"index": 0, "function": {"arguments": 'and": "pytest -x"}'}},
              {"index": 1, "id": "c2", "type": "function",
               "function": {"name": "Glob", "arguments": "{}"}}]
    r.chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    for piece in pieces:
        r.chunk({"choices": [{"index": 0, "delta": {"tool_calls": [piece]},
                              "finish_reason": None}]})
    r.chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    assert r.end().tool_keys == ("Bash:pytest", "Glob")
    text = AnswerReader()
    text.chunk({"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]})
    assert not text.end().tool_calls


def _frame(name: str, data: dict) -> list[str]:
    return [f"event: {name}", "data: " + json.dumps(data)]


def test_responses_stream_is_read_from_its_last_event() -> None:
    r = AnswerReader()
    item = {"type": "function_call", "call_id": "c", "name": "exec_command",
            "arguments": json.dumps({"cmd": "go test ./..."})}
    r.event("response.output_item.added", _frame("response.output_item.added",
                                                 {"item": {**item, "arguments": ""}}))
    r.event("response.function_call_arguments.delta",
            _frame("response.function_call_arguments.delta", {"delta": "{"}))
    r.event("response.output_item.done", _frame("response.output_item.done", {"item": item}))
    assert r.end().tool_keys == ("exec_command:go test",)
    r.event("response.completed", _frame("response.completed", {"response": {
        "output": [item, {**item, "arguments": json.dumps({"cmd": "ls"})}]}}))
    assert r.end().tool_keys == ("exec_command:go test", "exec_command:ls")
    text = AnswerReader()
    text.event("response.output_text.delta", _frame("response.output_text.delta",
                                                    {"delta": "function_call"}))
    text.event("response.completed", _frame("response.completed", {"response": {"output": [
        {"type": "message", "content": [{"type": "output_text", "text": "function_call"}]}]}}))
    assert not text.end().tool_calls


def test_messages_stream_tool_use_blocks_and_stop_reason() -> None:
    r = AnswerReader()
    r.event("content_block_start", _frame("content_block_start", {
        "index": 0, "content_block": {"type": "text", "text": ""}}))
    r.event("content_block_delta", _frame("content_block_delta", {
        "index": 0, "delta": {"type": "text_delta", "text": "let me check"}}))
    r.event("content_block_start", _frame("content_block_start", {
        "index": 1, "content_block": {"type": "tool_use", "id": "t", "name": "Bash",
                                      "input": {}}}))
    for piece in ('{"command": "np', 'm test"}'):
        r.event("content_block_delta", _frame("content_block_delta", {
            "index": 1, "delta": {"type": "input_json_delta", "partial_json": piece}}))
    r.event("message_delta", _frame("message_delta", {"delta": {"stop_reason": "tool_use"}}))
    assert r.end().tool_keys == ("Bash:npm test",)
    # stop_reason alone still says a tool runs.
    bare = AnswerReader()
    bare.event("message_delta", _frame("message_delta", {"delta": {"stop_reason": "tool_use"}}))
    assert bare.end().tool_keys == ("tool",)
    person = AnswerReader()
    person.event("message_delta", _frame("message_delta", {"delta": {"stop_reason": "end_turn"}}))
    assert not person.end().tool_calls


def test_an_answer_calls_a_bounded_number_of_tools() -> None:
    r = AnswerReader()
    r.body("messages", {"content": [{"type": "tool_use", "name": f"t{i}", "input": {}}
                                    for i in range(100)]})
    assert len(r.end().tool_keys) == 16


# --------------------------------------------------------------------------- learned gaps
def test_a_gap_is_learned_per_command_then_tool_then_conversation() -> None:
    gaps = ToolGaps()
    assert gaps.estimate_s("Bash:pytest") == pytest.approx(TOOL_GAP_DEFAULT_S)
    for _ in range(5):
        gaps.observe(["Bash:pytest"], 200.0)
    assert gaps.estimate_s("Bash:pytest") == pytest.approx(200.0, rel=0.1)
    # Another command of the same tool leans on the tool; another tool on the conversation.
    assert 100.0 < gaps.estimate_s("Bash:ls") < 200.0
    assert TOOL_GAP_DEFAULT_S < gaps.estimate_s("Read") < 200.0
    for _ in range(5):
        gaps.observe(["Bash:ls"], 1.0)
    assert gaps.estimate_s("Bash:ls") < 5.0 < 150.0 < gaps.estimate_s("Bash:pytest")


def test_a_running_median_shrugs_off_one_huge_gap() -> None:
    gaps = ToolGaps()
    for _ in range(10):
        gaps.observe(["Grep"], 2.0)
    gaps.observe(["Grep"], 3000.0)  # the person went to lunch
    assert gaps.estimate_s("Grep") < 10.0  # a mean would say ~270 s


def test_learned_keys_are_bounded_and_survive_json() -> None:
    gaps = ToolGaps()
    for i in range(200):
        gaps.observe([f"Bash:cmd{i}"], 10.0)
    assert len(gaps) <= MAX_TOOL_KEYS
    assert gaps.estimate_s("Bash:cmd199") == pytest.approx(10.0, rel=0.05)
    again = ToolGaps.from_json(json.loads(json.dumps(gaps.to_json())))
    assert again == gaps and math.isclose(again.estimate_s("Bash"), gaps.estimate_s("Bash"))


def test_odd_answers_end_in_nothing_rather_than_an_error() -> None:
    r = AnswerReader()
    r.body("chat", {"choices": [{"message": {"tool_calls": [{"function": "x"}, 3]}}, None]})
    r.chunk({"choices": [{"index": [1], "delta": {"tool_calls": [{"index": {}, "function": {
        "name": ["x"], "arguments": 5}}]}}]})
    r.event("content_block_start", ["event: content_block_start", "data: {not json"])
    r.event("content_block_start", _frame("content_block_start", {
        "index": [0], "content_block": {"type": "tool_use", "name": None, "input": "x"}}))
    r.event("response.completed", _frame("response.completed", {"response": {"output": 3}}))
    assert r.end().tool_keys == ("tool", "tool")
