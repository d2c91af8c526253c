"""Retained KV: the one owner of what each conversation holds on a decode instance.

Every change to ``Conversation.retained`` goes through :class:`Retention`, which keeps the
per-instance token counts, the budget, the decode-side lease (renew / release) and the lease
metrics in step with it. The turn runner and the session API both use it.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

from kvtether import protocol as p
from kvtether.router._deps import RouterDeps
from kvtether.router.backends import Backend
from kvtether.router.budget import pick_evictions
from kvtether.router.conversations import (
    Conversation,
    HeldConversation,
    RetainedKV,
    StoreError,
)
from kvtether.router.leases import RenewStatus

logger = logging.getLogger(__name__)

__all__ = ["Retention", "RenewOutcome"]

# A lease closer than this to its end is not renewed at hand-off: D refuses a renewal within
# its renew guard (1 s by default) of the deadline (its engine loop ends the lease then), and
# the router sees that deadline through its own clock and one HTTP round trip.
LATE_RENEWAL_S = 2.0


class RenewOutcome(str, enum.Enum):
    """What a heartbeat's renewal did to a conversation's lease."""

    RENEWED = "renewed"  # D extended it, or (no connector) the router's view moved forward
    GONE = "gone"  # D no longer holds the KV: released here too
    UNREACHABLE = "unreachable"  # D did not answer: not renewed, may still be held


class Retention:
    def __init__(self, deps: RouterDeps) -> None:
        self.deps = deps
        self.s = deps.settings
        self.pool = deps.pool
        self.metrics = deps.metrics
        self._tenant_tokens: dict[str, int] = {}  # retained tokens per tenant, all instances

    # ---------------------------------------------------------------- holding
    def retain(
        self, conv: Conversation, decode: Backend, handle: dict[str, Any], token_ids: list[int],
        handle_key: str | None, lease_s: float,
    ) -> None:
        """Record D's handle for the conversation's next turn."""
        now = self.deps.clock.now_unix_s()
        retained = RetainedKV(
            decode_instance=decode.name,
            params=handle,
            token_ids=token_ids,
            retained_tokens=int(handle.get("remote_num_tokens") or 0),
            lease_deadline_unix_s=now + lease_s,
            handle_key=handle_key,
            created_unix_s=now,
        )
        conv.retained = retained
        conv.gone_cause = None
        self._count_in(decode, retained)
        self._count_tenant(conv, retained.retained_tokens)

    def take(self, conv: Conversation) -> RetainedKV | None:
        """Detach the retained KV without freeing it on D (handed to P, or D is gone)."""
        r, conv.retained = conv.retained, None
        if r is not None:
            self._count_tenant(conv, -r.retained_tokens)
            b = self.pool.by_name(r.decode_instance)
            if b is not None:
                b.retained_tokens = max(0, b.retained_tokens - r.retained_tokens)
                self.metrics.retained_tokens.labels(b.name).set(b.retained_tokens)
            self.metrics.active_leases.dec()
        return r

    def restore(self, conv: Conversation, r: RetainedKV) -> None:
        """Put back what :meth:`take` detached (P rejected the request before reading)."""
        conv.retained = r
        conv.gone_cause = None
        self._count_tenant(conv, r.retained_tokens)
        b = self.pool.by_name(r.decode_instance)
        if b is not None:
            self._count_in(b, r)
        else:
            self.metrics.active_leases.inc()

    def _count_tenant(self, conv: Conversation, tokens: int) -> None:
        held = self._tenant_tokens.get(conv.tenant, 0) + tokens
        if held > 0:
            self._tenant_tokens[conv.tenant] = held
        else:
            self._tenant_tokens.pop(conv.tenant, None)

    def tenant_retained_tokens(self, tenant: str) -> int:
        return self._tenant_tokens.get(tenant, 0)

    async def refresh_shared_counts(self) -> None:
        """Take every replica's retained-token counts from a shared store (a private store's
        own counts are exact), so new conversations spread by the same numbers everywhere."""
        counts = await self.deps.store.shared_counts()
        if counts is None:
            return
        by_decode, by_tenant = counts
        for b in self.pool.decode:
            b.retained_tokens = max(0, by_decode.get(b.name, 0))
            self.metrics.retained_tokens.labels(b.name).set(b.retained_tokens)
        self._tenant_tokens = dict(by_tenant)

    def _count_in(self, b: Backend, r: RetainedKV) -> None:
        b.retained_tokens += r.retained_tokens
        self.metrics.retained_tokens.labels(b.name).set(b.retained_tokens)
        self.metrics.active_leases.inc()

    # ---------------------------------------------------------------- freeing
    async def release(self, conv: Conversation, cause: p.MissCause) -> None:
        """Free the conversation's retained KV now (on D too, when it runs the connector)."""
        r = self.take(conv)
        conv.gone_cause = cause
        if r is not None:
            decode = self.pool.by_name(r.decode_instance)
            if decode is not None:
                await self.deps.leases.release(decode, r.handle_key)

    async def release_by_client(self, held: HeldConversation) -> int:
        """DELETE of the session: frees the KV; returns how many tokens were held.

        ``held`` was taken with ``release_after_turn``: a turn in flight frees what it
        retains as it settles. A shared store's busy conversation is only a snapshot: its turn
        holds (and frees) the KV.
        """
        conv = held.conv
        freed = conv.retained.retained_tokens if conv.retained else 0
        if conv.retained is not None:
            self.metrics.lease_events.labels("released").inc()
        if held.writable:
            await self.release(conv, p.MissCause.RELEASED)
        return freed

    async def evict(self, conv: Conversation) -> None:
        logger.info("evicting retained KV of %s (budget)", conv.conversation_id)
        self.metrics.lease_events.labels("evicted").inc()
        await self.release(conv, p.MissCause.EVICTED)

    async def expire(self, conv: Conversation) -> None:
        self.metrics.lease_events.labels("expired").inc()
        await self.release(conv, p.MissCause.LEASE_EXPIRED)

    async def reap_expired(self, now_unix_s: float | None = None) -> None:
        """Free every lease past its deadline, except those of a turn in flight.

        Not under the upstream reuse policy: vLLM's proxy forgets nothing, and P itself
        declines an expired handle.
        """
        if self.s.reuse_policy == "upstream":
            return
        now = self.deps.clock.now_unix_s() if now_unix_s is None else now_unix_s
        for tenant, cid in await self.deps.store.lapsed(now):
            held = await self.deps.store.try_lock(cid, tenant)
            if held is None:
                continue
            try:
                r = held.conv.retained
                if not held.busy and r is not None and r.lease_deadline_unix_s <= now:
                    await self.expire(held.conv)
            finally:
                await held.commit()

    async def _evict_other(self, victim: Conversation) -> None:
        """Evict another conversation's KV (a view of it, with a shared store): under its
        hold, unless a turn has it (a shared store's; here, its handle may be mid-read)."""
        held = await self.deps.store.try_lock(victim.conversation_id, victim.tenant)
        if held is None:
            return
        try:
            r = held.conv.retained
            if held.writable and r is not None:
                await self.evict(held.conv)
        finally:
            await held.commit()

    async def enforce_budget(self, conv: Conversation, decode: Backend) -> None:
        """Keep ``conv``'s tenant under ``max_retained_tokens_per_tenant`` and ``decode`` under
        ``max_retained_tokens`` after ``conv`` retained on it.

        A tenant over its cap loses its own least recently used retained KV (its other
        conversations', never another tenant's). An instance over its cap loses the least
        valuable leases (see :mod:`kvtether.router.budget`; why that order differs from the
        connector's is written in :mod:`kvtether.protocol`).
        """
        try:
            await self._enforce_caps(conv, decode)
        except StoreError as exc:
            # The turn is answered all the same; the next one over the cap tries again.
            logger.warning("retained-token caps not enforced (%s)", exc)

    async def _enforce_caps(self, conv: Conversation, decode: Backend) -> None:
        await self._enforce_tenant_cap(conv)
        if conv.retained is None:  # the turn alone was over the tenant's cap
            return
        cap = self.s.max_retained_tokens
        if cap is None or decode.retained_tokens <= cap:
            return
        assert conv.retained is not None
        incoming = conv.retained.retained_tokens
        if incoming > cap:
            await self.evict(conv)
            return
        others = [c for c in await self.deps.store.holders(decode_instance=decode.name)
                  if c.key != conv.key]
        held = sum(c.retained.retained_tokens for c in others if c.retained is not None)
        victims = pick_evictions(others, held, incoming, cap, self.s.lease_ttl_s,
                                 now_unix_s=self.deps.clock.now_unix_s())
        for victim in victims:
            await self._evict_other(victim)

    async def _enforce_tenant_cap(self, conv: Conversation) -> None:
        cap = self.s.max_retained_tokens_per_tenant
        if cap is None or self.tenant_retained_tokens(conv.tenant) <= cap:
            return
        assert conv.retained is not None
        if conv.retained.retained_tokens > cap:
            await self.evict(conv)
            return
        others = sorted(
            (c for c in await self.deps.store.holders(tenant=conv.tenant) if c.key != conv.key),
            key=lambda c: c.last_active_unix_s,
        )
        for victim in others:
            if self.tenant_retained_tokens(conv.tenant) <= cap:
                break
            await self._evict_other(victim)

    # ---------------------------------------------------------------- leases on D
    async def extend_for_handoff(self, conv: Conversation) -> None:
        """Make the lease outlive the prefill leg's wait for its read.

        A loaded prefill instance can queue a request for many seconds before it reads, and it
        declines a handle whose deadline has passed by then (a miss, never wrong KV); renewing
        at hand-off costs one control call, made while the prompt is tokenized.

        A lease within ``lease_safety_margin_s`` of its end is renewed too (a turn that comes
        back in the last seconds of its lease keeps its KV), unless it ends within
        :data:`LATE_RENEWAL_S` or hand-off renewals are off: then no handle is forwarded.
        """
        r = conv.retained
        if r is None or r.handle_key is None:
            return
        now = self.deps.clock.now_unix_s()
        remaining_s = r.lease_deadline_unix_s - now
        if remaining_s <= self.s.lease_safety_margin_s and (
                remaining_s <= LATE_RENEWAL_S or self.s.handoff_lease_s <= 0):
            return
        decode = self.pool.by_name(r.decode_instance)
        if decode is None:
            return
        if remaining_s >= self.s.handoff_lease_s:
            # Long enough, but is it still held? D may have dropped it behind the router's
            # back (its own retained-token cap, a restart): a NIXL read of freed blocks would
            # read whatever now fills them, so never forward a handle D has let go.
            if await self.deps.leases.check(decode, r.handle_key) is RenewStatus.GONE:
                r.lease_deadline_unix_s = now
            return
        result = await self.deps.leases.renew(decode, r.handle_key, self.s.handoff_lease_s)
        if result.status is RenewStatus.RENEWED and result.lease is not None:
            r.renewed(result.lease)
            self.metrics.lease_events.labels("extended_at_handoff").inc()
        elif result.status is RenewStatus.GONE:
            r.lease_deadline_unix_s = now  # D no longer holds it: the plan says lease_expired

    async def lengthen(self, conv: Conversation, lease_s: float, held_s: float) -> None:
        """A turn just retained KV that D holds for ``held_s`` (the TTL its decode leg
        carried) should be held for ``lease_s``, longer: renew it on D. If D does not renew
        it, the router's deadline is D's (never a handle past what D holds)."""
        r = conv.retained
        assert r is not None
        decode = self.pool.by_name(r.decode_instance)
        result = (await self.deps.leases.renew(decode, r.handle_key, lease_s)
                  if decode is not None else None)
        if result is not None and result.status is RenewStatus.RENEWED and (
                result.lease is not None):
            r.renewed(result.lease)
        elif result is not None and result.status is RenewStatus.GONE:
            r.lease_deadline_unix_s = r.created_unix_s  # the next turn finds it expired
        else:
            r.lease_deadline_unix_s = r.created_unix_s + held_s

    async def renew(self, conv: Conversation, ttl_s: float) -> RenewOutcome:
        """A heartbeat's renewal of the conversation's live lease to now + ``ttl_s``."""
        r = conv.retained
        assert r is not None
        now = self.deps.clock.now_unix_s()
        decode = self.pool.by_name(r.decode_instance)
        if decode is None:
            status = RenewStatus.GONE
            lease = None
        else:
            result = await self.deps.leases.renew(decode, r.handle_key, ttl_s)
            status, lease = result.status, result.lease
        if status is RenewStatus.GONE:
            await self.release(conv, p.MissCause.LEASE_EXPIRED)
            return RenewOutcome.GONE
        if status is RenewStatus.UNREACHABLE:
            return RenewOutcome.UNREACHABLE
        if status is RenewStatus.RENEWED and lease is not None:
            r.renewed(lease)
        else:
            # Upstream connector: vLLM's fixed TTL cannot be extended.
            r.lease_deadline_unix_s = min(
                max(r.lease_deadline_unix_s, now + ttl_s),
                r.created_unix_s + self.s.decoder_kv_blocks_ttl_s,
            )
        self.metrics.lease_events.labels("renewed").inc()
        return RenewOutcome.RENEWED
