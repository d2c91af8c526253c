"""Prefill-side prefix check of decode handles (no vLLM)."""

from __future__ import annotations

from typing import Any

import pytest

from kvtether.connector._prefix import (
    PullRecord,
    annotate_handle,
    apply_prefix_decision,
    decide_prefix,
)
from kvtether.protocol import PullOutcome

BS = 4


def decode_handle(retained: list[int], n_blocks: int | None = None) -> dict[str, Any]:
    """A handle as decode publishes it for a sequence whose KV covers ``retained``."""
    n_blocks = n_blocks if n_blocks is not None else -(-len(retained) // BS)
    handle: dict[str, Any] = {
        "do_remote_decode": True,
        "remote_block_ids": [list(range(100, 100 + n_blocks))],
        "remote_num_tokens": len(retained),
    }
    annotate_handle(handle, retained, BS)
    return handle


SEQ = list(range(1, 15))  # 14 tokens on decode: 3 full blocks + 2 in a partial block


def test_extending_prompt_reuses_everything_including_partial_block() -> None:
    params = decode_handle(SEQ)
    decision = decide_prefix(params, SEQ + [99, 98, 97])
    assert (decision.match_tokens, decision.keep_blocks, decision.prefix_break) == (14, None, False)
    assert apply_prefix_decision(params, decision)
    assert params["remote_block_ids"] == [[100, 101, 102, 103]]
    assert params["remote_num_tokens"] == 14


def test_rewritten_middle_keeps_only_matching_whole_blocks() -> None:
    params = decode_handle(SEQ)
    prompt = SEQ.copy()
    prompt[9] = -1  # inside block 2
    decision = decide_prefix(params, prompt + [5, 6])
    assert (decision.match_tokens, decision.keep_blocks, decision.prefix_break) == (8, 2, True)
    assert apply_prefix_decision(params, decision)
    assert params["remote_block_ids"] == [[100, 101]]
    assert params["remote_num_tokens"] == 8


def test_changed_partial_block_falls_back_to_whole_blocks() -> None:
    params = decode_handle(SEQ)
    prompt = SEQ[:13] + [-5, 50]
    decision = decide_prefix(params, prompt)
    assert (decision.match_tokens, decision.keep_blocks, decision.prefix_break) == (12, 3, True)


def test_prompt_ending_inside_partial_block_is_not_a_break() -> None:
    decision = decide_prefix(decode_handle(SEQ), SEQ[:13])
    assert (decision.match_tokens, decision.keep_blocks, decision.prefix_break) == (12, 3, False)


def test_first_block_differs_means_no_read_but_block_ids_kept_for_the_free_notice() -> None:
    params = decode_handle(SEQ)
    decision = decide_prefix(params, [0] + SEQ[1:] + [7])
    assert (decision.match_tokens, decision.keep_blocks, decision.prefix_break) == (0, 0, True)
    assert not apply_prefix_decision(params, decision)
    assert params["remote_block_ids"] == [[100, 101, 102, 103]]


def test_handle_without_hashes_follows_upstream_unless_required() -> None:
    params = {"do_remote_decode": True, "remote_block_ids": [[1, 2]], "remote_num_tokens": 8}
    assert decide_prefix(params, SEQ).keep_blocks is None
    strict = decide_prefix(params, SEQ, require_hashes=True)
    assert strict.keep_blocks == 0 and not strict.checked


@pytest.mark.parametrize(
    "tamper",
    [
        lambda p: p.update(kvtether_block_size=0),
        lambda p: p.update(kvtether_block_hashes=p["kvtether_block_hashes"][:1]),
        lambda p: p.update(remote_num_tokens=40),
    ],
)
def test_inconsistent_handle_is_not_read(tamper: Any) -> None:
    params = decode_handle(SEQ)
    tamper(params)
    assert decide_prefix(params, SEQ + [1]).keep_blocks == 0


def test_multi_group_handle_is_not_cut() -> None:
    params = decode_handle(SEQ)
    params["remote_block_ids"] = [[1, 2, 3, 4], [9]]
    prompt = SEQ.copy()
    prompt[9] = -1
    assert not apply_prefix_decision(params, decide_prefix(params, prompt))


def test_pull_record_reports_outcomes() -> None:
    decision = decide_prefix(decode_handle(SEQ), SEQ + [1])
    pulled = PullRecord(decision, allowed=True)
    pulled.allocated(14)
    assert pulled.as_params()["kvtether_pull"] == "pulled"
    assert pulled.as_params()["kvtether_reused_tokens"] == 14
    pulled.failed()
    assert pulled.as_params()["kvtether_pull"] == PullOutcome.FAILED.value
    assert pulled.as_params()["kvtether_reused_tokens"] == 0

    local = PullRecord(decision, allowed=True, offered_tokens=0)
    local.allocated(0)
    assert local.outcome is PullOutcome.LOCAL_HIT
    small = PullRecord(decision, allowed=True, offered_tokens=3)
    small.allocated(0)
    assert small.outcome is PullOutcome.BELOW_THRESHOLD
    refused = PullRecord(decision, allowed=False, offered_tokens=14)
    refused.allocated(0)
    report = refused.as_params()
    assert report["kvtether_pull"] == "no_match" and report["kvtether_remote_tokens"] == 14


def test_a_handle_the_router_cut_still_passes_the_prefill_check() -> None:
    # The router salvages a prefix break by cutting D's handle to the matching whole blocks;
    # prefill's check must then read those blocks, not call the cut handle inconsistent.
    from kvtether.protocol import truncate_handle as router_cut

    cut = router_cut(decode_handle(SEQ), 2, BS)
    assert cut is not None
    prompt = SEQ[:8] + [77, 76, 75, 74, 73]  # repeats D's first two blocks, then differs
    decision = decide_prefix(cut, prompt)
    assert decision.match_tokens == 8 and not decision.prefix_break
    assert apply_prefix_decision(cut, decision)
    assert cut["remote_block_ids"] == [[100, 101]] and cut["remote_num_tokens"] == 8
