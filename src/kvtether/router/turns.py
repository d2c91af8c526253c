"""One turn through the P/D pair: reuse plan → prefill leg → decode leg → remember D's handle."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvtether import protocol as p
from kvtether.router._errors import RouterHTTPError, error_response
from kvtether.router.backends import Backend, BackendPool
from kvtether.router.budget import pick_evictions
from kvtether.router.conversations import Conversation, ConversationStore, RetainedKV
from kvtether.router.leases import LeaseClient
from kvtether.router.metrics import RouterMetrics
from kvtether.router.reuse import ReusePlan, plan_reuse
from kvtether.router.settings import RouterSettings

logger = logging.getLogger(__name__)

__all__ = ["TurnRequest", "TurnRunner"]

_FRESH_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# What the connector's pull outcomes on P mean for the turn (absent: reuse fired).
_PULL_MISS = {
    p.PullOutcome.BELOW_THRESHOLD.value: p.MissCause.BELOW_THRESHOLD,
    p.PullOutcome.NO_MATCH.value: p.MissCause.PREFIX_BREAK,
    p.PullOutcome.FAILED.value: p.MissCause.TRANSFER_FAILED,
}


@dataclass
class TurnRequest:
    endpoint: str  # "/v1/chat/completions" | "/v1/completions"
    body: dict[str, Any]  # kvtether fields already stripped
    conversation_id: str | None
    hints: p.TurnHints | None
    request_id: str = field(default_factory=lambda: str(uuid.uuid4()))

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def wants_token_ids(self) -> bool:
        return bool(self.body.get("return_token_ids"))


@dataclass
class _Leg:
    """What the prefill leg told us."""

    prefill: Backend
    params: dict[str, Any]
    prompt_token_ids: list[int]
    cached_tokens: int
    pulled_tokens: int | None  # from the kvtether connector on P, when it runs there
    pull: str | None  # a protocol.PullOutcome value, from the same
    seconds: float


class TurnRunner:
    def __init__(
        self,
        settings: RouterSettings,
        pool: BackendPool,
        store: ConversationStore,
        leases: LeaseClient,
        metrics: RouterMetrics,
    ) -> None:
        self.s = settings
        self.pool = pool
        self.store = store
        self.leases = leases
        self.metrics = metrics

    # ---------------------------------------------------------------- entry point
    async def run(self, req: TurnRequest) -> Response:
        conv = self.store.get_or_create(req.conversation_id) if req.conversation_id else None
        if conv is None:
            return await self._run_locked(req, None)
        await conv.lock.acquire()
        try:
            response = await self._run_locked(req, conv)
        except BaseException:
            conv.lock.release()
            raise
        if isinstance(response, StreamingResponse):
            # The stream's generator releases the lock when the answer has been relayed.
            return response
        conv.lock.release()
        return response

    async def _run_locked(self, req: TurnRequest, conv: Conversation | None) -> Response:
        started = time.time()
        prefill = self.pool.pick_prefill()
        if prefill is None:
            raise RouterHTTPError(503, "no prefill instance is reachable; retry shortly")

        plan = await self._plan(req, conv, prefill)
        had_retained = conv is not None and conv.retained is not None
        taken: RetainedKV | None = None
        if conv is not None and conv.retained is not None:
            if plan.handle is None:
                # Nobody will read this KV: free it on D now, not when its lease lapses.
                await self.release(conv, plan.cause or p.MissCause.NOT_RETAINED)
            else:
                # Handed to P, so consumed (D frees the blocks once read); no release or
                # eviction may touch it meanwhile.
                taken = self._drop_retained(conv)
        try:
            leg = await self._prefill_leg(req, prefill, plan)
        except RouterHTTPError as exc:
            # vLLM rejects bad requests (4xx) before scheduling them: the handle is unread.
            if taken is not None and 400 <= exc.status < 500 and conv is not None:
                self._restore(conv, taken)
            raise
        outcome = self._outcome(plan, leg)

        handle_key = uuid.uuid4().hex
        body = dict(req.body)
        body["return_token_ids"] = True
        body["kv_transfer_params"] = dict(
            leg.params,
            kvtether_handle_key=handle_key,
            kvtether_lease_ttl_s=self._initial_lease_s(req),
        )
        preferred = conv.decode_instance if conv else None
        decode, upstream = await self._open_decode(req, conv, body)
        if conv is not None:
            conv.decode_instance = decode.name
        if had_retained and preferred not in (None, decode.name):
            outcome = p.ReuseOutcome.miss(p.MissCause.DECODE_UNAVAILABLE, outcome.reused_tokens)
        record = p.TurnRecord(
            turn=conv.next_turn if conv else 1,
            outcome=outcome.label,
            reused_tokens=outcome.reused_tokens,
            prompt_tokens=len(leg.prompt_token_ids),
            stream=req.stream,
            prefill_instance=prefill.name,
            decode_instance=decode.name,
            started_unix_s=started,
        )
        headers = self._headers(req, record, plan)
        self._count(outcome, record)
        key = handle_key if decode.control_url else None
        if req.stream:
            return self._relay_stream(req, conv, decode, upstream, record, headers, key)
        return await self._finish_once(req, conv, decode, upstream, record, headers, key)

    # ---------------------------------------------------------------- planning
    async def _plan(
        self, req: TurnRequest, conv: Conversation | None, prefill: Backend
    ) -> ReusePlan:
        if conv is None:
            return ReusePlan(None, 0, p.MissCause.NO_CONVERSATION_ID)
        prompt_ids = None
        if conv.retained is not None:
            holder = self.pool.by_name(conv.retained.decode_instance)
            if holder is None or not holder.available:
                self._drop_retained(conv)
                conv.gone_cause = p.MissCause.DECODE_UNAVAILABLE
        if conv.retained is not None:
            prompt_ids, _ = await asyncio.gather(
                self._tokenize(req, prefill), self._extend_for_handoff(conv.retained)
            )
        # No await from here until the handle is taken: a DELETE or eviction meanwhile has
        # already dropped conv.retained, and the plan says so.
        return plan_reuse(
            conv,
            prompt_ids,
            block_size=self.s.kv_block_size_tokens,
            recompute_threshold_tokens=self.s.kv_recompute_threshold_tokens,
            safety_margin_s=self.s.lease_safety_margin_s,
        )

    async def _extend_for_handoff(self, r: RetainedKV) -> None:
        """Make the lease outlive the prefill leg's wait for its read.

        A loaded prefill instance can queue a request for many seconds before it reads, and it
        declines a handle whose deadline has passed by then (a miss, never wrong KV); renewing
        at hand-off costs one control call, made while the prompt is tokenized.
        """
        now = time.time()
        remaining_s = r.lease_deadline_unix_s - now
        if (r.handle_key is None or remaining_s >= self.s.handoff_lease_s
                or remaining_s <= self.s.lease_safety_margin_s):
            return
        decode = self.pool.by_name(r.decode_instance)
        if decode is None:
            return
        result = await self.leases.renew(decode, r.handle_key, self.s.handoff_lease_s)
        if result.status == "renewed" and result.lease is not None:
            r.renewed(result.lease)
            self.metrics.lease_events.labels("extended_at_handoff").inc()
        elif result.status == "gone":
            r.lease_deadline_unix_s = now  # D no longer holds it: the plan says lease_expired

    async def _tokenize(self, req: TurnRequest, prefill: Backend) -> list[int] | None:
        """The new prompt's token ids, exactly as the prefill instance will see them."""
        b = req.body
        if req.endpoint.endswith("/completions") and "messages" not in b:
            prompt = b.get("prompt")
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return prompt
            if not isinstance(prompt, str):
                return None
            tok_body: dict[str, Any] = {"model": b.get("model"), "prompt": prompt}
        else:
            keys = ("model", "messages", "tools", "chat_template", "chat_template_kwargs",
                    "add_generation_prompt", "continue_final_message", "add_special_tokens")
            tok_body = {k: b[k] for k in keys if k in b}
            tok_body.setdefault("add_generation_prompt", True)
        try:
            r = await prefill.client.post("/tokenize", json=tok_body)
        except httpx.HTTPError as exc:
            _note_failure(prefill, exc)
            return None
        if r.status_code != 200:
            # The prefill leg will meet the same problem and report it to the client.
            return None
        return r.json().get("tokens")

    # ---------------------------------------------------------------- prefill leg
    async def _prefill_leg(self, req: TurnRequest, prefill: Backend, plan: ReusePlan) -> _Leg:
        body = {k: v for k, v in req.body.items()
                if k not in ("stream", "stream_options", "max_completion_tokens", "min_tokens")}
        body.update(max_tokens=1, n=1, return_token_ids=True)
        body["kv_transfer_params"] = plan.handle or dict(_FRESH_PREFILL_PARAMS)
        t0 = time.perf_counter()
        prefill.inflight += 1
        try:
            r = await prefill.client.post(
                req.endpoint, json=body, headers={"X-Request-Id": req.request_id}
            )
        except httpx.HTTPError as exc:
            _note_failure(prefill, exc)
            raise RouterHTTPError(
                502, f"prefill instance {prefill.name} failed: {exc!r}", code="upstream_unavailable"
            ) from None
        finally:
            prefill.inflight -= 1
        seconds = time.perf_counter() - t0
        self.metrics.prefill_leg_s.observe(seconds)
        if r.status_code != 200:
            raise _UpstreamError(r)
        data = _json_or_502(r.content, prefill)
        params = data.get("kv_transfer_params") or {}
        if not params.get("do_remote_prefill"):
            raise RouterHTTPError(502, "prefill instance returned no KV handle; is it running "
                                       "with the NIXL connector?", code="upstream_misconfigured")
        return _Leg(
            prefill=prefill,
            params=params,
            prompt_token_ids=_prompt_ids(data),
            cached_tokens=int(params.get("remote_prefill_cached_tokens") or 0),
            pulled_tokens=params.get(p.KV_PARAM_REUSED_TOKENS),
            pull=params.get(p.KV_PARAM_PULL),
            seconds=seconds,
        )

    def _outcome(self, plan: ReusePlan, leg: _Leg) -> p.ReuseOutcome:
        """Reuse outcome of the turn, from the plan and what the prefill instance reported."""
        reused = min(leg.cached_tokens, len(leg.prompt_token_ids))
        if plan.cause is not None:
            return p.ReuseOutcome.miss(plan.cause, reused)
        if leg.pull is not None:
            # The kvtether connector on P says exactly what happened to the handle.
            cause = _PULL_MISS.get(leg.pull)
            return p.ReuseOutcome.hit(reused) if cause is None else p.ReuseOutcome.miss(cause, reused)
        # Upstream connector: P recomputes silently when a read fails (policy "recompute"),
        # which shows as fewer cached tokens than the handle covered.
        if reused + self.s.kv_block_size_tokens <= plan.expected_reused_tokens:
            return p.ReuseOutcome.miss(p.MissCause.TRANSFER_FAILED, reused)
        return p.ReuseOutcome.hit(reused)

    def _initial_lease_s(self, req: TurnRequest) -> float:
        ttl = self.s.lease_ttl_s
        h = req.hints
        if h is not None and h.next_turn_gap_s is not None:
            ttl = max(ttl, min(h.next_turn_gap_s * 1.5 + self.s.lease_safety_margin_s,
                               self.s.max_lease_s))
        return ttl

    # ---------------------------------------------------------------- decode leg
    async def _open_decode(
        self, req: TurnRequest, conv: Conversation | None, body: dict[str, Any]
    ) -> tuple[Backend, httpx.Response]:
        """Send the decode leg, to the conversation's instance when it is reachable.

        An instance that refuses the connection is skipped for the next one: P keeps this
        turn's KV for a while, so any decode instance can still read it.
        """
        tried: set[str] = set()
        preferred = conv.decode_instance if conv else None
        while True:
            decode = self.pool.pick_decode(preferred, exclude=tried)
            if decode is None:
                raise RouterHTTPError(503, "no decode instance is reachable; retry shortly",
                                      code="upstream_unavailable")
            tried.add(decode.name)
            request = decode.client.build_request(
                "POST", req.endpoint, json=body, headers={"X-Request-Id": req.request_id}
            )
            decode.inflight += 1
            try:
                upstream = await decode.client.send(request, stream=True)
            except httpx.ConnectError as exc:
                decode.inflight -= 1
                decode.mark_down(repr(exc))
                continue
            except httpx.HTTPError as exc:
                decode.inflight -= 1
                _note_failure(decode, exc)
                raise RouterHTTPError(502, f"decode instance {decode.name} failed: {exc!r}",
                                      code="upstream_unavailable") from None
            if upstream.status_code != 200:
                decode.inflight -= 1
                await upstream.aread()
                await upstream.aclose()
                raise _UpstreamError(upstream)
            return decode, upstream

    async def _finish_once(self, req, conv, decode, upstream, record, headers, handle_key):
        try:
            raw = await upstream.aread()
        except httpx.HTTPError as exc:
            raise RouterHTTPError(502, f"decode instance {decode.name} failed: {exc!r}",
                                  code="upstream_unavailable") from None
        finally:
            decode.inflight -= 1
            await upstream.aclose()
        data = _json_or_502(raw, decode)
        choice = (data.get("choices") or [{}])[0]
        output_ids = list(choice.get("token_ids") or [])
        prompt_ids = _prompt_ids(data)
        record.output_tokens = len(output_ids)
        record.prompt_tokens = len(prompt_ids) or record.prompt_tokens
        record.latency_s = time.time() - record.started_unix_s
        handle = data.get("kv_transfer_params")
        if conv is not None:
            await self._remember(conv, decode, handle, prompt_ids + output_ids, record, handle_key, req)
        if conv is None:
            await self.leases.release(decode, handle_key)  # nobody can ask for this KV again
        data["kv_transfer_params"] = None
        if not req.wants_token_ids:
            _strip_token_ids(data)
        return JSONResponse(data, headers=headers)

    def _relay_stream(self, req, conv, decode, upstream, record, headers, handle_key):
        state = {"done": False}

        def done() -> None:
            # Synchronous and idempotent: runs even when the client went away before (or
            # while) the generator ran, so the conversation is never left locked.
            if state["done"]:
                return
            state["done"] = True
            decode.inflight -= 1
            if conv is not None:
                if not any(t is record for t in conv.turns):
                    conv.turns.append(record)
                conv.lock.release()

        async def relay() -> AsyncIterator[bytes]:
            prompt_ids: list[int] = []
            output_ids: list[int] = []

            async def finalize() -> None:
                # Before [DONE] reaches the client: SDKs close the connection on [DONE], and
                # anything after that yield would be cancelled with the response.
                record.output_tokens = len(output_ids)
                record.prompt_tokens = len(prompt_ids) or record.prompt_tokens
                record.latency_s = time.time() - record.started_unix_s
                handle = await self.leases.fetch_handle(decode, handle_key)
                if conv is not None:
                    await self._remember(
                        conv, decode, handle, prompt_ids + output_ids, record, handle_key, req
                    )
                elif handle is not None:
                    await self.leases.release(decode, handle_key)

            try:
                async for line in upstream.aiter_lines():
                    if line == "data: [DONE]":
                        await finalize()
                        yield b"data: [DONE]\n\n"
                        continue
                    if not line.startswith("data: "):
                        if line:
                            yield (line + "\n\n").encode()
                        continue
                    try:
                        chunk = json.loads(line[6:])
                    except json.JSONDecodeError:
                        yield (line + "\n\n").encode()
                        continue
                    prompt_ids.extend(_prompt_ids(chunk))
                    for c in chunk.get("choices") or []:
                        output_ids.extend(c.get("token_ids") or [])
                        if record.ttft_s is None and c.get("token_ids"):
                            record.ttft_s = time.time() - record.started_unix_s
                            self.metrics.ttft_s.observe(record.ttft_s)
                    if not req.wants_token_ids:
                        _strip_token_ids(chunk)
                    yield ("data: " + json.dumps(chunk, separators=(",", ":")) + "\n\n").encode()
            finally:
                done()
                await upstream.aclose()

        class _Stream(StreamingResponse):
            async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
                try:
                    await super().__call__(scope, receive, send)
                finally:
                    done()

        return _Stream(relay(), media_type="text/event-stream", headers=headers)

    # ---------------------------------------------------------------- bookkeeping
    async def _remember(self, conv, decode, handle, seq, record, handle_key, req) -> None:
        conv.turns.append(record)
        conv.last_active_unix_s = time.time()
        if req.hints is not None:
            conv.phase = req.hints.phase
            conv.expected_next_prompt_tokens = req.hints.next_prompt_tokens
        final = req.hints is not None and req.hints.phase == p.Phase.FINAL
        if not _valid_handle(handle):
            conv.gone_cause = p.MissCause.NOT_RETAINED
            if handle:
                logger.warning("decode %s returned a malformed KV handle; not reusing it",
                               decode.name)
                await self.leases.release(decode, handle_key)
            return
        if conv.retained is not None:  # cannot happen in order, but never leak a lease
            await self.release(conv, p.MissCause.RELEASED)
        lease_s = self._initial_lease_s(req) if handle_key else self.s.decoder_kv_blocks_ttl_s
        retained = RetainedKV(
            decode_instance=decode.name,
            params=handle,
            token_ids=seq,
            retained_tokens=int(handle.get("remote_num_tokens") or 0),
            lease_deadline_unix_s=time.time() + lease_s,
            handle_key=handle_key,
        )
        conv.retained = retained
        conv.gone_cause = None
        decode.retained_tokens += retained.retained_tokens
        self.metrics.retained_tokens.labels(decode.name).set(decode.retained_tokens)
        self.metrics.active_leases.inc()
        if final:
            # The agent said this is its last turn: hold nothing.
            await self.release(conv, p.MissCause.RELEASED)
            return
        await self._enforce_budget(conv, decode)

    async def _enforce_budget(self, conv: Conversation, decode: Backend) -> None:
        cap = self.s.max_retained_tokens
        if cap is None or decode.retained_tokens <= cap:
            return
        assert conv.retained is not None
        incoming = conv.retained.retained_tokens
        if incoming > cap:
            await self.evict(conv)
            return
        others = [c for c in self.store.values()
                  if c is not conv and c.retained is not None
                  and c.retained.decode_instance == decode.name]
        held = decode.retained_tokens - incoming
        for victim in pick_evictions(others, held, incoming, cap, self.s.lease_ttl_s):
            await self.evict(victim)

    async def evict(self, conv: Conversation) -> None:
        logger.info("evicting retained KV of %s (budget)", conv.conversation_id)
        self.metrics.lease_events.labels("evicted").inc()
        await self.release(conv, p.MissCause.EVICTED)

    def _restore(self, conv: Conversation, r: RetainedKV) -> None:
        conv.retained = r
        conv.gone_cause = None
        b = self.pool.by_name(r.decode_instance)
        if b is not None:
            b.retained_tokens += r.retained_tokens
            self.metrics.retained_tokens.labels(b.name).set(b.retained_tokens)
        self.metrics.active_leases.inc()

    def _drop_retained(self, conv: Conversation) -> RetainedKV | None:
        r, conv.retained = conv.retained, None
        if r is not None:
            b = self.pool.by_name(r.decode_instance)
            if b is not None:
                b.retained_tokens = max(0, b.retained_tokens - r.retained_tokens)
                self.metrics.retained_tokens.labels(b.name).set(b.retained_tokens)
            self.metrics.active_leases.dec()
        return r

    async def release(self, conv: Conversation, cause: p.MissCause) -> None:
        """Free the conversation's retained KV now (on D too, when it runs the connector)."""
        r = self._drop_retained(conv)
        conv.gone_cause = cause
        if r is not None:
            decode = self.pool.by_name(r.decode_instance)
            if decode is not None:
                await self.leases.release(decode, r.handle_key)

    def _headers(self, req: TurnRequest, record: p.TurnRecord, plan: ReusePlan) -> dict[str, str]:
        h = {
            p.HEADER_REUSE: record.outcome,
            p.HEADER_REUSED_TOKENS: str(record.reused_tokens),
            p.HEADER_PROMPT_TOKENS: str(record.prompt_tokens),
            p.HEADER_TURN: str(record.turn),
            p.HEADER_DECODE_INSTANCE: record.decode_instance or "",
            "X-Request-Id": req.request_id,
        }
        if plan.cause == p.MissCause.PREFIX_BREAK:
            h[p.HEADER_SALVAGED_TOKENS] = str(plan.salvaged_tokens)
        if req.conversation_id:
            h[p.HEADER_CONVERSATION_ID] = req.conversation_id
        return h

    def _count(self, outcome: p.ReuseOutcome, record: p.TurnRecord) -> None:
        m = self.metrics
        m.turns.labels(outcome.label).inc()
        if outcome.fired:
            m.reuse_fired.inc()
        else:
            m.reuse_miss.labels(outcome.cause.value if outcome.cause else "unknown").inc()
        m.reused_tokens.inc(outcome.reused_tokens)
        m.prompt_tokens.inc(record.prompt_tokens)


