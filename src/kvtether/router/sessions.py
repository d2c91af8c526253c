"""The session API: heartbeats renew a conversation's lease, DELETE releases it, GET shows it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvtether import protocol as p
from kvtether._validation import first_field_error
from kvtether.router._deps import RouterDeps
from kvtether.router._errors import RouterHTTPError, parse_json_body
from kvtether.router.access import tenant_of
from kvtether.router.branches import branch_ids, is_branch_id
from kvtether.router.conversations import Conversation, HeldConversation, StoreError
from kvtether.router.retention import RenewOutcome, Retention

logger = logging.getLogger(__name__)

__all__ = ["SessionAPI"]

T = TypeVar("T")


def _unknown(cid: str) -> RouterHTTPError:
    return RouterHTTPError(404, f"unknown session {cid!r}: no turn has used this id")


def _heartbeat_request(raw: bytes) -> p.HeartbeatRequest:
    """A heartbeat's body (empty: every field's default), or a 400 that says what is wrong."""
    try:
        return p.HeartbeatRequest.model_validate(
            parse_json_body(raw, "heartbeat body") if raw.strip() else {})
    except ValidationError as exc:
        err = first_field_error(exc)
        raise RouterHTTPError(400, f"invalid heartbeat: {err}", param=err.loc) from None


class SessionAPI:
    def __init__(self, deps: RouterDeps, retention: Retention) -> None:
        self.s = deps.settings
        self.store = deps.store
        self.metrics = deps.metrics
        self.clock = deps.clock
        self.retention = retention

    def routes(self) -> list[Route]:
        return [
            Route("/v1/sessions/{conversation_id}", self.get, methods=["GET"]),
            Route("/v1/sessions/{conversation_id}", self.delete, methods=["DELETE"]),
            Route("/v1/sessions/{conversation_id}/heartbeat", self.heartbeat, methods=["POST"]),
        ]

    async def _store(self, call: Awaitable[T]) -> T:
        try:
            return await call
        except StoreError as exc:
            self.metrics.store_unavailable.inc()
            logger.warning("conversation store: %s", exc)
            raise RouterHTTPError(
                503, "the router's conversation store is unavailable; retry shortly "
                     "(turns are still answered, without KV reuse)", code="store_unavailable",
            ) from None

    async def _branches(self, request: Request) -> list[str]:
        """The conversation's other branches that exist (:mod:`.branches`), by id."""
        cid = request.path_params["conversation_id"]
        if self.s.max_branches <= 1 or is_branch_id(cid):
            return []
        ids = branch_ids(cid, self.s.max_branches)[1:]
        tenant = tenant_of(request)
        views = await self._store(asyncio.gather(*(self.store.read(b, tenant) for b in ids)))
        return [b for b, v in zip(ids, views, strict=True) if v is not None]

    async def _hold(self, request: Request, *, release_after_turn: bool = False,
                    cid: str | None = None) -> HeldConversation:
        cid = cid or request.path_params["conversation_id"]
        # Another tenant's conversation is not found: same answer as an id never used.
        held = await self._store(self.store.try_lock(
            cid, tenant_of(request), release_after_turn=release_after_turn))
        if held is None:
            raise _unknown(cid)
        return held

    async def get(self, request: Request) -> Response:
        cid = request.path_params["conversation_id"]
        conv = await self._store(self.store.read(cid, tenant_of(request)))
        if conv is None:
            raise _unknown(cid)
        now = self.clock.now_unix_s()
        status = conv.status(now)
        main = (conv.turn_count, conv.last_active_unix_s, cid)
        for bid in await self._branches(request):
            branch = await self._store(self.store.read(bid, tenant_of(request)))
            if branch is not None:
                b = branch.status(now)
                status.branches.append(p.BranchStatus(
                    conversation_id=bid, decode_instance=b.decode_instance,
                    retained_tokens=b.retained_tokens, lease_state=b.lease_state,
                    turn_count=b.turn_count, fired_turns=b.fired_turns, turns=b.turns,
                ))
                main = max(main, (branch.turn_count, branch.last_active_unix_s, bid))
        status.main_branch = main[2] if not is_branch_id(cid) else None
        return JSONResponse(status.model_dump(mode="json"))

    def _require_leases(self, cid: str, what: str) -> None:
        if self.s.reuse_policy != "kvtether":
            raise RouterHTTPError(
                409, f"cannot {what} session {cid!r}: this router runs reuse "
                     f"policy '{self.s.reuse_policy}', which keeps no leases (decode holds KV "
                     "under vLLM's own TTL, or not at all); use reuse_policy 'kvtether'",
                code="no_leases",
            )

    async def delete(self, request: Request) -> Response:
        cid = request.path_params["conversation_id"]
        if self.s.reuse_policy != "kvtether":
            if await self._store(self.store.read(cid, tenant_of(request))) is None:
                raise _unknown(cid)
            self._require_leases(cid, "release")
        held = await self._hold(request, release_after_turn=True)
        try:
            freed = await self.retention.release_by_client(held)
        finally:
            await self._store(held.commit())
        for bid in await self._branches(request):  # every branch of the conversation
            branch = await self._hold(request, release_after_turn=True, cid=bid)
            try:
                freed += await self.retention.release_by_client(branch)
            finally:
                await self._store(branch.commit())
        return JSONResponse(
            {"conversation_id": cid, "released": True, "retained_tokens_freed": freed}
        )

    async def heartbeat(self, request: Request) -> Response:
        t0 = time.perf_counter()
        cid = request.path_params["conversation_id"]
        if self.s.reuse_policy != "kvtether":
            if await self._store(self.store.read(cid, tenant_of(request))) is None:
                raise _unknown(cid)
            self._require_leases(cid, "renew the lease of")
        hb = _heartbeat_request(await request.body())  # bad input: 400, nothing held yet
        renewed: Response | None = None
        for bid in await self._branches(request):  # every branch's lease, best effort
            branch = await self._hold(request, cid=bid)
            try:
                renewed = await self._beat(branch, hb, t0)
            except RouterHTTPError:
                pass
            finally:
                await self._store(branch.commit())
        held = await self._hold(request)
        try:
            return await self._beat(held, hb, t0)
        except RouterHTTPError as exc:
            if exc.status == 410 and renewed is not None:
                return renewed  # the main branch holds nothing, another branch does
            raise
        finally:
            await self._store(held.commit())

    async def _beat(self, held: HeldConversation, hb: p.HeartbeatRequest, t0: float) -> Response:
        conv = held.conv
        now = self.clock.now_unix_s()
        r = conv.retained
        if held.busy and (r is None or not held.writable):
            # A turn is in flight (on any replica): its answer will create a fresh lease.
            return self._reply(conv, now + self.s.lease_ttl_s, 0, t0)
        if r is not None and r.lease_deadline_unix_s <= now:
            await self.retention.expire(conv)
            r = None
        if r is None:
            state = conv.lease_state(now)
            raise RouterHTTPError(
                410, f"session {conv.conversation_id!r} holds no KV (lease {state}); "
                     "its next turn recomputes", code=f"lease_{state}",
            )
        outcome = await self.retention.renew(conv, self._ttl(hb))
        if outcome is RenewOutcome.GONE:
            raise RouterHTTPError(410, f"session {conv.conversation_id!r}: the decode instance "
                                       "no longer holds its KV", code="lease_expired")
        if outcome is RenewOutcome.UNREACHABLE:
            raise RouterHTTPError(503, f"session {conv.conversation_id!r}: decode instance "
                                       f"{r.decode_instance} did not answer; lease not renewed",
                                  code="decode_unavailable")
        if hb.next_prompt_tokens is not None:
            conv.expected_next_prompt_tokens = hb.next_prompt_tokens
        conv.last_active_unix_s = now
        conv.phase = hb.phase
        return self._reply(conv, r.lease_deadline_unix_s, r.retained_tokens, t0)

    def _ttl(self, hb: p.HeartbeatRequest) -> float:
        if hb.lease_extension_s is not None:
            want = hb.lease_extension_s
        elif hb.expected_duration_s is not None:
            want = max(self.s.lease_ttl_s, hb.expected_duration_s * 1.5)
        else:
            want = self.s.lease_ttl_s
        if hb.phase in (p.Phase.FINAL, p.Phase.IDLE) and hb.lease_extension_s is None:
            want = min(want, self.s.lease_ttl_s)
        return min(want + self.s.lease_safety_margin_s, self.s.max_lease_s)

    def _reply(self, conv: Conversation, deadline: float, tokens: int, t0: float) -> Response:
        self.metrics.heartbeat_s.observe(time.perf_counter() - t0)
        body = p.HeartbeatResponse(
            conversation_id=conv.conversation_id,
            lease_deadline_unix_s=deadline,
            lease_remaining_s=max(0.0, deadline - self.clock.now_unix_s()),
            retained_tokens=tokens,
        )
        return JSONResponse(body.model_dump())

    async def expire(self, conv: Conversation) -> None:
        await self.retention.expire(conv)

    async def reap_expired(self, now_unix_s: float | None = None) -> None:
        """Free every lapsed lease (what the app's housekeeping does every second)."""
        await self.retention.reap_expired(now_unix_s)
