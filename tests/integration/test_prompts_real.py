"""The router's own tokenizer on real vLLM (tiny model): for every request shape it mirrors, its
token ids are the ones vLLM computes for that chat or completions request, and the bundled
stack's router tokenizes turns itself with no difference from what vLLM reports."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from kvtether.router.prompts import PromptTokenizer
from tests.support.router_harness import metric_value

pytestmark = pytest.mark.vllm

SYSTEM = {"role": "system", "content": "You are a careful coding agent. Answer briefly."}
USER = {"role": "user", "content": "Which files changed since the last commit?"}
TOOLS = [
    {"type": "function", "function": {
        "name": "run", "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                       "required": ["cmd"]}}},
    {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"},
                                      "strict": True}},
]
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "run", "arguments": '{"cmd": "git status --short"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": " M src/a.py\n?? notes.md"}

CHATS: dict[str, dict[str, Any]] = {
    "plain": {"messages": [SYSTEM, USER]},
    "history": {"messages": [SYSTEM, USER, {"role": "assistant", "content": "Two files."},
                             {"role": "user", "content": "Show the diff of the first."}]},
    "text-parts": {"messages": [SYSTEM, {"role": "user", "content": [
        {"type": "text", "text": "Read this:"}, {"type": "text", "text": "def f(): pass"}]}]},
    "tool-text-parts": {"messages": [SYSTEM, USER, CALL, {
        "role": "tool", "tool_call_id": "call_1",
        "content": [{"type": "text", "text": "M a.py"}, {"type": "text", "text": "M b.py"}]}]},
    "names": {"messages": [SYSTEM, {"role": "user", "name": "alice", "content": "hi"}]},
    "tools-and-calls": {"messages": [SYSTEM, USER, CALL, RESULT], "tools": TOOLS},
    "empty-and-bad-arguments": {"messages": [SYSTEM, USER, {
        "role": "assistant", "content": "", "tool_calls": [
            {"id": "c2", "type": "function", "function": {"name": "ls", "arguments": ""}},
            {"id": "c3", "type": "function", "function": {"name": "ls", "arguments": "[1]"}},
            {"id": "c4", "type": "function", "function": {"name": "ls", "arguments": "{x"}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "a.py"}], "tools": TOOLS},
    "no-generation-prompt": {"messages": [SYSTEM, USER], "add_generation_prompt": False},
    "continue-final": {"messages": [SYSTEM, USER, {"role": "assistant", "content": "The fi"}],
                       "add_generation_prompt": False, "continue_final_message": True},
    "special-tokens": {"messages": [SYSTEM, USER], "add_special_tokens": True},
    "unicode": {"messages": [SYSTEM, {"role": "user", "content": "naïve café — 日本語 🙂\n\ttab"}]},
}


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    from kvtether.stack.models import prepare_model

    tok = PromptTokenizer.load(prepare_model("tiny"))
    assert tok is not None
    return tok


def _vllm_prompt_ids(url: str, model: str, endpoint: str, body: dict[str, Any]) -> list[int]:
    """What vLLM itself computed: the prompt token ids of a one-token answer."""
    r = httpx.post(f"{url}{endpoint}", json={
        "model": model, "max_tokens": 1, "temperature": 0, "return_token_ids": True, **body,
    }, timeout=300)
    assert r.status_code == 200, r.text
    data = r.json()
    ids = data.get("prompt_token_ids") or data["choices"][0].get("prompt_token_ids")
    assert ids, data
    return ids


@pytest.mark.parametrize("name", list(CHATS))
def test_the_router_tokenizes_a_chat_as_vllm_does(pd_stack, tokenizer: PromptTokenizer,
                                                  name: str) -> None:
    body = CHATS[name]
    mine = tokenizer.token_ids("/v1/chat/completions", {"model": pd_stack.model, **body})
    assert mine is not None, f"{name} should be mirrored"
    theirs = _vllm_prompt_ids(pd_stack.prefill_urls[0], pd_stack.model,
                              "/v1/chat/completions", body)
    assert mine == theirs


@pytest.mark.parametrize("body", [
    {"prompt": "def add(a, b):\n    return"},
    {"prompt": "plain text", "add_special_tokens": False},
], ids=["default", "no-special-tokens"])
def test_the_router_tokenizes_a_completion_as_vllm_does(pd_stack, tokenizer: PromptTokenizer,
                                                        body: dict[str, Any]) -> None:
    mine = tokenizer.token_ids("/v1/completions", {"model": pd_stack.model, **body})
    assert mine is not None
    assert mine == _vllm_prompt_ids(pd_stack.prefill_urls[0], pd_stack.model,
                                    "/v1/completions", body)


def test_the_stacks_router_tokenizes_turns_itself(pd_stack) -> None:
    def metrics() -> str:
        return httpx.get(f"{pd_stack.base_url}/metrics", timeout=60).text

    def tokenizer() -> str:
        return httpx.get(f"{pd_stack.base_url}/health", timeout=60).json()["tokenizer"]

    # `stack up` waited for the router's tokenizer before its warm-up turns, which checked it.
    assert tokenizer() == "router"
    before = metric_value(metrics(), "kvtether_prompt_tokenizations_total", 'by="router"')
    cid = f"own-tokenizer-{uuid.uuid4().hex[:8]}"
    messages: list[dict[str, Any]] = [SYSTEM, USER]
    with httpx.Client(base_url=pd_stack.base_url, timeout=300,
                      headers={"X-Conversation-Id": cid}) as client:
        for i in range(3):
            r = client.post("/v1/chat/completions", json={
                "model": pd_stack.model, "messages": messages, "max_tokens": 8,
                "temperature": 0})
            assert r.status_code == 200, r.text
            if i:
                assert r.headers["X-KVTether-Reuse"] == "fired"
            messages = [*messages, {"role": "assistant",
                                    "content": r.json()["choices"][0]["message"]["content"]},
                        {"role": "user", "content": f"tool output {i} " * 20}]
        client.delete(f"/v1/sessions/{cid}")
    text = metrics()
    assert metric_value(text, "kvtether_prompt_tokenizations_total", 'by="router"') >= before + 2
    assert metric_value(text, "kvtether_router_tokenizer_mismatches_total") == 0
    assert tokenizer() == "router"
