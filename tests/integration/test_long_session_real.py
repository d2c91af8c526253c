"""A coding-agent-shaped session through its whole life on the real `cpu-agents` stack
(benchmarks/long_session.py): 40+ turns growing past 32K tokens, a compaction, turns until the
model's 64K context is full, an over-limit prompt, a release.
"""

from __future__ import annotations

import httpx
import pytest

from benchmarks.long_session import run

pytestmark = pytest.mark.vllm


def test_a_long_session_compacts_reaches_the_limit_and_leaves_nothing_held(agents_stack):
    session = run(agents_stack.base_url, agents_stack.model, conversation_id="long-session")
    steps = session.steps
    growing = [s for s in steps if s.phase == "growing"]
    (compaction,) = [s for s in steps if s.phase == "compaction"]
    compacted = [s for s in steps if s.phase == "compacted"]
    over = steps[-1]

    assert len(growing) >= 40 and max(s.prompt_tokens for s in growing) > 32000
    # Every turn after the first reused the conversation's KV, before and after compaction.
    assert growing[0].outcome == "miss:first_turn"
    assert all(s.outcome == "fired" for s in growing[1:]), [s.outcome for s in growing]
    assert compaction.status == 200  # (prefill's prefix cache may hold the system prompt)
    assert compacted and all(s.outcome == "fired" for s in compacted), compacted
    # The rewritten history superseded the old sequence: one sequence's KV again.
    assert compaction.branches_holding == 1
    assert compaction.retained_tokens < compaction.prompt_tokens + 300
    assert all(s.branches_holding == 1 for s in compacted)
    # Until the context is full: vLLM's refusal, in the OpenAI shape, and nothing new held.
    assert over.phase == "over_limit" and over.status == 400, over
    assert "context length" in over.error, over.error
    assert over.retained_tokens == steps[-2].retained_tokens
    assert compacted[-1].prompt_tokens > 0.85 * session.max_model_len
    # The release at the end frees everything the conversation held.
    assert session.released_tokens == over.retained_tokens
    status = httpx.get(f"{agents_stack.base_url}/v1/sessions/long-session", timeout=60).json()
    assert all(b["retained_tokens"] == 0 for b in [status, *status["branches"]]), status
