"""Several live sequences (branches) in one conversation.

A main agent and its subagents sharing one session id, parallel tool-calling branches of a
graph, a retry: these send turns of one conversation that do not extend one sequence, and
sometimes at the same time. Each branch is stored as a conversation of its own (so leases,
budgets, the Redis store and the session API work on it unchanged): branch 0 is the
conversation id itself, branch k is ``<id>~b<k>`` (k < ``max_branches``).

A turn is matched to the branch whose sequence its prompt extends (chat and completions: the
prompt's token ids against each branch's); Responses and Messages, whose prompt the router
cannot tokenize, take the most recently active idle branch. A turn runs on a busy branch's
sibling instead of waiting: turns of different branches run in parallel, turns of one branch
stay ordered (one at a time). A prompt that shares less than half of an idle branch's sequence
opens a new branch and leaves that one's KV for the turns that continue it; one that shares more
(a retry, an edit near the end) stays on the branch and reads the matching whole blocks. A
prompt that shares less than one block with every branch (a harness's side request: OpenCode's
title request, a summariser; or the agent's first turn after one) starts a branch of its own,
whose first turn is a ``first_turn``. A shorter prompt that shares the beginning of an idle
branch but less than half of it is that sequence rewritten (a harness compacting its history):
the new branch *supersedes* the old one, whose KV the router releases at once instead of
keeping it under heartbeats until its lease lapses or the budget evicts it.
Only when every branch is busy does a turn wait (``store_lock_wait_s``, then 409).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from kvtether.protocol import MissCause
from kvtether.protocol._prefix import common_prefix_tokens
from kvtether.router.conversations import (
    Conversation,
    ConversationBusyError,
    ConversationStore,
    HeldConversation,
)

__all__ = ["BRANCH_SEPARATOR", "BranchChoice", "branch_ids", "hold_branch", "is_branch_id"]

BRANCH_SEPARATOR = "~b"


def branch_ids(conversation_id: str, max_branches: int) -> list[str]:
    """Every branch's id, branch 0 (the conversation itself) first."""
    return [conversation_id] + [f"{conversation_id}{BRANCH_SEPARATOR}{k}"
                                for k in range(1, max_branches)]


def is_branch_id(conversation_id: str) -> bool:
    head, sep, k = conversation_id.rpartition(BRANCH_SEPARATOR)
    return bool(head and sep and k.isdigit())


@dataclass
class BranchChoice:
    held: HeldConversation
    prompt_ids: list[int] | None  # tokenized while choosing (chat / completions), else None
    superseded: str | None = None  # a branch this turn's prompt rewrites (release its KV)


async def hold_branch(
    store: ConversationStore, conversation_id: str, tenant: str, *, max_branches: int,
    wait_s: float, tokenize: Callable[[], Awaitable[list[int] | None]] | None,
    related_tokens: int = 1,
) -> BranchChoice:
    """Hold the branch this turn continues (or a new one); raises
    :class:`ConversationBusyError` when every branch is busy past ``wait_s``.

    ``tokenize``: the prompt's token ids (None where the router cannot see them).
    ``related_tokens``: a new branch whose prompt repeats fewer of its closest sibling's
    tokens than this shares nothing with it (its first turn is a ``first_turn``).
    """
    ids = branch_ids(conversation_id, max_branches)
    views = await asyncio.gather(*(store.read(bid, tenant) for bid in ids))
    existing = [(bid, v) for bid, v in zip(ids, views, strict=True) if v is not None]
    prompt = None
    if tokenize is not None and any(v.last_token_ids is not None for _, v in existing):
        prompt = await tokenize()
    ranked = _rank(existing, prompt)
    partial: list[str] = []
    for bid, share in ranked:
        if share is not None and share < 0.5:
            partial.append(bid)
            continue
        held = await _lock_now(store, bid, tenant)
        if held is not None:
            return BranchChoice(held, prompt)
    taken = {bid for bid, _ in existing}
    for bid in ids:  # open a new branch
        if bid not in taken and (held := await _lock_now(store, bid, tenant)) is not None:
            superseded = None
            if existing and not held.conv.turns:
                closest_id = ranked[0][0]
                closest = dict(existing)[closest_id]
                if _related(closest, prompt, related_tokens):
                    _seed(held.conv, closest)
                    if closest_id in partial and _shorter(prompt, closest):
                        superseded = closest_id
            return BranchChoice(held, prompt, superseded)
    for bid in partial:  # no room: the idle branch that shares the most
        if (held := await _lock_now(store, bid, tenant)) is not None:
            return BranchChoice(held, prompt)
    best = ranked[0][0] if ranked else conversation_id
    return BranchChoice(await store.lock(best, tenant, wait_s=wait_s), prompt)


def _seed(branch: Conversation, closest: Conversation) -> None:
    """A new branch starts from its closest sibling's sequence and parent: its first turn's
    outcome says how much of that sequence it repeats (``prefix_break``, not ``first_turn``),
    and nothing is read, so the sibling keeps its KV."""
    if closest.last_token_ids is not None:
        branch.last_token_ids = closest.last_token_ids
        branch.gone_cause = MissCause.PREFIX_BREAK
    branch.parent_id = closest.parent_id


def _related(closest: Conversation, prompt: list[int] | None, min_tokens: int) -> bool:
    seq = closest.last_token_ids
    if prompt is None or seq is None:
        return True
    return common_prefix_tokens(seq, prompt) >= min_tokens


def _shorter(prompt: list[int] | None, than: Conversation) -> bool:
    return (prompt is not None and than.last_token_ids is not None
            and len(prompt) < len(than.last_token_ids))


async def _lock_now(store: ConversationStore, bid: str, tenant: str) -> HeldConversation | None:
    """Hold the branch (creating it) unless a turn has it."""
    try:
        return await store.lock(bid, tenant, wait_s=0)
    except ConversationBusyError:
        return None


def _rank(existing: Sequence[tuple[str, Conversation]],
          prompt: list[int] | None) -> list[tuple[str, float | None]]:
    """Branches in the order to try, each with the share of its sequence the prompt repeats
    (None: unknown, the prompt or the branch's sequence is not known)."""
    scored = []
    for bid, conv in existing:
        seq = conv.last_token_ids
        if prompt is None or seq is None or len(seq) == 0:
            share, matched = None, 0
        else:
            matched = common_prefix_tokens(seq, prompt)
            share = matched / len(seq)
        scored.append((bid, share, matched, conv.last_active_unix_s))
    # Known matches first, most matched tokens first; then the most recently active.
    scored.sort(key=lambda x: (x[1] is None, -x[2], -x[3]))
    return [(bid, share) for bid, share, _, _ in scored]
