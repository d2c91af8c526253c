"""The reuse policies (``RouterSettings.reuse_policy``), one object each, picked once from the
settings: what a turn's prefill leg may read, where its decode leg goes, and what is kept of
decode's KV after the answer.

``kvtether`` checks the prompt against what decode retains, keeps decode affinity and holds
each turn's KV under a lease. ``upstream`` does what vLLM's example proxy does (the last handle
forwarded as is, decode round-robin, vLLM's own TTL). ``off`` reuses nothing (one-way P/D).
How a turn's outcome is reported is the same under all three (:func:`.reuse.reuse_outcome`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvtether import protocol as p
from kvtether.router._deps import RouterDeps
from kvtether.router.backends import Backend
from kvtether.router.conversations import Conversation
from kvtether.router.retention import Retention
from kvtether.router.reuse import ReusePlan, plan_reuse, plan_upstream
from kvtether.router.settings import RouterSettings
from kvtether.router.tool_leases import LeaseSizing, person_lease_s

logger = logging.getLogger(__name__)

__all__ = ["Answered", "KVTetherPolicy", "OffPolicy", "Policy", "UpstreamPolicy",
           "initial_lease_s", "make_policy", "valid_handle"]


@dataclass(frozen=True)
class Answered:
    """A conversation's answered turn, for the policy to keep (or not) what decode holds."""

    conv: Conversation
    decode: Backend
    handle: dict[str, Any] | None  # decode's kv_transfer_params (None: none came)
    token_ids: list[int]  # the sequence decode holds KV for (prompt + output)
    handle_key: str | None  # the lease key decode holds it under (kvtether connector)
    sizing: LeaseSizing  # the lease the answer earned
    hints: p.TurnHints | None


class Policy:
    """What differs between the reuse policies; the turn runner asks, never compares names."""

    name = ""
    # Decode legs go to the conversation's decode instance (else round-robin, no affinity).
    affinity = False
    # Decode holds each turn's KV under a lease key (kvtether's connector): the key goes in
    # the decode leg, and a streamed turn's handle is fetched by it.
    leases = False
    # The prompt is checked against what decode retains before anything is read: the router
    # tokenizes it, extends the lease for the hand-off, chooses branches, and may let decode
    # compute a short turn itself (local prefill).
    checks_prefix = False

    def __init__(self, deps: RouterDeps, retention: Retention) -> None:
        self.deps = deps
        self.s = deps.settings
        self.retention = retention

    def plan(self, conv: Conversation, prompt_ids: list[int] | None, *,
             checked_by_prefill: bool, safety_margin_s: float) -> ReusePlan:
        """What the turn's prefill leg reads of ``conv``'s retained KV."""
        raise NotImplementedError

    async def keep(self, a: Answered) -> None:
        """Keep (or let go) what decode holds after the answer, for the next turn."""
        raise NotImplementedError


class OffPolicy(Policy):
    name = "off"

    def plan(self, conv: Conversation, prompt_ids: list[int] | None, *,
             checked_by_prefill: bool, safety_margin_s: float) -> ReusePlan:
        return ReusePlan(None, 0, conv.gone_cause or p.MissCause.NOT_RETAINED)

    async def keep(self, a: Answered) -> None:
        a.conv.gone_cause = p.MissCause.NOT_RETAINED


class UpstreamPolicy(Policy):
    name = "upstream"

    def plan(self, conv: Conversation, prompt_ids: list[int] | None, *,
             checked_by_prefill: bool, safety_margin_s: float) -> ReusePlan:
        return plan_upstream(conv)

    async def keep(self, a: Answered) -> None:
        # vLLM's proxy keeps the handle of a non-streamed answer for the next turn, under
        # vLLM's own TTL; no lease, no release, no budget.
        if valid_handle(a.handle):
            assert a.handle is not None
            self.retention.retain(a.conv, a.decode, a.handle, a.token_ids, None,
                                  self.s.decoder_kv_blocks_ttl_s)
        else:
            a.conv.gone_cause = p.MissCause.NOT_RETAINED


class KVTetherPolicy(Policy):
    name = "kvtether"
    affinity = leases = checks_prefix = True

    def plan(self, conv: Conversation, prompt_ids: list[int] | None, *,
             checked_by_prefill: bool, safety_margin_s: float) -> ReusePlan:
        return plan_reuse(
            conv, prompt_ids,
            block_size=self.s.kv_block_size_tokens,
            recompute_threshold_tokens=self.s.kv_recompute_threshold_tokens,
            safety_margin_s=safety_margin_s,
            now_unix_s=self.deps.clock.now_unix_s(),
            checked_by_prefill=checked_by_prefill,
        )

    async def keep(self, a: Answered) -> None:
        conv, decode, retention = a.conv, a.decode, self.retention
        if not valid_handle(a.handle):
            conv.gone_cause = p.MissCause.NOT_RETAINED
            if a.handle:
                logger.warning("decode %s returned a malformed KV handle; not reusing it",
                               decode.name)
            # No usable handle (malformed, or the streamed turn's fetch failed): D may still
            # hold the KV under the turn's key, and nobody would ever ask for it.
            await self.deps.leases.release(decode, a.handle_key)
            return
        assert a.handle is not None
        if conv.retained is not None:  # cannot happen in order, but never leak a lease
            await retention.release(conv, p.MissCause.RELEASED)
        if a.handle_key:
            lease_s, conv.lease_basis = a.sizing.lease_s, a.sizing.basis
        else:
            lease_s = self.s.decoder_kv_blocks_ttl_s
        retention.retain(conv, decode, a.handle, a.token_ids, a.handle_key, lease_s)
        if a.handle_key and lease_s > (held_s := initial_lease_s(self.s, a.hints)):
            await retention.lengthen(conv, lease_s, held_s)  # longer than D was told
        if a.hints is not None and a.hints.phase == p.Phase.FINAL:
            # The agent said this is its last turn (a release meanwhile: TurnRunner._commit).
            await retention.release(conv, p.MissCause.RELEASED)
            return
        await retention.enforce_budget(conv, decode)


_POLICIES: dict[str, type[Policy]] = {
    c.name: c for c in (KVTetherPolicy, UpstreamPolicy, OffPolicy)
}


def make_policy(deps: RouterDeps, retention: Retention) -> Policy:
    """The policy ``deps.settings.reuse_policy`` names."""
    return _POLICIES[deps.settings.reuse_policy](deps, retention)


def initial_lease_s(s: RouterSettings, h: p.TurnHints | None) -> float:
    """The first lease on a turn's KV (the TTL its decode leg carries): with hints, the
    default, or longer if the next turn is late; without (a coding agent), a person's
    reply's until the answer says more (:mod:`.tool_leases`)."""
    if h is None:
        return person_lease_s(s)
    ttl = s.lease_ttl_s
    if h.next_turn_gap_s is not None:
        ttl = max(ttl, min(h.next_turn_gap_s * 1.5 + s.lease_safety_margin_s, s.max_lease_s))
    return ttl


def valid_handle(h: Any) -> bool:
    """Whether ``h`` is a decode handle another instance can read."""
    if not isinstance(h, dict) or not h.get("do_remote_decode"):
        return False
    groups = h.get("remote_block_ids")
    return (
        isinstance(groups, list) and bool(groups)
        and all(isinstance(g, list) and all(isinstance(b, int) for b in g) for g in groups)
        and any(groups)
        and isinstance(h.get("remote_num_tokens"), int)
    )
