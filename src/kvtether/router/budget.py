"""The retention budget: a cap on retained KV tokens per decode instance.

When a new retention would exceed the cap, the leases with the least expected value go first.
Value of a lease = (share of its retained tokens the next turn is expected to reuse) ×
freshness, where freshness falls with how long the session has been idle relative to the lease
length. A session that said it is idle counts for less; one whose last turn was final, for none.
"""

from __future__ import annotations

import time

from kvtether.protocol import Phase
from kvtether.router.conversations import Conversation

__all__ = ["lease_value", "pick_evictions"]

_PHASE_WEIGHT = {
    None: 1.0,
    Phase.THINKING: 1.0,
    Phase.TOOL_RUNNING: 1.0,
    Phase.IDLE: 0.3,
    Phase.FINAL: 0.0,
}


def lease_value(conv: Conversation, now_unix_s: float, lease_ttl_s: float) -> float:
    r = conv.retained
    if r is None or r.retained_tokens <= 0:
        return 0.0
    reuse_share = 1.0
    if conv.expected_next_prompt_tokens is not None and conv.expected_next_prompt_tokens > 0:
        # A next turn shorter than what is held reuses only its own length.
        reuse_share = min(1.0, conv.expected_next_prompt_tokens / r.retained_tokens)
    idle_s = max(0.0, now_unix_s - conv.last_active_unix_s)
    freshness = 1.0 / (1.0 + idle_s / max(lease_ttl_s, 1e-3))
    return reuse_share * freshness * _PHASE_WEIGHT.get(conv.phase, 1.0)


def pick_evictions(
    candidates: list[Conversation],
    held_tokens: int,
    incoming_tokens: int,
    cap_tokens: int,
    lease_ttl_s: float,
    now_unix_s: float | None = None,
) -> list[Conversation]:
    """Conversations to evict (least valuable first) so ``incoming_tokens`` fit under the cap."""
    now = time.time() if now_unix_s is None else now_unix_s
    excess = held_tokens + incoming_tokens - cap_tokens
    if excess <= 0:
        return []
    ranked = sorted(candidates, key=lambda c: lease_value(c, now, lease_ttl_s))
    out: list[Conversation] = []
    for conv in ranked:
        if excess <= 0:
            break
        assert conv.retained is not None
        out.append(conv)
        excess -= conv.retained.retained_tokens
    return out
