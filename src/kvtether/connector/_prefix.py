"""Prefix identity of decode-held KV: what decode adds to a handle, what prefill checks.

Upstream vLLM reads a decode handle by position: the prefill worker lines up the last N of
decode's block ids with its own N uncached blocks, whatever tokens they hold. If the client
rewrote history (stripped reasoning, edited a message), prefill silently reads KV of other
tokens. So decode adds chained block hashes of the tokens it retains, and prefill reuses only
the whole-block prefix its prompt repeats, by truncating the handle before upstream code sees
it. Plain Python, no vLLM: the connector calls these from its scheduler hooks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtether.protocol import (
    PullOutcome,
    block_hashes,
    tail_block_hash,
)
from kvtether.protocol._kv_params import (
    KV_PARAM_BLOCK_HASHES,
    KV_PARAM_BLOCK_SIZE,
    KV_PARAM_PREFIX_BREAK,
    KV_PARAM_PREFIX_MATCH_TOKENS,
    KV_PARAM_PULL,
    KV_PARAM_REMOTE_TOKENS,
    KV_PARAM_REUSED_TOKENS,
    KV_PARAM_TAIL_HASH,
)
from kvtether.protocol import truncate_handle

__all__ = [
    "PrefixDecision", "PullRecord", "annotate_handle", "apply_prefix_decision", "decide_prefix",
]


def annotate_handle(handle: dict[str, Any], token_ids: Sequence[int], block_size: int) -> None:
    """Decode side: add the prefix identity of ``token_ids`` (the KV it retains) to a handle."""
    handle[KV_PARAM_BLOCK_SIZE] = block_size
    handle[KV_PARAM_BLOCK_HASHES] = block_hashes(token_ids, block_size)
    handle[KV_PARAM_TAIL_HASH] = tail_block_hash(token_ids, block_size)


@dataclass(frozen=True)
class PrefixDecision:
    """How much of a decode handle a prompt may reuse."""

    remote_tokens: int  # tokens decode offered
    match_tokens: int  # leading offered tokens the prompt is known to repeat
    keep_blocks: int | None  # truncate the handle to this many blocks; None: use it whole
    prefix_break: bool  # the prompt differs from decode's sequence somewhere it was compared
    checked: bool  # the handle carried hashes


def decide_prefix(
    params: dict[str, Any], prompt: Sequence[int], *, require_hashes: bool = False
) -> PrefixDecision:
    """Prefill side: compare a handle's hashes with the prompt's."""
    remote_tokens = _int(params.get("remote_num_tokens"))
    hashes = params.get(KV_PARAM_BLOCK_HASHES)
    block_size = params.get(KV_PARAM_BLOCK_SIZE)
    if hashes is None:
        # A handle from a decode without kvtether: upstream behaviour, unless told otherwise.
        if require_hashes:
            return PrefixDecision(remote_tokens, 0, 0, False, False)
        return PrefixDecision(remote_tokens, remote_tokens, None, False, False)
    if (
        not isinstance(block_size, int)
        or block_size <= 0
        or not isinstance(hashes, list)
        or len(hashes) != remote_tokens // block_size
    ):
        return PrefixDecision(remote_tokens, 0, 0, False, True)  # inconsistent: do not read
    ours = block_hashes(prompt, block_size)
    k = 0
    while k < min(len(hashes), len(ours)) and hashes[k] == ours[k]:
        k += 1
    if k == len(hashes):
        if remote_tokens == k * block_size:
            return PrefixDecision(remote_tokens, remote_tokens, None, False, True)
        tail = params.get(KV_PARAM_TAIL_HASH)
        if isinstance(tail, str) and len(prompt) >= remote_tokens:
            if tail_block_hash(prompt[:remote_tokens], block_size) == tail:
                return PrefixDecision(remote_tokens, remote_tokens, None, False, True)
            return PrefixDecision(remote_tokens, k * block_size, k, True, True)
        # No tail hash, or the prompt ends inside decode's partial block: whole blocks only.
        return PrefixDecision(remote_tokens, k * block_size, k, False, True)
    prefix_break = k < len(ours)  # a block both sides have differs
    return PrefixDecision(remote_tokens, k * block_size, k, prefix_break, True)


def apply_prefix_decision(params: dict[str, Any], decision: PrefixDecision) -> bool:
    """Apply a decision to ``params`` in place; False when nothing may be read.

    A handle with nothing to read keeps its block ids: upstream then sends decode the
    "done" notification without reading, and decode frees the blocks at once. The cut itself
    is :func:`kvtether.protocol.truncate_handle`, the one the router uses too.
    """
    k = decision.keep_blocks
    if k is None:
        return True
    if k == 0:
        return False
    cut = truncate_handle(params, k, params[KV_PARAM_BLOCK_SIZE])
    if cut is None:
        return False
    params["remote_block_ids"] = cut["remote_block_ids"]
    params["remote_num_tokens"] = cut["remote_num_tokens"]
    return True


@dataclass
class PullRecord:
    """What one prefill request did with a decode handle; reported in its response."""

    decision: PrefixDecision
    allowed: bool
    offered_tokens: int = 0  # tokens upstream would load beyond the local prefix cache
    reused_tokens: int = 0
    outcome: PullOutcome | None = None

    def allocated(self, num_external_tokens: int) -> None:
        """The scheduler allocated blocks; ``num_external_tokens`` will be read from decode."""
        self.reused_tokens = num_external_tokens
        if num_external_tokens > 0:
            self.outcome = PullOutcome.PULLED
        elif not self.allowed:
            self.outcome = PullOutcome.NO_MATCH
        elif self.offered_tokens <= 0:
            self.outcome = PullOutcome.LOCAL_HIT
        else:
            self.outcome = PullOutcome.BELOW_THRESHOLD

    def failed(self) -> None:
        self.reused_tokens = 0
        self.outcome = PullOutcome.FAILED

    def as_params(self) -> dict[str, Any]:
        outcome = self.outcome or (PullOutcome.PULLED if self.allowed else PullOutcome.NO_MATCH)
        return {
            KV_PARAM_PULL: outcome.value,
            KV_PARAM_REUSED_TOKENS: self.reused_tokens,
            KV_PARAM_REMOTE_TOKENS: self.decision.remote_tokens,
            KV_PARAM_PREFIX_MATCH_TOKENS: self.decision.match_tokens,
            KV_PARAM_PREFIX_BREAK: self.decision.prefix_break,
        }


def _int(value: Any) -> int:
    return value if isinstance(value, int) and value > 0 else 0
