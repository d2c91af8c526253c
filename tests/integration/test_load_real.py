"""Load on the real P/D stack (tiny model): 8 conversations at once, heartbeats between turns.

No turn may fail, every answer is token-identical to the colocated reference, and every turn
after the first reuses KV: read from decode, or (``miss:below_threshold``) already on prefill.
"""

from __future__ import annotations

import pytest

from .driver import reused, run_conversations, summary

pytestmark = pytest.mark.vllm

CONVERSATIONS = 8
TURNS = 4


def test_eight_concurrent_conversations(pd_stack, reference_vllm):
    turns = run_conversations(pd_stack.base_url, reference_vllm.base_url, pd_stack.model,
                              conversations=CONVERSATIONS, turns=TURNS)
    assert [t for t in turns if t.status != 200] == []  # no failed turn
    assert len(turns) == CONVERSATIONS * TURNS
    assert all(t.identical for t in turns), [t for t in turns if not t.identical]
    # Eligible turns read decode's KV; "below_threshold" is a turn whose prompt prefill already
    # holds but for fewer new tokens than vLLM's read threshold: reused locally, not read.
    assert all(reused(t) for t in turns if t.turn > 1), turns
    print("\n" + summary(turns))
