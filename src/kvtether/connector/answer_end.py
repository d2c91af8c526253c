"""A vLLM logits processor that ends every answer after a fixed number of tokens.

For the offline test models (``agents``): a random model rarely emits its end token by
itself, and an answer cut by a length cap ends with ``finish_reason: length`` /
``stop_reason: max_tokens``, which coding-agent harnesses report as an error. Ending the
answer with the model's own end token after ``answer_tokens`` tokens (from the model
directory's ``kvtether-model.json``) gives a normal stop. Served with
``--logits-processors kvtether.connector.answer_end:EndAnswer``; a model directory without the
setting leaves every answer as the model makes it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

__all__ = ["EndAnswer"]

_INFO_FILE = "kvtether-model.json"  # kvtether.stack.models.MODEL_INFO_FILE


def _answer_tokens(model: str) -> int:
    try:
        info = json.loads((Path(model) / _INFO_FILE).read_text())
    except (OSError, ValueError):
        return 0
    value = info.get("answer_tokens") if isinstance(info, dict) else None
    return value if isinstance(value, int) and value > 0 else 0


class EndAnswer(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.after = _answer_tokens(str(vllm_config.model_config.model))
        eos = getattr(vllm_config.model_config.hf_text_config, "eos_token_id", None)
        self.eos = eos[0] if isinstance(eos, list) else eos
        # batch row -> the request's running output token ids (vLLM keeps the list current)
        self.outputs: dict[int, Sequence[int]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it forces the end token

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if self.after and self.eos is not None:
            process_dict_updates(self.outputs, batch_update, lambda _p, _prompt, out: out)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows = [row for row, out in self.outputs.items() if len(out) >= self.after]
        if rows:
            logits[rows] = float("-inf")
            logits[rows, self.eos] = 0.0
        return logits
