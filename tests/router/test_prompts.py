"""The router's own tokenizer (``RouterSettings.tokenizer``, :mod:`kvtether.router.prompts`):
what it mirrors, what it leaves to prefill's /tokenize, and that a difference from the token
ids vLLM reports switches it off. Against real vLLM: tests/integration/test_prompts_real.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kvtether.router.prompts import PromptTokenizer
from tests.support.fake_vllm import prompt_ids_of
from tests.support.router_harness import make_router

FAKE = {"kvtether_connector": True}


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    from kvtether.stack.models import prepare_model

    return prepare_model("tiny")


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> PromptTokenizer:
    loaded = PromptTokenizer.load(tiny_dir)
    assert loaded is not None
    return loaded


def _chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": list(messages), **extra}


SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "List the files."}


def test_text_parts_render_as_their_lines(tok: PromptTokenizer) -> None:
    parts = {"role": "user", "content": [{"type": "text", "text": "List"},
                                         {"type": "text", "text": "the files."}]}
    joined = {"role": "user", "content": "List\nthe files."}
    ids = tok.token_ids("/v1/chat/completions", _chat(SYSTEM, parts))
    assert ids is not None and ids == tok.token_ids("/v1/chat/completions", _chat(SYSTEM, joined))
    # The generation prompt is on by default, as in vLLM; off, the prompt is shorter.
    without = tok.token_ids("/v1/chat/completions",
                            _chat(SYSTEM, joined, add_generation_prompt=False))
    assert without is not None and len(without) < len(ids)


def test_tool_calls_and_tools_are_rendered(tok: PromptTokenizer) -> None:
    tools = [{"type": "function", "function": {
        "name": "ls", "description": "List files", "parameters": {"type": "object"}}}]
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"d": "."}'}}]}
    result = {"role": "tool", "tool_call_id": "c1", "content": "a.py b.py"}
    ids = tok.token_ids("/v1/chat/completions", _chat(SYSTEM, USER, call, result, tools=tools))
    assert ids is not None and len(ids) > 10


@pytest.mark.parametrize("body", [
    _chat(USER, chat_template="{{ messages }}"),
    _chat(USER, chat_template_kwargs={"enable_thinking": False}),
    _chat(USER, reasoning_effort="low"),
    _chat({"role": "developer", "content": "be brief"}, USER),
    _chat({"role": "assistant", "content": "x", "reasoning": "because"}),
    _chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
    _chat(USER, add_generation_prompt="yes"),
    _chat(USER, tools=[{"type": "function", "function": {"name": "ls", "extra": 1}}]),
    _chat({"role": "assistant", "tool_calls": [{"type": "web", "function": {"name": "x"}}]}),
    _chat({"role": "system", "content": "x-anthropic-billing-header: cch=1\nBe brief."}),
    _chat(),
], ids=["template", "template-kwargs", "reasoning-effort", "developer", "reasoning",
        "image", "bad-flag", "unknown-tool-field", "non-function-call", "claude-billing",
        "no-messages"])
def test_what_it_does_not_mirror_goes_to_prefill(tok: PromptTokenizer,
                                                 body: dict[str, Any]) -> None:
    assert tok.token_ids("/v1/chat/completions", body) is None


def test_completions_mirror_a_string_prompt_only(tok: PromptTokenizer) -> None:
    ids = tok.token_ids("/v1/completions", {"model": "tiny", "prompt": "hello world"})
    assert ids is not None and ids
    assert tok.token_ids("/v1/completions", {"model": "tiny", "prompt": [1, 2, 3]}) is None
    assert tok.token_ids("/v1/completions", {"model": "tiny", "prompt": "x", "suffix": "y"}) is None


def test_a_difference_switches_it_off_for_good(tiny_dir: Path) -> None:
    tok = PromptTokenizer.load(tiny_dir)
    assert tok is not None
    body = _chat(SYSTEM, USER)
    ids = tok.token_ids("/v1/chat/completions", body)
    assert ids is not None
    assert tok.check(ids, list(ids))
    assert not tok.check(ids, [*ids, 7])
    assert not tok.enabled and tok.token_ids("/v1/chat/completions", body) is None
    tok.close()


def test_a_directory_without_a_tokenizer_loads_nothing(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    assert PromptTokenizer.load(tmp_path) is None
    assert "prefill's /tokenize" in caplog.text


class _FakeVllmTokenizer(PromptTokenizer):
    """Tokenizes as the fake vLLM instances do (``shift``: off by one token, as a template
    vLLM was started with and the router was not would be)."""

    def __init__(self, shift: bool = False) -> None:  # noqa: D107 - no real tokenizer
        self.enabled, self.shift, self.calls = True, shift, 0
        self._agreed = self._vouched = 0

    def token_ids(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        if not self.enabled:
            return None
        self.calls += 1
        ids = prompt_ids_of(body, chat=endpoint.endswith("/chat/completions"))
        return [*ids, 5] if self.shift else ids

    async def atoken_ids(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        return self.token_ids(endpoint, body)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_the_router_tokenizes_without_asking_prefill(stream: bool) -> None:
    async with make_router(control=True, fake=FAKE) as h:
        h.app.state.runner.prompts = fake = _FakeVllmTokenizer()
        agent = h.conversation("own-tokenizer")
        await agent.say("first question " * 20, stream=stream)
        for i in range(3):
            turn = await agent.say(f"tool output {i} " * 15, stream=stream)
            assert turn.outcome == "fired", turn.outcome
        assert h.p.tokenize_calls == 0 and fake.calls == 3
        assert await h.metric("kvtether_prompt_tokenizations_total", 'by="router"') == 3
        assert await h.metric("kvtether_router_tokenizer_mismatches_total") == 0
        # Decode took the ids prefill rendered instead of rendering the chat again.
        decode_legs = h.d.forwarded_prompt_ids
        assert len(decode_legs) == 4 and all(decode_legs), decode_legs
        assert h.p.forwarded_prompt_ids == [None] * 4  # prefill renders: that is the check
        h.assert_kv_correct()


async def test_a_local_prefill_takes_the_router_ids_once_a_check_agreed() -> None:
    """Decode computes short turns itself; it takes the router's ids once vLLM's own rendering
    agreed with them (the first local turn: turn 1 had nothing to check), and renders every
    eighth such turn itself, so the check goes on."""
    async with make_router(control=True, fake=FAKE, local_prefill_max_tokens=200) as h:
        h.app.state.runner.prompts = fake = _FakeVllmTokenizer()
        agent = h.conversation("forwarded")
        await agent.say("first question " * 20)  # through prefill: checked, and agreed
        for i in range(9):
            turn = await agent.say(f"tool output {i} " * 5)
            assert turn.outcome == "fired", turn.outcome
        local = h.d.forwarded_prompt_ids[1:]
        assert len(local) == 9 and h.p.forwarded_prompt_ids == [None]
        assert [ids is not None for ids in local] == [False] + [True] * 7 + [False]
        assert fake._agreed == 2  # the turns decode rendered
        assert await h.metric("kvtether_router_tokenizer_mismatches_total") == 0
        h.assert_kv_correct()


async def test_a_tokenizer_that_disagrees_is_never_forwarded() -> None:
    async with make_router(control=True, fake=FAKE, local_prefill_max_tokens=200) as h:
        h.app.state.runner.prompts = _FakeVllmTokenizer(shift=True)
        agent = h.conversation("unchecked")
        await agent.say("first question " * 20)
        await agent.say("tool output " * 5)  # local: decode renders it; the check disagrees
        await agent.say("more output " * 5)  # local, planned on prefill's /tokenize
        first_local, second_local = h.d.forwarded_prompt_ids[1:]
        assert first_local is None
        # Decode took vLLM's own ids (prefill's /tokenize), not the router's shifted ones.
        assert second_local is not None and second_local[-1] != 5
        assert h.p.tokenize_calls == 1
        assert await h.metric("kvtether_router_tokenizer_mismatches_total") == 1
        h.assert_kv_correct()


async def test_a_tokenizer_that_differs_from_vllm_is_switched_off() -> None:
    async with make_router(control=True, fake=FAKE) as h:
        h.app.state.runner.prompts = fake = _FakeVllmTokenizer(shift=True)
        agent = h.conversation("wrong-template")
        await agent.say("first question " * 20)
        await agent.say("tool output " * 15)  # planned on wrong ids, then checked
        assert not fake.enabled
        assert await h.metric("kvtether_router_tokenizer_mismatches_total") == 1
        # From then on prefill tokenizes, and reuse fires as without the router's tokenizer.
        turn = await agent.say("more tool output " * 15)
        assert turn.outcome == "fired" and h.p.tokenize_calls == 1
        assert await h.metric("kvtether_prompt_tokenizations_total", 'by="prefill"') == 1
        h.assert_kv_correct()


async def test_the_setting_loads_the_tokenizer_while_the_router_serves(tiny_dir: Path) -> None:
    async with make_router(control=True, fake=FAKE, tokenizer=tiny_dir) as h:
        runner = h.app.state.runner

        async def health() -> str:
            return (await h.client.get("/health")).json()["tokenizer"]

        for _ in range(1200):
            if await health() != "loading":
                break
            await asyncio.sleep(0.05)
        assert await health() == "router"
        assert isinstance(runner.prompts, PromptTokenizer) and runner.prompts.enabled
        # The fake vLLM does not tokenize like the tiny model: the first check switches the
        # router's tokenizer off, and the conversation goes on through prefill's /tokenize.
        agent = h.conversation("real-tokenizer")
        await agent.say("first question " * 20)
        await agent.say("tool output " * 15)
        assert not runner.prompts.enabled and await health() == "prefill"
        turn = await agent.say("more tool output " * 15)
        assert turn.status == 200 and h.p.tokenize_calls == 1


async def test_without_the_setting_prefill_tokenizes() -> None:
    async with make_router(control=True, fake=FAKE) as h:
        assert (await h.client.get("/health")).json()["tokenizer"] == "prefill"
        agent = h.conversation("no-tokenizer")
        await agent.say("first question " * 20)
        await agent.say("tool output " * 15)
        assert h.p.tokenize_calls == 1
        assert h.app.state.runner.prompts is None


def test_a_chat_template_that_does_not_parse_loads_nothing(tiny_dir: Path, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    import shutil

    broken = tmp_path / "model"
    shutil.copytree(tiny_dir, broken)
    (broken / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    assert PromptTokenizer.load(broken) is None
    assert "could not be loaded" in caplog.text


def test_a_growing_conversation_encodes_as_the_whole_text(tok: PromptTokenizer) -> None:
    """Turn after turn, the cached pieces joined are what encoding the whole prompt gives."""
    assert tok._segments is not None  # the tiny model's specials split cleanly
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be terse. " * 40}]
    for turn in range(4):
        messages.append({"role": "user", "content": f"step {turn}: " + "read the file " * 30})
        body = _chat(*messages)
        text = tok._tok.apply_chat_template(conversation=messages, tokenize=False,
                                            add_generation_prompt=True)
        assert tok.token_ids("/v1/chat/completions", body) == list(
            tok._tok(text, add_special_tokens=False)["input_ids"])
        messages.append({"role": "assistant", "content": "done " * 20})
    assert len(tok._segments._cache) >= 4  # the system prompt and earlier messages were kept


def test_the_cache_drops_its_least_recently_used_text(tiny_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtether.router import prompts

    monkeypatch.setattr(prompts._SegmentEncoder, "MAX_CACHED_CHARS", 500)
    fresh = PromptTokenizer.load(tiny_dir)
    assert fresh is not None and fresh._segments is not None
    for i in range(10):
        fresh.token_ids("/v1/completions", {"prompt": f"{i} " + "word " * 40,
                                            "add_special_tokens": False})
    assert fresh._segments._cached_chars <= 500
    assert len(fresh._segments._cache) == 2


def test_a_tokenizer_whose_pieces_encode_differently_encodes_whole_texts() -> None:
    """SentencePiece's leading-space marker goes only before the text's first piece: encoding
    the pieces apart would add it to every one, so such a tokenizer is not split."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvtether.router.prompts import _SegmentEncoder

    vocab = {"<unk>": 0, "<s>": 1, "▁": 2, "▁a": 3, "a": 4, "b": 5, "▁b": 6}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": ["<|sep|>"]})
    assert _SegmentEncoder.for_tokenizer(fast) is None
