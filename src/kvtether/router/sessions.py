"""The session API: heartbeats renew a conversation's lease, DELETE releases it, GET shows it."""

from __future__ import annotations

import json
import logging
import time

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvtether import protocol as p
from kvtether.router._deps import RouterDeps
from kvtether.router._errors import RouterHTTPError
from kvtether.router.access import tenant_of
from kvtether.router.conversations import Conversation
from kvtether.router.retention import RenewOutcome, Retention

logger = logging.getLogger(__name__)

__all__ = ["SessionAPI"]


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

    def _conv(self, request: Request) -> Conversation:
        cid = request.path_params["conversation_id"]
        # Another tenant's conversation is not found: same answer as an id never used.
        conv = self.store.get(cid, tenant_of(request))
        if conv is None:
            raise RouterHTTPError(404, f"unknown session {cid!r}: no turn has used this id")
        return conv

    async def get(self, request: Request) -> Response:
        status = self._conv(request).status(self.clock.now_unix_s())
        return JSONResponse(status.model_dump(mode="json"))

    def _require_leases(self, conv: Conversation, what: str) -> None:
        if self.s.reuse_policy != "kvtether":
            raise RouterHTTPError(
                409, f"cannot {what} session {conv.conversation_id!r}: this router runs reuse "
                     f"policy '{self.s.reuse_policy}', which keeps no leases (decode holds KV "
                     "under vLLM's own TTL, or not at all); use reuse_policy 'kvtether'",
                code="no_leases",
            )

    async def delete(self, request: Request) -> Response:
        conv = self._conv(request)
        self._require_leases(conv, "release")
        freed = await self.retention.release_by_client(conv)
        return JSONResponse(
            {"conversation_id": conv.conversation_id, "released": True,
             "retained_tokens_freed": freed}
        )

    async def heartbeat(self, request: Request) -> Response:
        t0 = time.perf_counter()
        conv = self._conv(request)
        self._require_leases(conv, "renew the lease of")
        raw = await request.body()
        try:
            hb = p.HeartbeatRequest.model_validate(json.loads(raw) if raw.strip() else {})
        except json.JSONDecodeError as exc:
            raise RouterHTTPError(400, f"heartbeat body is not valid JSON: {exc}") from None
        except ValidationError as exc:
            err = p.first_field_error(exc)
            raise RouterHTTPError(400, f"invalid heartbeat: {err}", param=err.loc) from None

        now = self.clock.now_unix_s()
        r = conv.retained
        if r is None and conv.lock.locked():
            # A turn is in flight: its answer will create a fresh lease.
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