class _UpstreamError(RouterHTTPError):
    """vLLM answered with an error: relay its status and OpenAI-style body unchanged."""

    def __init__(self, response: httpx.Response) -> None:
        try:
            body = response.json()
            message = body.get("error", {}).get("message") or body.get("message") or str(body)
        except ValueError:
            body, message = None, response.text[:500]
        super().__init__(response.status_code, message)
        self.body = body

    def to_response(self) -> Response:
        if isinstance(self.body, dict) and "error" in self.body:
            return JSONResponse(self.body, status_code=self.status)
        return error_response(self.status, self.message)


def _prompt_ids(data: dict[str, Any]) -> list[int]:
    """Prompt token ids of a chat (top level) or completions (per choice) answer or chunk."""
    ids = data.get("prompt_token_ids")
    if not ids:
        choices = data.get("choices") or [{}]
        ids = choices[0].get("prompt_token_ids") if choices else None
    return list(ids or [])


def _strip_token_ids(data: dict[str, Any]) -> None:
    data.pop("prompt_token_ids", None)
    for c in data.get("choices") or []:
        c.pop("token_ids", None)
        c.pop("prompt_token_ids", None)


def _valid_handle(h: Any) -> bool:
    if not isinstance(h, dict) or not h.get("do_remote_decode"):
        return False
    groups = h.get("remote_block_ids")
    return (
        isinstance(groups, list) and bool(groups)
        and all(isinstance(g, list) and all(isinstance(b, int) for b in g) for g in groups)
        and any(groups)
        and isinstance(h.get("remote_num_tokens"), int)
    )


def _json_or_502(raw: bytes, backend: Backend) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        data = None
    if not isinstance(data, dict):
        raise RouterHTTPError(502, f"{backend.role} instance {backend.name} answered with "
                                   "something that is not a JSON object", code="upstream_error")
    return data


def _note_failure(backend: Backend, exc: httpx.HTTPError) -> None:
    """Only a refused connection marks an instance down; a slow one still holds its KV."""
    if isinstance(exc, httpx.ConnectError):
        backend.mark_down(repr(exc))
    else:
        logger.warning("%s %s: %r", backend.role, backend.name, exc)
