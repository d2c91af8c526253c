"""Reuse outcomes: why a turn missed, the one eligible/fired rule, and the header form."""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict


class MissCause(str, enum.Enum):
    """Why a turn did not reuse what it could have.

    A turn is *eligible* when at least ``kv_recompute_threshold_tokens`` (and at least one) of
    its prompt tokens repeat the sequence its conversation's previous finished turn built
    (``reusable_tokens``). An eligible turn *fires* when the tokens it recomputed of those,
    ``reusable_tokens - reused_tokens``, are fewer than ``max(kv_recompute_threshold_tokens,
    kv_block_size_tokens)`` (recomputing less than that is by design); otherwise it misses,
    and the cause says how the KV was lost. The first four causes, and ``store_unavailable``
    (the router could not know the conversation), are the turns that are not eligible
    (:data:`NOT_ELIGIBLE_CAUSES`).
    """

    FIRST_TURN = "first_turn"  # no earlier turn of the conversation finished
    NO_CONVERSATION_ID = "no_conversation_id"
    BELOW_THRESHOLD = "below_threshold"  # the previous turn's sequence is too short to reuse
    PREFIX_BREAK = "prefix_break"  # the prompt diverged before anything reusable
    LEASE_EXPIRED = "lease_expired"
    RELEASED = "released"
    EVICTED = "evicted"
    DECODE_UNAVAILABLE = "decode_unavailable"
    TRANSFER_FAILED = "transfer_failed"  # a handle went to prefill, and too little was read
    NOT_RETAINED = "not_retained"  # previous turn left no handle (e.g. aborted, or error)
    # The router's shared conversation store did not answer: the turn ran as plain P/D.
    STORE_UNAVAILABLE = "store_unavailable"


# Misses of turns that had nothing (or too little) to reuse: they are not eligible.
NOT_ELIGIBLE_CAUSES = frozenset({
    MissCause.FIRST_TURN, MissCause.NO_CONVERSATION_ID, MissCause.BELOW_THRESHOLD,
    MissCause.PREFIX_BREAK, MissCause.STORE_UNAVAILABLE,
})


def reuse_verdict(
    reusable_tokens: int, reused_tokens: int, *, block_size: int, recompute_threshold_tokens: int
) -> tuple[bool, bool]:
    """``(eligible, fired)`` of a turn, by the rule in :class:`MissCause`: the one definition,
    applied by the router to every turn and by ``kvtether bench`` to every strategy's."""
    eligible = reusable_tokens >= max(recompute_threshold_tokens, 1)
    lost = max(0, reusable_tokens - reused_tokens)
    return eligible, eligible and lost < max(recompute_threshold_tokens, block_size)


class ReuseOutcome(BaseModel):
    """The outcome of one turn: reuse fired, or a miss with its cause."""

    model_config = ConfigDict(frozen=True)

    fired: bool
    cause: MissCause | None = None
    reused_tokens: int = 0
    reusable_tokens: int = 0

    @classmethod
    def hit(cls, reused_tokens: int, reusable_tokens: int = 0) -> ReuseOutcome:
        return cls(fired=True, reused_tokens=reused_tokens, reusable_tokens=reusable_tokens)

    @classmethod
    def miss(
        cls, cause: MissCause, reused_tokens: int = 0, reusable_tokens: int = 0
    ) -> ReuseOutcome:
        return cls(fired=False, cause=cause, reused_tokens=reused_tokens,
                   reusable_tokens=reusable_tokens)

    @property
    def eligible(self) -> bool:
        """The turn had enough to reuse (see :class:`MissCause`): fired or lost KV."""
        return self.fired or self.cause not in NOT_ELIGIBLE_CAUSES

    @property
    def label(self) -> str:
        return format_reuse_header(self)


def format_reuse_header(outcome: ReuseOutcome) -> str:
    if outcome.fired:
        return "fired"
    assert outcome.cause is not None
    return f"miss:{outcome.cause.value}"


def parse_reuse_header(
    value: str | None, reused_tokens: str | None = None, reusable_tokens: str | None = None
) -> ReuseOutcome | None:
    """Parse ``X-KVTether-Reuse`` (and the reused / reusable tokens headers); ``None`` if
    absent or foreign."""
    if not value:
        return None
    tokens = int(reused_tokens) if reused_tokens and reused_tokens.isdigit() else 0
    reusable = int(reusable_tokens) if reusable_tokens and reusable_tokens.isdigit() else 0
    if value == "fired":
        return ReuseOutcome.hit(tokens, reusable)
    if value.startswith("miss:"):
        try:
            return ReuseOutcome.miss(MissCause(value[5:]), tokens, reusable)
        except ValueError:
            return None
    return None
