"""One turn through the P/D pair: reuse plan → prefill leg → decode leg → remember D's handle.

The runner decides; the legs (:mod:`.legs`), the answer's relay (:mod:`.relay`) and what is
retained on D (:mod:`.retention`) are done by their own modules. How a turn reuses KV depends
on the reuse policy (``RouterSettings.reuse_policy``); how its outcome is reported does not
(:func:`reuse_outcome`). The module is over 400 lines because one turn's decisions read top to
bottom in one class; every part that stands alone has left for its own module.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.responses import Response, StreamingResponse

from kvtether import protocol as p
from kvtether.protocol import _kv_params as kv_keys
from kvtether.router import legs
from kvtether.router._deps import RouterDeps
from kvtether.router._errors import RouterHTTPError
from kvtether.router.apis import Api, api_for
from kvtether.router.backends import Backend, BackendStalledError
from kvtether.router.branches import hold_branch
from kvtether.router.prompts import PromptTokenizer
from kvtether.router.conversations import (
    Conversation,
    ConversationBusyError,
    HeldConversation,
    RetainedKV,
    StoreError,
    StoreFencedError,
    StoreUnavailableError,
)
from kvtether.router.relay import (
    TurnContext,
    greedy_single,
    in_background,
    relay_events,
    relay_once,
    relay_stream,
)
from kvtether.router.retention import Retention
from kvtether.router.reuse import ReusePlan, plan_reuse, plan_upstream, reuse_outcome
from kvtether.router.tool_leases import LeaseSizing, person_lease_s, size_after_answer

logger = logging.getLogger(__name__)

__all__ = ["TurnRequest", "TurnRunner"]

# Why a conversation's decode-held KV is gone while decode's prefix cache may still hold it.
# Request bytes per prompt token, to guess a leg's work where the router has no token ids.
_BYTES_PER_TOKEN = 4
_GONE = frozenset({p.MissCause.LEASE_EXPIRED, p.MissCause.EVICTED, p.MissCause.RELEASED,
                   p.MissCause.NOT_RETAINED})


@dataclass
class TurnRequest:
    endpoint: str  # one of apis.API_PATHS
    body: dict[str, Any]  # kvtether fields already stripped
    conversation_id: str | None
    hints: p.TurnHints | None
    request_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    tenant: str = ""  # whose conversation this is (router.access)
    parent_id: str | None = None  # the conversation this one was spawned from (router.identity)
    prompt_ids: list[int] | None = None  # tokenized already (while choosing a branch)
    tokenize_s: float | None = None  # how long that took
    router_prompt_ids: list[int] | None = None  # tokenized by the router itself (checked)

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def api(self) -> Api:
        return api_for(self.endpoint)

    @property
    def wants_token_ids(self) -> bool:
        return self.api.token_ids_in_answer and bool(self.body.get("return_token_ids"))


class TurnRunner:
    def __init__(self, deps: RouterDeps, retention: Retention) -> None:
        self.deps = deps
        self.s = deps.settings
        self.pool = deps.pool
        self.retention = retention
        # The router's own tokenizer (RouterSettings.tokenizer), once loaded.
        self.prompts: PromptTokenizer | None = None

    # ---------------------------------------------------------------- entry point
    async def run(self, req: TurnRequest) -> Response:
        received = self.deps.clock.now_unix_s()
        if not req.conversation_id:
            return await self._run_locked(req, None, received)
        try:
            held = await self._hold(req)
        except ConversationBusyError:
            raise RouterHTTPError(
                409, f"conversation {req.conversation_id!r} has a turn in flight (on this or "
                     f"another router replica) that did not finish within "
                     f"{self.s.store_lock_wait_s:g} s; send the next turn once it has answered",
                code="conversation_busy",
            ) from None
        except StoreUnavailableError as exc:
            # Answered all the same, as plain P/D: nothing is known of the conversation.
            logger.warning("conversation store unavailable (%s); turn of %s runs without reuse",
                           exc, req.conversation_id)
            self.deps.metrics.store_unavailable.inc()
            return await self._run_locked(req, None, received, store_down=True)
        if req.parent_id is not None and held.conv.parent_id is None:
            held.conv.parent_id = req.parent_id
        try:
            response = await self._run_locked(req, held, received)
        except BaseException:
            held.commit_soon()
            raise
        if isinstance(response, StreamingResponse):
            # The stream saves and lets go of the conversation when the answer has been relayed.
            return response
        await self._commit(held)
        return response

    async def _hold(self, req: TurnRequest) -> HeldConversation:
        """The conversation's branch this turn continues (:mod:`.branches`), held."""
        assert req.conversation_id is not None
        if self.s.max_branches <= 1 or self.s.reuse_policy != "kvtether":
            return await self.deps.store.lock(req.conversation_id, req.tenant,
                                              wait_s=self.s.store_lock_wait_s)
        # Any prefill instance tokenizes alike; picking one must not move the legs' round robin.
        prefill = next((b for b in self.pool.prefill if b.available), None)

        async def tokenize() -> list[int] | None:
            if prefill is None:
                return None
            try:
                return await self._tokenize(req, prefill)
            except RouterHTTPError:
                return None  # the prefill leg meets (and reports) the same problem

        choice = await hold_branch(
            self.deps.store, req.conversation_id, req.tenant,
            max_branches=self.s.max_branches, wait_s=self.s.store_lock_wait_s,
            tokenize=tokenize if req.api.token_ids_in_answer else None,
            related_tokens=self.s.kv_block_size_tokens,
        )
        req.prompt_ids = choice.prompt_ids
        if choice.superseded is not None:
            in_background(self._release_superseded(choice.superseded, req.tenant))
        return choice.held

    async def _release_superseded(self, branch_id: str, tenant: str) -> None:
        """Free the KV of a branch whose sequence a turn rewrote (:mod:`.branches`)."""
        try:
            held = await self.deps.store.try_lock(branch_id, tenant, release_after_turn=True)
            if held is None:
                return
            try:
                freed = await self.retention.release_by_client(held)
            finally:
                await held.commit()
        except StoreError as exc:
            logger.warning("could not release superseded branch %s: %s", branch_id, exc)
            return
        if freed:
            logger.info("released %d tokens of %s: a shorter prompt rewrote its sequence",
                        freed, branch_id)

    async def _tokenize(self, req: TurnRequest, prefill: Backend) -> list[int] | None:
        """The prompt's token ids: from the router's own tokenizer where it mirrors the
        request (:mod:`.prompts`), else from ``prefill`` (:func:`legs.tokenize`); timed in
        ``req.tokenize_s``."""
        t0 = self.deps.clock.now_unix_s()
        try:
            if self.prompts is not None:
                ids = await self.prompts.atoken_ids(req.endpoint, req.body)
                if ids is not None:
                    req.router_prompt_ids = ids
                    self.deps.metrics.tokenizations.labels("router").inc()
                    return ids
            self.deps.metrics.tokenizations.labels("prefill").inc()
            return await legs.tokenize(prefill, req.endpoint, req.body)
        finally:
            req.tokenize_s = self.deps.clock.now_unix_s() - t0

    def _check_tokenized(self, req: TurnRequest, reported: list[int]) -> None:
        """The router's token ids for the prompt against those vLLM reported for it."""
        if req.router_prompt_ids is None or not reported or self.prompts is None:
            return
        if not self.prompts.check(req.router_prompt_ids, reported):
            self.deps.metrics.tokenizer_mismatches.inc()

    async def _commit(self, held: HeldConversation) -> None:
        """Save the conversation and let it go; free its KV if a release came meanwhile."""
        conv = held.conv
        try:
            if await held.commit():
                await self.retention.release(conv, p.MissCause.RELEASED)
                await held.commit()
        except StoreError as exc:
            # The answer is delivered; what this turn retained can be found by nobody.
            logger.warning("turn state of %s not saved (%s); releasing its retained KV",
                           conv.conversation_id, exc)
            if not isinstance(exc, StoreFencedError):
                self.deps.metrics.store_unavailable.inc()
            if conv.retained is not None:
                await self.retention.release(conv, p.MissCause.NOT_RETAINED)

    async def _run_locked(
        self, req: TurnRequest, held: HeldConversation | None, received: float, *,
        store_down: bool = False,
    ) -> Response:
        conv = held.conv if held is not None else None
        clock = self.deps.clock
        timings = p.TurnTimings(router_wait_s=clock.now_unix_s() - received)
        refused: set[str] = set()  # prefill instances that refused this turn's connection
        prefill = self._pick_prefill(refused)
        if self.pool.decode and not any(b.available for b in self.pool.decode):
            # Every decode instance just refused a connection: a prefill leg now would only
            # pin its prompt's KV on P (until vLLM's prefill lease lapses) for nobody. The
            # same for every decode instance stalled (a frozen worker).
            stalled = next((b for b in self.pool.decode if b.stalled_step_s is not None), None)
            if stalled is not None:
                raise BackendStalledError(stalled)
            raise RouterHTTPError(503, "no decode instance is reachable; retry shortly",
                                  code="upstream_unavailable")
        planning = clock.now_unix_s()
        while True:
            try:
                plan = (ReusePlan(None, 0, p.MissCause.STORE_UNAVAILABLE) if store_down
                        else await self._plan(req, conv, prefill, timings))
                break
            except legs.PrefillRefusedError as exc:
                prefill = self._instead_of_refused(refused, exc)
        cached_decode: Backend | None = None
        cached_on = None if store_down else await self._cached_on_decode(
            req, conv, plan, prefill, timings)
        if cached_on is not None:
            plan, cached_decode = cached_on
        timings.plan_s = clock.now_unix_s() - planning
        had_retained = conv is not None and conv.retained is not None
        previous = conv.last_token_ids if conv is not None else None
        taken: RetainedKV | None = None
        if conv is not None and conv.retained is not None:
            if plan.handle is None:
                # Nobody will read this KV: free it on D now, not when its lease lapses.
                await self.retention.release(conv, plan.cause or p.MissCause.NOT_RETAINED)
            else:
                # Handed to P, so consumed (D frees the blocks once read); no release or
                # eviction may touch it meanwhile.
                taken = self.retention.take(conv)
        if cached_decode is not None:
            # Decode computes the turn on what its prefix cache still holds (no handle: the
            # plan's cause is the miss, so nothing was taken above).
            holder, local = cached_decode, True
            self.deps.metrics.prefix_cache_returns.inc()
        else:
            holder = self.pool.by_name(taken.decode_instance) if taken is not None else None
            # Few new tokens on top of what decode holds: decode computes them there.
            local = holder is not None and self._prefills_locally(plan, holder, prefill)
        leg: legs.PrefillResult | None = None
        try:
            if not local:
                leg = await self._prefill_leg(prefill, refused, req, plan.handle, holder,
                                              _prompt_work(req, plan))
        except legs.PrefillTimedOutError as exc:
            # A frozen or hopelessly queued prefill: decode answers alone (recomputing the
            # prompt). A handle taken for the leg stays under its hand-off lease: P may still
            # be reading it, and a read frees it.
            logger.warning("%s; the turn of %s runs on decode alone", exc.message,
                           req.conversation_id or "(no conversation)")
            self.deps.metrics.prefill_timeouts.inc()
            timings.prefill_leg_s = exc.timeout_s
            leg = None
        except RouterHTTPError as exc:
            # The handle is unread: vLLM rejects bad requests (4xx) before scheduling them, and
            # a refused connection reached nobody; decode keeps it for the client's retry.
            unread = 400 <= exc.status < 500 or isinstance(exc, legs.PrefillRefusedError)
            if taken is not None and unread and conv is not None:
                self.retention.restore(conv, taken)
            raise
        if leg is not None:
            self.deps.metrics.prefill_leg_s.observe(leg.leg_s)
            timings.prefill_leg_s, timings.prefill = leg.leg_s, leg.engine
        if taken is not None and leg is not None and leg.pull == p.PullOutcome.FAILED.value:
            # P recomputed instead (a declined or failed read): D still holds the KV under its
            # hand-off lease, which nobody will read now.
            self._release_unread(taken)

        kvtether = self.s.reuse_policy == "kvtether"
        # Decode alone (no prefill leg) keeps nothing: vLLM retains only a P/D request's KV,
        # and a local-prefill request's (kvtether's connector tracks it as one).
        handle_key = uuid.uuid4().hex if kvtether and (leg is not None or local) else None
        body = dict(req.body)
        if req.api.token_ids_in_answer:
            body["return_token_ids"] = True
        if local:
            body["kv_transfer_params"] = {kv_keys.KV_PARAM_LOCAL_PREFILL: True}
            self.deps.metrics.local_prefills.inc()
        if leg is not None:
            body["kv_transfer_params"] = dict(leg.params)
            if not req.api.token_ids_in_answer:
                # D reports the sequence it retains (this API's answer carries no token ids).
                body["kv_transfer_params"][kv_keys.KV_PARAM_REPORT_TOKEN_IDS] = True
        if handle_key is not None:
            # Only the kvtether connector reads these: the lease D holds this turn's KV under.
            body["kv_transfer_params"].update({
                kv_keys.KV_PARAM_HANDLE_KEY: handle_key,
                kv_keys.KV_PARAM_LEASE_TTL_S: self._initial_lease_s(req.hints),
            })
        preferred = conv.decode_instance if conv is not None and kvtether else None
        if local:
            assert holder is not None
            preferred = holder.name
        decode_sent = clock.now_unix_s()
        local_work = (plan.new_tokens or 0) if local else 0
        if local:
            assert holder is not None
            holder.prompt_backlog_tokens += local_work  # decode's prompt work (_prefills_locally)
        try:
            decode, upstream = await legs.open_decode(
                self.pool, preferred, req.endpoint, body, req.request_id,
                round_robin=not kvtether, stream_idle_timeout_s=self.s.stream_idle_timeout_s,
                source=leg.prefill if leg is not None else None,
            )
        except BaseException:
            if local:
                assert holder is not None
                holder.prompt_backlog_tokens -= local_work
            if local and conv is not None and taken is not None:
                self.retention.restore(conv, taken)  # still held on decode, unread
            raise
        if conv is not None:
            conv.decode_instance = decode.name
        if local:
            assert conv is not None and plan.prompt_token_ids is not None
            moved = decode.name != preferred  # another decode instance recomputes it all
            outcome = reuse_outcome(
                plan, plan.prompt_token_ids,
                0 if moved else _local_prefix_hit(plan, self.s.kv_block_size_tokens), previous,
                conversation=True, decode_lost=moved, block_size=self.s.kv_block_size_tokens,
                recompute_threshold_tokens=self.s.kv_recompute_threshold_tokens,
            )
        elif leg is not None:
            outcome = reuse_outcome(
                plan, leg.prompt_token_ids, leg.cached_tokens, previous,
                conversation=conv is not None,
                decode_lost=had_retained and preferred not in (None, decode.name),
                block_size=self.s.kv_block_size_tokens,
                recompute_threshold_tokens=self.s.kv_recompute_threshold_tokens,
            )
        else:
            outcome = _decode_alone_outcome(plan, conv is not None, previous)
        if store_down:
            outcome = p.ReuseOutcome.miss(p.MissCause.STORE_UNAVAILABLE, outcome.reused_tokens)
        record = p.TurnRecord(
            turn=conv.next_turn if conv else 1,
            outcome=outcome.label,
            reused_tokens=outcome.reused_tokens,
            reusable_tokens=outcome.reusable_tokens,
            prompt_tokens=(len(leg.prompt_token_ids) if leg is not None
                           else len(plan.prompt_token_ids or ()) if local else 0),
            stream=req.stream,
            prefill_instance=leg.prefill.name if leg is not None else None,
            decode_instance=decode.name,
            local_prefill=local,
            started_unix_s=received,
            timings=timings,
        )
        self._count(outcome, record)
        ctx = TurnContext(
            conv=conv,
            held=held,
            decode=decode,
            upstream=upstream,
            record=record,
            headers=self._headers(req, record, plan),
            handle_key=handle_key if decode.control_url else None,
            wants_token_ids=req.wants_token_ids,
            decode_sent_unix_s=decode_sent,
            api=req.api,
            first=(leg.first if leg is not None and req.stream and self.s.relay_prefill_token
                   and greedy_single(req.body) else None),
        )
        if not req.api.token_ids_in_answer and leg is not None:
            ctx.prompt_ids = list(leg.prompt_token_ids)  # D's report replaces these, if any
        if local:
            # Counted until its first token (ctx.prompt_computed).
            ctx.local_prompt_on, ctx.local_prompt_tokens = holder, local_work

        def release_old() -> None:
            # A local-prefill turn ended (answered or not): the KV it started from is either
            # shared by its new lease (vLLM shares the blocks) or read by nobody.
            if local and taken is not None:
                self._release_unread(taken)

        async def settle(ctx: TurnContext, handle: dict[str, Any] | None) -> None:
            cached = legs.reported_cached_tokens(handle)
            if local and cached is not None and plan.prompt_token_ids is not None:
                self._check_local_hit(ctx.record, plan, cached, previous)
            await self._settle(ctx, handle, req.hints)
            self._check_tokenized(req, ctx.prompt_ids)
            release_old()
            if held is not None:
                # Saved before the client sees the end of the answer: its next turn may go
                # to another replica at once.
                await self._commit(held)

        async def no_handle() -> None:
            # vLLM 0.32 returns no handle on a streamed answer, and the upstream proxy has no
            # other way to get one.
            return None

        if req.stream:
            fetch = ((lambda: self.deps.leases.fetch_handle(decode, ctx.handle_key))
                     if kvtether else no_handle)
            relay = relay_events if req.api.named_events else relay_stream

            async def release_unsettled() -> None:
                await self.deps.leases.release(decode, ctx.handle_key)
                release_old()

            return relay(ctx, settle, fetch, self.deps.clock, self.deps.metrics,
                         release_unsettled=release_unsettled)
        try:
            return await relay_once(ctx, settle, self.deps.clock)
        except BaseException:
            release_old()
            raise

    def _release_unread(self, taken: RetainedKV) -> None:
        holder = self.pool.by_name(taken.decode_instance)
        if holder is None or not taken.handle_key:
            return
        in_background(self.deps.leases.release(holder, taken.handle_key))

    def _prefills_locally(self, plan: ReusePlan, holder: Backend, prefill: Backend) -> bool:
        """Whether decode computes this turn's new tokens itself (``local_prefill_max_tokens``):
        the prompt extends everything decode holds for the conversation, by few tokens, decode
        is there to take it, and it has no more prompt work queued than prefill.

        The last condition spreads prompt work over both instances when many conversations
        run at once: with every turn short, decode would otherwise compute them all, one after
        another between its decode steps, while prefill waits idle. The work is counted in
        prompt tokens (``Backend.prompt_backlog_tokens``: local-prefill turns before their
        first token; prefill legs in flight), not turns: one turn 1 of 700 tokens on prefill
        holds a short turn up longer than three short turns on decode. Both are this router's
        own counts; a tie stays on decode, which saves the two transfers.
        """
        new = plan.new_tokens
        return (
            self.s.reuse_policy == "kvtether" and plan.cause is None
            and plan.handle is not None and new is not None
            and 0 < new <= self.s.local_prefill_max_tokens and holder.available
            and holder.prompt_backlog_tokens <= prefill.prompt_backlog_tokens
        )

    async def _cached_on_decode(
        self, req: TurnRequest, conv: Conversation | None, plan: ReusePlan, prefill: Backend,
        timings: p.TurnTimings,
    ) -> tuple[ReusePlan, Backend] | None:
        """A conversation whose decode-held KV has gone (its lease lapsed while a person
        thought, it was evicted or released) goes back to the decode instance that held it,
        to compute the turn there on what that instance's prefix cache still holds, when the
        cache holds all it could reuse and the rest is few tokens (``local_prefill_max_tokens``).

        vLLM keeps a freed block's KV, findable by its hash, until it needs the space: a lapsed
        lease ends the promise, not the data. The plan that comes back keeps its miss cause
        (``lease_expired`` ...): if decode has reused the space by the time the turn is
        scheduled, the turn records that miss, from what vLLM reports it computed.
        """
        if (
            conv is None or self.s.reuse_policy != "kvtether" or plan.cause not in _GONE
            or conv.decode_instance is None or not conv.last_token_ids
            or self.s.local_prefill_max_tokens <= 0 or not req.api.token_ids_in_answer
        ):
            return None
        decode = self.pool.by_name(conv.decode_instance)
        if decode is None or not decode.available or not decode.control_url:
            return None
        prompt = plan.prompt_token_ids or req.prompt_ids
        if prompt is None:
            try:
                prompt = await self._tokenize(req, prefill)
            except RouterHTTPError:
                return None  # the prefill leg meets (and reports) the same problem
            timings.plan_tokenize_s = req.tokenize_s
            if prompt is None:
                return None
        block, threshold = self.s.kv_block_size_tokens, self.s.kv_recompute_threshold_tokens
        reusable = p.reusable_prefix_tokens(conv.last_token_ids, prompt)
        if reusable < max(threshold, 1) or len(prompt) - reusable > self.s.local_prefill_max_tokens:
            return None
        t0 = self.deps.clock.now_unix_s()
        cached = await self.deps.leases.cached_prefix(decode, prompt[:reusable])
        timings.plan_prefix_cache_s = self.deps.clock.now_unix_s() - t0
        if cached is None:
            return None
        _, fires = p.reuse_verdict(reusable, cached, block_size=block,
                                   recompute_threshold_tokens=threshold)
        if not fires or not 0 < len(prompt) - cached <= self.s.local_prefill_max_tokens:
            return None
        return replace(plan, expected_reused_tokens=cached, prompt_token_ids=prompt), decode

    def _check_local_hit(self, record: p.TurnRecord, plan: ReusePlan, cached: int,
                         previous: list[int] | None) -> None:
        """The turn record gets what decode's engine reported it did not compute; the label
        the response's headers promised is checked against it."""
        assert plan.prompt_token_ids is not None
        measured = reuse_outcome(
            plan, plan.prompt_token_ids, cached, previous, conversation=True, decode_lost=False,
            block_size=self.s.kv_block_size_tokens,
            recompute_threshold_tokens=self.s.kv_recompute_threshold_tokens,
        )
        if measured.label != record.outcome:
            logger.warning("local-prefill turn %d: decode found %d prompt tokens in its cache, "
                           "%d expected; recorded as %s", record.turn, cached,
                           record.reused_tokens, measured.label)
        record.outcome, record.reused_tokens = measured.label, measured.reused_tokens

    def _pick_prefill(self, refused: set[str]) -> Backend:
        """The prefill instance for this turn, skipping those that refused it a connection."""
        prefill = self.pool.pick_prefill(exclude=refused)
        if prefill is None:
            raise RouterHTTPError(503, "no prefill instance is reachable; retry shortly",
                                  code="upstream_unavailable")
        return prefill

    def _instead_of_refused(self, refused: set[str], exc: legs.PrefillRefusedError) -> Backend:
        """Another prefill instance for a turn whose instance refused the connection (nothing
        reached it; any prefill instance reads the same handle); ``exc`` when none is left."""
        refused.add(exc.backend.name)
        prefill = self.pool.pick_prefill(exclude=refused)
        if prefill is None:
            raise exc
        return prefill

    async def _prefill_leg(
        self, prefill: Backend, refused: set[str], req: TurnRequest,
        handle: dict[str, Any] | None, holder: Backend | None = None, work_tokens: int = 0,
    ) -> legs.PrefillResult:
        while True:
            try:
                return await legs.prefill(prefill, req.endpoint, req.body, req.request_id,
                                          handle, timeout_s=self.s.prefill_leg_timeout_s,
                                          holder=holder, work_tokens=work_tokens)
            except legs.PrefillRefusedError as exc:
                prefill = self._instead_of_refused(refused, exc)

    # ---------------------------------------------------------------- planning
    async def _plan(
        self, req: TurnRequest, conv: Conversation | None, prefill: Backend,
        timings: p.TurnTimings,
    ) -> ReusePlan:
        if conv is None:
            return ReusePlan(None, 0, p.MissCause.NO_CONVERSATION_ID)
        if self.s.reuse_policy == "off":
            return ReusePlan(None, 0, conv.gone_cause or p.MissCause.NOT_RETAINED)
        if self.s.reuse_policy == "upstream":
            return plan_upstream(conv)
        holder = None
        if conv.retained is not None:
            holder = self.pool.by_name(conv.retained.decode_instance)
            if holder is None or not holder.available:
                self.retention.take(conv)
                conv.gone_cause = p.MissCause.DECODE_UNAVAILABLE
        clock = self.deps.clock

        def plan(prompt_ids: list[int] | None,
                 safety_margin_s: float = self.s.lease_safety_margin_s) -> ReusePlan:
            return plan_reuse(
                conv,
                prompt_ids,
                block_size=self.s.kv_block_size_tokens,
                recompute_threshold_tokens=self.s.kv_recompute_threshold_tokens,
                safety_margin_s=safety_margin_s,
                now_unix_s=clock.now_unix_s(),
                checked_by_prefill=not req.api.token_ids_in_answer,
            )

        async def lease() -> None:
            t0 = clock.now_unix_s()
            await self.retention.extend_for_handoff(conv)
            timings.plan_lease_s = clock.now_unix_s() - t0

        prompt_ids = None
        if conv.retained is not None and not req.api.token_ids_in_answer:
            # Responses / Messages: vLLM has no /tokenize for these; prefill's connector checks
            # the prompt against the handle's block hashes and reads only what matches.
            await lease()
        elif conv.retained is not None and req.prompt_ids is not None:
            prompt_ids = req.prompt_ids  # tokenized while choosing its branch (in router_wait)
            timings.plan_tokenize_s = req.tokenize_s
            assert holder is not None
            # No safety margin: it guards a handle forwarded to prefill, and a turn decode
            # computes forwards none. If the lease ends before decode schedules the turn, its
            # prefix cache still holds the blocks unless it needed the space, and the turn's
            # record says what vLLM reported it computed (_check_local_hit).
            local = plan(prompt_ids, safety_margin_s=0.0)
            if self._prefills_locally(local, holder, prefill):
                # Decode computes this turn on what its prefix cache holds: no handle goes to
                # prefill, so nothing need outlive a prefill queue, and no renewal (a control
                # call) is made for it.
                return local
            await lease()
        elif conv.retained is not None:
            prompt_ids, _ = await asyncio.gather(self._tokenize(req, prefill), lease())
            timings.plan_tokenize_s = req.tokenize_s
        # No await from here until the handle is taken: a DELETE or eviction meanwhile has
        # already dropped conv.retained, and the plan says so.
        return plan(prompt_ids)

    def _initial_lease_s(self, h: p.TurnHints | None) -> float:
        """The first lease on a turn's KV (the TTL its decode leg carries): with hints, the
        default, or longer if the next turn is late; without (a coding agent), a person's
        reply's until the answer says more (:mod:`.tool_leases`, in :meth:`_settle`)."""
        if h is None:
            return person_lease_s(self.s)
        ttl = self.s.lease_ttl_s
        if h.next_turn_gap_s is not None:
            ttl = max(ttl, min(h.next_turn_gap_s * 1.5 + self.s.lease_safety_margin_s,
                               self.s.max_lease_s))
        return ttl

    # ---------------------------------------------------------------- after the answer
    async def _settle(
        self, ctx: TurnContext, handle: dict[str, Any] | None, hints: p.TurnHints | None
    ) -> None:
        """Record the finished turn and keep (or free) what D retained for the next one."""
        conv, decode = ctx.conv, ctx.decode
        ctx.record.timings.decode = legs.engine_timings(handle)
        reported = legs.reported_token_ids(handle)
        if reported is not None:
            ctx.prompt_ids, ctx.output_ids = reported
            ctx.record.output_tokens = len(ctx.output_ids)
        self.deps.metrics.observe_stages(ctx.record.timings)
        if conv is None:
            # Nobody can ask for this KV again.
            await self.deps.leases.release(decode, ctx.handle_key)
            return
        conv.add_turn(ctx.record)
        conv.remember_sequence(ctx.prompt_ids + ctx.output_ids)
        conv.last_active_unix_s = self.deps.clock.now_unix_s()
        if hints is not None:
            conv.phase = hints.phase
            conv.expected_next_prompt_tokens = hints.next_prompt_tokens
            sizing = LeaseSizing(self._initial_lease_s(hints),
                                 "default" if hints.next_turn_gap_s is None else "hints")
        else:
            # No hints (a coding agent): how the answer ended sizes its lease.
            sizing = size_after_answer(self.s, conv, ctx.answer.end(), ctx.record,
                                       conv.last_active_unix_s)
        conv.lease_basis = None
        if self.s.reuse_policy == "off":
            conv.gone_cause = p.MissCause.NOT_RETAINED
            return
        if self.s.reuse_policy == "upstream":
            # vLLM's proxy keeps the handle of a non-streamed answer for the next turn, under
            # vLLM's own TTL; no lease, no release, no budget.
            if _valid_handle(handle):
                assert handle is not None
                self.retention.retain(conv, decode, handle, ctx.prompt_ids + ctx.output_ids,
                                      None, self.s.decoder_kv_blocks_ttl_s)
            else:
                conv.gone_cause = p.MissCause.NOT_RETAINED
            return
        if not _valid_handle(handle):
            conv.gone_cause = p.MissCause.NOT_RETAINED
            if handle:
                logger.warning("decode %s returned a malformed KV handle; not reusing it",
                               decode.name)
            # No usable handle (malformed, or the streamed turn's fetch failed): D may still
            # hold the KV under the turn's key, and nobody would ever ask for it.
            await self.deps.leases.release(decode, ctx.handle_key)
            return
        assert handle is not None
        if conv.retained is not None:  # cannot happen in order, but never leak a lease
            await self.retention.release(conv, p.MissCause.RELEASED)
        if ctx.handle_key:
            lease_s, conv.lease_basis = sizing.lease_s, sizing.basis
        else:
            lease_s = self.s.decoder_kv_blocks_ttl_s
        self.retention.retain(
            conv, decode, handle, ctx.prompt_ids + ctx.output_ids, ctx.handle_key, lease_s
        )
        if ctx.handle_key and lease_s > (held_s := self._initial_lease_s(hints)):
            await self.retention.lengthen(conv, lease_s, held_s)  # longer than D was told
        if hints is not None and hints.phase == p.Phase.FINAL:
            # The agent said this is its last turn (a release meanwhile: see _commit).
            await self.retention.release(conv, p.MissCause.RELEASED)
            return
        await self.retention.enforce_budget(conv, decode)

    # ---------------------------------------------------------------- reporting
    def _headers(self, req: TurnRequest, record: p.TurnRecord, plan: ReusePlan) -> dict[str, str]:
        h = {
            p.HEADER_REUSE: record.outcome,
            p.HEADER_REUSED_TOKENS: str(record.reused_tokens),
            p.HEADER_PROMPT_TOKENS: str(record.prompt_tokens),
            p.HEADER_TURN: str(record.turn),
            p.HEADER_DECODE_INSTANCE: record.decode_instance or "",
            "X-Request-Id": req.request_id,
        }
        h[p.HEADER_REUSABLE_TOKENS] = str(record.reusable_tokens)
        h[p.HEADER_TIMINGS] = record.timings.header_value()
        if plan.cause == p.MissCause.PREFIX_BREAK:
            h[p.HEADER_SALVAGED_TOKENS] = str(plan.salvaged_tokens)
        if req.conversation_id:
            h[p.HEADER_CONVERSATION_ID] = req.conversation_id
        return h

    def _count(self, outcome: p.ReuseOutcome, record: p.TurnRecord) -> None:
        m = self.deps.metrics
        m.turns.labels(outcome.label).inc()
        if outcome.eligible:
            m.reuse_eligible.inc()
        m.reusable_tokens.inc(outcome.reusable_tokens)
        if outcome.fired:
            m.reuse_fired.inc()
        else:
            m.reuse_miss.labels(outcome.cause.value if outcome.cause else "unknown").inc()
        m.reused_tokens.inc(outcome.reused_tokens)
        m.prompt_tokens.inc(record.prompt_tokens)


