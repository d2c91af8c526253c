"""Deciding, before a turn's prefill, what of the conversation's retained KV may be read; and
reporting, after it, what the turn reused of what it could have.

The rule that keeps KV correct: a handle is forwarded only over the tokens that the new prompt
repeats exactly. If the prompt extends everything D holds, the handle goes as is; otherwise it
is cut to the whole blocks of the matching prefix (vLLM's worker aligns D's block ids from the
end, so a handle must never cover more than the prompt repeats).

The outcome (:func:`reuse_outcome`) is an observation, the same for every reuse policy: the
definitions are in :class:`kvtether.protocol.MissCause`.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtether.protocol import (
    MissCause,
    ReuseOutcome,
    reusable_prefix_tokens,
    reuse_verdict,
    truncate_handle,
)
from kvtether.protocol._kv_params import KV_PARAM_BLOCK_HASHES
from kvtether.protocol._prefix import matching_prefix_tokens
from kvtether.router.conversations import Conversation, RetainedKV

__all__ = ["ReusePlan", "plan_reuse", "plan_upstream", "reuse_outcome"]


@dataclass(frozen=True)
class ReusePlan:
    """What the prefill leg gets: a handle to read (maybe cut), or a miss with its cause."""

    handle: dict[str, Any] | None
    expected_reused_tokens: int
    cause: MissCause | None  # None: reuse should fire
    salvaged_tokens: int = 0  # for prefix_break: the whole-block prefix still read
    # The prompt's tokens, where the router saw them (None: prefill's connector checks it).
    prompt_token_ids: list[int] | None = None

    @property
    def new_tokens(self) -> int | None:
        """Prompt tokens the turn must compute when the whole handle is reused; None when
        the prompt's tokens are unknown here."""
        if self.prompt_token_ids is None:
            return None
        return max(0, len(self.prompt_token_ids) - self.expected_reused_tokens)


def plan_reuse(
    conv: Conversation,
    prompt_token_ids: list[int] | None,
    *,
    block_size: int,
    recompute_threshold_tokens: int,
    safety_margin_s: float,
    now_unix_s: float | None = None,
    checked_by_prefill: bool = False,
) -> ReusePlan:
    """``checked_by_prefill``: the prompt's tokens are unknown here (an API vLLM cannot
    tokenize for the router), so the handle goes whole and prefill's connector checks the
    prompt against its block hashes, reading only the whole blocks that match."""
    now = time.time() if now_unix_s is None else now_unix_s
    retained: RetainedKV | None = conv.retained
    if retained is None:
        cause = conv.gone_cause or (
            MissCause.FIRST_TURN if not conv.turns else MissCause.NOT_RETAINED
        )
        return ReusePlan(None, 0, cause)
    if retained.lease_deadline_unix_s - safety_margin_s <= now:
        return ReusePlan(None, 0, MissCause.LEASE_EXPIRED)
    if prompt_token_ids is None and checked_by_prefill and KV_PARAM_BLOCK_HASHES in retained.params:
        if retained.retained_tokens < recompute_threshold_tokens:
            return ReusePlan(None, 0, MissCause.BELOW_THRESHOLD)
        return ReusePlan(copy.deepcopy(retained.params), retained.retained_tokens, None)
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
        return ReusePlan(handle if cause is None else None, reusable if cause is None else 0, cause,
                         prompt_token_ids=prompt_token_ids)
    if match < max(recompute_threshold_tokens, 1):
        return ReusePlan(None, 0, MissCause.PREFIX_BREAK, salvaged_tokens=0)
    handle = truncate_handle(retained.params, match // block_size, block_size)
    if handle is None:  # a hybrid model's handle: read whole or not at all
        return ReusePlan(None, 0, MissCause.PREFIX_BREAK, salvaged_tokens=0)
    return ReusePlan(handle, match, MissCause.PREFIX_BREAK, salvaged_tokens=match)


KVTETHER_PARAM_PREFIX = "kvtether_"


def plan_upstream(conv: Conversation) -> ReusePlan:
    """vLLM's example proxy: the conversation's last handle goes to P as is.

    No prefix check, no truncation, no deadline check: P declines a handle near its expiry
    and recomputes (``kv_load_failure_policy: recompute``), and reads whatever the handle
    covers (wrong KV on a rewritten history, which is what this policy measures).
    """
    retained = conv.retained
    if retained is None:
        cause = conv.gone_cause or (
            MissCause.FIRST_TURN if not conv.turns else MissCause.NOT_RETAINED
        )
        return ReusePlan(None, 0, cause)
    # What vLLM's decode returns, nothing more: a kvtether decode adds block hashes, which a
    # kvtether prefill would check. Without them it reads as upstream's does.
    handle = {k: copy.deepcopy(v) for k, v in retained.params.items()
              if not k.startswith(KVTETHER_PARAM_PREFIX)}
    return ReusePlan(handle, retained.retained_tokens, None)


def reuse_outcome(
    plan: ReusePlan,
    prompt_token_ids: Sequence[int],
    cached_tokens: int,
    previous_token_ids: Sequence[int] | None,
    *,
    conversation: bool,
    decode_lost: bool,
    block_size: int,
    recompute_threshold_tokens: int,
) -> ReuseOutcome:
    """What the turn reused of what it could have (definitions: ``protocol.MissCause``).

    ``previous_token_ids``: what the conversation's last finished turn built (prompt +
    output), whether or not its KV still exists. ``cached_tokens``: what P reported as not
    computed (its own prefix cache plus what it read from D; a failed read shows as fewer).
    ``decode_lost``: the conversation's decode instance was unreachable for the decode leg.

    Where the router itself declined to offer anything although enough matched (fewer than
    the threshold in whole blocks of D's KV matched, or D held fewer than the threshold, or
    the prompt could not be checked), the loss is by design and the plan's cause
    (``prefix_break`` / ``below_threshold``) says so: such a turn is not eligible.
    """
    reused = max(0, min(cached_tokens, len(prompt_token_ids)))
    reusable = 0
    if previous_token_ids:
        reusable = reusable_prefix_tokens(previous_token_ids, prompt_token_ids)
    if not conversation:
        return ReuseOutcome.miss(MissCause.NO_CONVERSATION_ID, reused, reusable)
    if previous_token_ids is None:
        # No earlier turn finished: there is nothing this turn could reuse.
        return ReuseOutcome.miss(MissCause.FIRST_TURN, reused, 0)
    eligible, fired = reuse_verdict(reusable, reused, block_size=block_size,
                                    recompute_threshold_tokens=recompute_threshold_tokens)
    if not eligible:
        diverged = reusable < min(len(previous_token_ids) - 1, len(prompt_token_ids))
        cause = MissCause.PREFIX_BREAK if diverged else MissCause.BELOW_THRESHOLD
        return ReuseOutcome.miss(cause, reused, reusable)
    if fired:
        return ReuseOutcome.hit(reused, reusable)
    # Eligible, and KV was lost: say how.
    if plan.handle is None:
        cause = plan.cause or MissCause.NOT_RETAINED
    elif decode_lost:
        cause = MissCause.DECODE_UNAVAILABLE
    else:
        cause = MissCause.TRANSFER_FAILED
    return ReuseOutcome.miss(cause, reused, reusable)
