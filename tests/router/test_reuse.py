"""What a turn's prefill leg may read of the conversation's retained KV (:func:`plan_reuse`),
without the fake vLLM."""

from __future__ import annotations

import pytest

from kvtether import protocol as p
from kvtether.router.conversations import Conversation
from kvtether.router.reuse import ReusePlan, plan_reuse
from tests.router.kv import BS, NOW, conv, retained


def plan(c: Conversation, prompt: list[int] | None, *, threshold: int = 16,
         margin_s: float = 6.0, now: float = NOW):
    return plan_reuse(c, prompt, block_size=BS, recompute_threshold_tokens=threshold,
                      safety_margin_s=margin_s, now_unix_s=now)


# ---------------------------------------------------------------- plan_reuse
def test_a_prompt_that_extends_everything_held_reads_the_whole_handle() -> None:
    c = conv(retained(100))
    pl = plan(c, list(range(130)))
    assert pl.cause is None and pl.expected_reused_tokens == 100
    assert pl.handle == c.retained.params and pl.handle is not c.retained.params


@pytest.mark.parametrize(("gone", "turns", "cause"), [
    (None, 0, p.MissCause.FIRST_TURN),
    (None, 1, p.MissCause.NOT_RETAINED),
    (p.MissCause.RELEASED, 1, p.MissCause.RELEASED),
    (p.MissCause.EVICTED, 3, p.MissCause.EVICTED),
])
def test_nothing_held_says_why(gone, turns, cause) -> None:
    c = conv(gone_cause=gone)
    c.turns = [p.TurnRecord(turn=i + 1, outcome="fired") for i in range(turns)]
    assert plan(c, list(range(50))) == ReusePlan(None, 0, cause)


def test_a_lease_inside_the_safety_margin_is_not_forwarded() -> None:
    c = conv(retained(100, deadline_in_s=10.0))
    assert plan(c, list(range(130)), now=NOW + 3.9).cause is None
    assert plan(c, list(range(130)), now=NOW + 4.0).cause is p.MissCause.LEASE_EXPIRED


def test_an_unknown_prompt_is_never_guessed() -> None:
    assert plan(conv(retained(100)), None).cause is p.MissCause.PREFIX_BREAK


def test_below_threshold_reads_nothing() -> None:
    pl = plan(conv(retained(20)), list(range(40)), threshold=32)
    assert (pl.handle, pl.expected_reused_tokens, pl.cause) == (None, 0, p.MissCause.BELOW_THRESHOLD)


def test_a_prefix_break_salvages_whole_blocks_only() -> None:
    c = conv(retained(100))
    prompt = list(range(40)) + [-1] * 80
    pl = plan(c, prompt)
    assert pl.cause is p.MissCause.PREFIX_BREAK and pl.salvaged_tokens == 32
    assert pl.handle["remote_block_ids"] == [[0, 1]] and pl.handle["remote_num_tokens"] == 32
    assert c.retained.params["remote_num_tokens"] == 100  # the held handle is not cut


def test_a_prefix_break_too_early_salvages_nothing() -> None:
    pl = plan(conv(retained(100)), list(range(10)) + [-1] * 80)
    assert (pl.handle, pl.salvaged_tokens, pl.cause) == (None, 0, p.MissCause.PREFIX_BREAK)


def test_a_hybrid_models_handle_is_never_cut() -> None:
    """Several KV cache groups: a prefix of one is not the same tokens in another."""
    pl = plan(conv(retained(100, groups=2)), list(range(40)) + [-1] * 80)
    assert (pl.handle, pl.salvaged_tokens, pl.cause) == (None, 0, p.MissCause.PREFIX_BREAK)