def _decode_alone_outcome(
    plan: ReusePlan, conversation: bool, previous: list[int] | None
) -> p.ReuseOutcome:
    """A turn decode answered alone (its prefill leg timed out): nothing was reused; an
    eligible turn lost what its handle covered."""
    if not conversation:
        return p.ReuseOutcome.miss(p.MissCause.NO_CONVERSATION_ID)
    if previous is None:
        return p.ReuseOutcome.miss(p.MissCause.FIRST_TURN)
    if plan.cause is not None:  # nothing offered, or a salvage (prefix_break)
        return p.ReuseOutcome.miss(plan.cause, 0, plan.salvaged_tokens)
    if plan.handle is None:
        return p.ReuseOutcome.miss(p.MissCause.NOT_RETAINED)
    return p.ReuseOutcome.miss(p.MissCause.TRANSFER_FAILED, 0, plan.expected_reused_tokens)


def _prompt_work(req: TurnRequest, plan: ReusePlan) -> int:
    """Prompt tokens a prefill leg will compute, for the backlog count: the tokens past the
    handle where the router tokenized the prompt, else the whole request at ~4 bytes a token
    (a first turn or a miss; prefill's prefix cache may hold some of it)."""
    if plan.new_tokens is not None:
        return plan.new_tokens
    if req.prompt_ids is not None:
        return max(0, len(req.prompt_ids) - plan.expected_reused_tokens)
    return len(json.dumps(req.body, separators=(",", ":"))) // _BYTES_PER_TOKEN


def _local_prefix_hit(plan: ReusePlan, block_size: int) -> int:
    """Prompt tokens decode's prefix cache holds for a local-prefill turn: the whole blocks of
    what it retains (vLLM hashes whole blocks only)."""
    return plan.expected_reused_tokens // block_size * block_size


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
