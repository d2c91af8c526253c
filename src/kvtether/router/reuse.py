"""Deciding, before a turn's prefill, what of the conversation's retained KV may be read.

The rule that keeps KV correct: a handle is forwarded only over the tokens that the new prompt
repeats exactly. If the prompt extends everything D holds, the handle goes as is; otherwise it
is cut to the whole blocks of the matching prefix (vLLM's worker aligns D's block ids from the
end, so a handle must never cover more than the prompt repeats).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

from kvtether.protocol import MissCause, matching_prefix_tokens, truncate_handle
from kvtether.router.conversations import Conversation, RetainedKV

__all__ = ["ReusePlan", "plan_reuse", "truncate_handle"]


@dataclass(frozen=True)
class ReusePlan:
    """What the prefill leg gets: a handle to read (maybe cut), or a miss with its cause."""

    handle: dict[str, Any] | None
    expected_reused_tokens: int
    cause: MissCause | None  # None: reuse should fire
    salvaged_tokens: int = 0  # for prefix_break: the whole-block prefix still read


def plan_reuse(
    conv: Conversation,
    prompt_token_ids: list[int] | None,
    *,
    block_size: int,
    recompute_threshold_tokens: int,
    safety_margin_s: float,
    now_unix_s: float | None = None,
) -> ReusePlan:
    now = time.time() if now_unix_s is None else now_unix_s
    retained: RetainedKV | None = conv.retained
    if retained is None:
        cause = conv.gone_cause or (
            MissCause.FIRST_TURN if not conv.turns else MissCause.NOT_RETAINED
        )
        return ReusePlan(None, 0, cause)
    if retained.lease_deadline_unix_s - safety_margin_s <= now:
        return ReusePlan(None, 0, MissCause.LEASE_EXPIRED)
    if prompt_token_ids is None:
        # Could not see the prompt's tokens: reading would be a guess, so don't.
        return ReusePlan(None, 0, MissCause.PREFIX_BREAK)

    held = retained.token_ids[: retained.retained_tokens]
    match = matching_prefix_tokens(held, prompt_token_ids, block_size)
    full = len(held) < len(prompt_token_ids) and prompt_token_ids[: len(held)] == held
    if full:
        handle = copy.deepcopy(retained.params)
        reusable = len(held)
        cause = None if reusable >= recompute_threshold_tokens else MissCause.BELOW_THRESHOLD
        return ReusePlan(handle if cause is None else None, reusable if cause is None else 0, cause)
    if match < max(recompute_threshold_tokens, 1):
        return ReusePlan(None, 0, MissCause.PREFIX_BREAK, salvaged_tokens=0)
    handle = truncate_handle(retained.params, match // block_size, block_size)
    if handle is None:  # a hybrid model's handle: read whole or not at all
        return ReusePlan(None, 0, MissCause.PREFIX_BREAK, salvaged_tokens=0)
    return ReusePlan(handle, match, MissCause.PREFIX_BREAK, salvaged_tokens=match)
