"""Retained KV and conversations for the router's pure decisions (plans, budget)."""

from __future__ import annotations

from kvtether.router.conversations import Conversation, RetainedKV

BS = 16
NOW = 1_000_000.0


def retained(n_tokens: int, *, deadline_in_s: float = 60.0, groups: int = 1,
             token_ids: list[int] | None = None) -> RetainedKV:
    n_blocks = -(-n_tokens // BS)
    return RetainedKV(
        decode_instance="decode-0",
        params={"do_remote_decode": True, "remote_num_tokens": n_tokens,
                "remote_block_ids": [list(range(g * 100, g * 100 + n_blocks))
                                     for g in range(groups)]},
        token_ids=list(range(n_tokens)) if token_ids is None else token_ids,
        retained_tokens=n_tokens,
        lease_deadline_unix_s=NOW + deadline_in_s,
        created_unix_s=NOW,
    )


def conv(r: RetainedKV | None = None, **kw) -> Conversation:
    return Conversation("c", retained=r, last_active_unix_s=NOW, **kw)
