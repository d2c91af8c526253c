"""A turn as data: where it computes, what it reads, which lease it holds and how its
outcome is computed, decided before any leg is sent (:class:`TurnPlan`); and the pure
functions the turn runner (:mod:`.turns`) derives the decode leg and the outcome from."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtether import protocol as p
from kvtether.protocol import _kv_params as kv_keys
from kvtether.router.backends import Backend
from kvtether.router.conversations import RetainedKV
from kvtether.router.reuse import ReusePlan, reuse_outcome
from kvtether.router.settings import RouterSettings

if TYPE_CHECKING:
    from kvtether.router.legs import PrefillResult

__all__ = ["Compute", "Tokenized", "TurnPlan", "decode_body", "prompt_work", "turn_outcome"]

# Request bytes per prompt token, to guess a leg's work where the router has no token ids.
_BYTES_PER_TOKEN = 4


class Compute(enum.Enum):
    """Where a turn's prompt is computed."""

    PREFILL_LEG = "prefill_leg"  # on a prefill instance, reading the plan's handle if any
    LOCAL = "local"  # on the decode instance holding the conversation's KV (few new tokens)
    DECODE_ALONE = "decode_alone"  # on decode, from scratch (the prefill leg timed out)


@dataclass(frozen=True)
class Tokenized:
    """A prompt's token ids as the router got them before the turn's legs."""

    ids: list[int] | None  # None: could not be had (an API vLLM cannot tokenize)
    tokenize_s: float  # how long it took
    by_router: bool  # from the router's own tokenizer (checked against what vLLM reports)


@dataclass(frozen=True)
class TurnPlan:
    """One turn, decided: the executor (:class:`.turns.TurnRunner`) only runs it."""

    reuse: ReusePlan  # what the prefill leg (or decode's own prefill) reads
    compute: Compute
    prefill: Backend  # the prefill instance the leg goes to first
    refused: frozenset[str]  # prefill instances that refused this turn a connection
    # The decode instance holding the KV the turn reads: its handle's, or for a local
    # prefill the one whose prefix cache the turn is computed on.
    holder: Backend | None
    # The conversation's retained KV this turn took: no release or eviction touches it.
    taken: RetainedKV | None
    preferred: str | None  # the decode instance the decode leg goes to first
    work_tokens: int  # prompt tokens the turn computes (prefill's or decode's backlog)
    previous: list[int] | None  # the sequence the conversation's last finished turn built
    conversation: bool  # the turn belongs to a conversation
    had_retained: bool  # the conversation retained KV when the turn began
    store_down: bool  # the conversation store did not answer: plain P/D
    from_prefix_cache: bool = False  # a local prefill on KV whose lease had gone
    router_ids: list[int] | None = None  # the router's own token ids of the prompt

    @property
    def local(self) -> bool:
        return self.compute is Compute.LOCAL


def prompt_work(body: dict[str, Any], plan: ReusePlan, ids: list[int] | None) -> int:
    """Prompt tokens a prefill leg will compute, for the backlog count: the tokens past the
    handle where the router tokenized the prompt (``ids``: while choosing its branch), else
    the whole request at ~4 bytes a token (a first turn or a miss; prefill's prefix cache may
    hold some of it)."""
    if plan.new_tokens is not None:
        return plan.new_tokens
    if ids is not None:
        return max(0, len(ids) - plan.expected_reused_tokens)
    return len(json.dumps(body, separators=(",", ":"))) // _BYTES_PER_TOKEN


def decode_body(body: dict[str, Any], token_ids_in_answer: bool, plan: TurnPlan,
                leg: PrefillResult | None, handle_key: str | None,
                lease_s: float, prompt_ids: list[int] | None = None) -> dict[str, Any]:
    """The decode leg's request: the client's, with what decode reads and keeps, and
    ``prompt_ids``, the prompt's token ids decode takes instead of rendering the chat again
    (vLLM's ``kv_transfer_params["prompt_token_ids"]``; chat completions only)."""
    out = dict(body)
    if token_ids_in_answer:
        out["return_token_ids"] = True
    if plan.local:
        out["kv_transfer_params"] = {kv_keys.KV_PARAM_LOCAL_PREFILL: True}
    if leg is not None:
        out["kv_transfer_params"] = dict(leg.params)
        if not token_ids_in_answer:
            # D reports the sequence it retains (this API's answer carries no token ids).
            out["kv_transfer_params"][kv_keys.KV_PARAM_REPORT_TOKEN_IDS] = True
    if handle_key is not None:
        # Only the kvtether connector reads these: the lease D holds this turn's KV under.
        out["kv_transfer_params"].update({
            kv_keys.KV_PARAM_HANDLE_KEY: handle_key,
            kv_keys.KV_PARAM_LEASE_TTL_S: lease_s,
        })
    if prompt_ids and "kv_transfer_params" in out:
        out["kv_transfer_params"]["prompt_token_ids"] = prompt_ids
    return out


def turn_outcome(plan: TurnPlan, leg: PrefillResult | None, decode: Backend,
                 s: RouterSettings) -> p.ReuseOutcome:
    """What the turn reused, once its decode leg is open on ``decode``."""
    block, threshold = s.kv_block_size_tokens, s.kv_recompute_threshold_tokens
    reuse = plan.reuse
    if plan.local:
        assert reuse.prompt_token_ids is not None
        moved = decode.name != plan.preferred  # another decode instance recomputes it all
        outcome = reuse_outcome(
            reuse, reuse.prompt_token_ids, 0 if moved else _local_prefix_hit(reuse, block),
            plan.previous, conversation=True, decode_lost=moved, block_size=block,
            recompute_threshold_tokens=threshold,
        )
    elif leg is not None:
        outcome = reuse_outcome(
            reuse, leg.prompt_token_ids, leg.cached_tokens, plan.previous,
            conversation=plan.conversation,
            decode_lost=plan.had_retained and plan.preferred not in (None, decode.name),
            block_size=block, recompute_threshold_tokens=threshold,
        )
    else:
        outcome = _decode_alone_outcome(reuse, plan.conversation, plan.previous)
    if plan.store_down:
        outcome = p.ReuseOutcome.miss(p.MissCause.STORE_UNAVAILABLE, outcome.reused_tokens)
    return outcome


def _decode_alone_outcome(
    plan: ReusePlan, conversation: bool, previous: list[int] | None
) -> p.ReuseOutcome:
    """A turn decode answered alone (its prefill leg timed out): nothing was reused; an
    eligible turn lost what its handle covered."""
    if not conversation:
        return p.ReuseOutcome.miss(p.MissCause.NO_CONVERSATION_ID)
    if previous is None:
        return p.ReuseOutcome.miss(p.MissCause.FIRST_TURN)
    if plan.cause is not None:  # nothing offered, or a salvage (prefix_break)
        return p.ReuseOutcome.miss(plan.cause, 0, plan.salvaged_tokens)
    if plan.handle is None:
        return p.ReuseOutcome.miss(p.MissCause.NOT_RETAINED)
    return p.ReuseOutcome.miss(p.MissCause.TRANSFER_FAILED, 0, plan.expected_reused_tokens)


def _local_prefix_hit(plan: ReusePlan, block_size: int) -> int:
    """Prompt tokens decode's prefix cache holds for a local-prefill turn: the whole blocks of
    what it retains (vLLM hashes whole blocks only)."""
    return plan.expected_reused_tokens // block_size * block_size
