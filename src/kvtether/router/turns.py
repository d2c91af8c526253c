"""One turn through the P/D pair: plan (:mod:`.turn_plan`) → prefill leg → decode leg →
remember D's handle.

The runner plans a turn as data, then runs it; the legs (:mod:`.legs`), the answer's relay
(:mod:`.relay`), the reuse policy (:mod:`.policies`) and what is retained on D
(:mod:`.retention`) are done by their own modules. How a turn's outcome is reported does not
depend on the policy (:func:`.reuse.reuse_outcome`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.responses import Response

from kvtether import protocol as p
from kvtether.router import legs
from kvtether.router._deps import RouterDeps
from kvtether.router._errors import RouterHTTPError
from kvtether.router.apis import Api, api_for
from kvtether.router.backends import Backend, BackendStalledError, Slot
from kvtether.router.branches import hold_branch
from kvtether.router.conversations import (
    Conversation,
    ConversationBusyError,
    HeldConversation,
    RetainedKV,
    StoreError,
    StoreFencedError,
    StoreUnavailableError,
)
from kvtether.router.policies import Answered, initial_lease_s, make_policy
from kvtether.router.prompts import PromptTokenizer
from kvtether.router.relay import TurnContext, greedy_single, relay_events, relay_once, relay_stream
from kvtether.router.retention import Retention
from kvtether.router.reuse import ReusePlan, reuse_outcome
from kvtether.router.tool_leases import LeaseSizing, size_after_answer
from kvtether.router.turn_plan import (
    Compute,
    Tokenized,
    TurnPlan,
    decode_body,
    prompt_work,
    turn_outcome,
)

logger = logging.getLogger(__name__)

__all__ = ["TurnRequest", "TurnRunner"]

# Why a conversation's decode-held KV is gone while decode's prefix cache may still hold it.
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

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def api(self) -> Api:
        return api_for(self.endpoint)

    @property
    def wants_token_ids(self) -> bool:
        return self.api.token_ids_in_answer and bool(self.body.get("return_token_ids"))


class _Turn:
    """One turn in flight: its request, the conversation it holds, its plan and, once the
    decode leg is open, its relay context. It settles, releases and commits exactly once,
    however the turn ends (:class:`.relay.TurnEnding`)."""

    def __init__(self, runner: TurnRunner, req: TurnRequest, held: HeldConversation | None,
                 received: float, tokenized: Tokenized | None, store_down: bool) -> None:
        self.runner, self.req, self.held = runner, req, held
        self.conv: Conversation | None = held.conv if held is not None else None
        self.received = received
        self.timings = p.TurnTimings(router_wait_s=runner.deps.clock.now_unix_s() - received)
        self.tokenized = tokenized  # while choosing the conversation's branch
        self.store_down = store_down
        self.plan: TurnPlan | None = None
        self.ctx: TurnContext | None = None
        self.forwarded_router_ids = False  # decode took the router's ids, not its own rendering
        self._settled = self._finished = self._committed = self._old_released = False

    @property
    def settled(self) -> bool:
        return self._settled

    async def settle(self, handle: dict[str, Any] | None) -> None:
        """Record the answered turn, keep (or free) what D holds, save the conversation:
        before the client sees the end of the answer (its next turn may go to another
        replica at once)."""
        self._settled = True
        runner, ctx, plan = self.runner, self.ctx, self.plan
        assert ctx is not None and plan is not None
        cached = legs.reported_cached_tokens(handle)
        if plan.local and cached is not None and plan.reuse.prompt_token_ids is not None:
            runner._check_local_hit(ctx.record, plan.reuse, cached, plan.previous)
        await runner._settle(ctx, handle, self.req.hints)
        if not self.forwarded_router_ids:  # else decode reports back what it was given
            runner._check_tokenized(plan.router_ids, ctx.prompt_ids)
        self._release_old()
        if self.held is not None and not self._committed:
            self._committed = True
            await runner._commit(self.held)

    async def settle_streamed(self) -> None:
        self._settled = True
        ctx = self.ctx
        assert ctx is not None
        # vLLM puts no handle in a stream: kvtether's connector keeps it under the lease key;
        # the upstream proxy has no way to get one.
        handle = (await self.runner.deps.leases.fetch_handle(ctx.decode, ctx.handle_key)
                  if self.runner.policy.leases else None)
        await self.settle(handle)

    def finish(self) -> None:
        """The turn ended, answered or not: its slots go back, a stream that ended before it
        was settled releases what D may hold for it, and the conversation is let go."""
        if self._finished:
            return
        self._finished = True
        ctx = self.ctx
        if ctx is not None:
            ctx.release_slots()
            if self.req.stream and not self._settled:
                self.runner.deps.tasks.start(self._release_unsettled())
            else:
                self._release_old()
            conv = ctx.conv
            if (self.req.stream and conv is not None and self.held is not None
                    and not any(t is ctx.record for t in conv.turns)):
                conv.add_turn(ctx.record)
        if self.held is not None and not self._committed:
            self._committed = True
            self.held.commit_soon()

    async def _release_unsettled(self) -> None:
        # D may have finished the turn and hold its KV under a lease nobody will ask for.
        assert self.ctx is not None
        await self.runner.deps.leases.release(self.ctx.decode, self.ctx.handle_key)
        self._release_old()

    def _release_old(self) -> None:
        """A local-prefill turn ended: the KV it started from is either shared by its new
        lease (vLLM shares the blocks) or read by nobody."""
        if self._old_released:
            return
        self._old_released = True
        plan = self.plan
        if plan is not None and plan.local and plan.taken is not None:
            self.runner._release_unread(plan.taken)


class TurnRunner:
    def __init__(self, deps: RouterDeps, retention: Retention) -> None:
        self.deps = deps
        self.s = deps.settings
        self.pool = deps.pool
        self.retention = retention
        self.policy = make_policy(deps, retention)
        # The router's own tokenizer (RouterSettings.tokenizer), once loaded.
        self.prompts: PromptTokenizer | None = None

    # ---------------------------------------------------------------- entry point
    async def run(self, req: TurnRequest) -> Response:
        received = self.deps.clock.now_unix_s()
        if not req.conversation_id:
            return await self._run_locked(_Turn(self, req, None, received, None, False))
        try:
            held, tokenized = await self._hold(req)
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
            return await self._run_locked(_Turn(self, req, None, received, None, True))
        if req.parent_id is not None and held.conv.parent_id is None:
            held.conv.parent_id = req.parent_id
        return await self._run_locked(_Turn(self, req, held, received, tokenized, False))

    async def _hold(self, req: TurnRequest) -> tuple[HeldConversation, Tokenized | None]:
        """The conversation's branch this turn continues (:mod:`.branches`), held; and the
        prompt's token ids where choosing the branch needed them."""
        assert req.conversation_id is not None
        if self.s.max_branches <= 1 or not self.policy.checks_prefix:
            held = await self.deps.store.lock(req.conversation_id, req.tenant,
                                              wait_s=self.s.store_lock_wait_s)
            return held, None
        # Any prefill instance tokenizes alike; picking one must not move the legs' round robin.
        prefill = next((b for b in self.pool.prefill if b.available), None)
        tokenized: list[Tokenized] = []

        async def tokenize() -> list[int] | None:
            if prefill is None:
                return None
            try:
                tokenized.append(await self._tokenize(req, prefill))
            except RouterHTTPError:
                return None  # the prefill leg meets (and reports) the same problem
            return tokenized[-1].ids

        choice = await hold_branch(
            self.deps.store, req.conversation_id, req.tenant,
            max_branches=self.s.max_branches, wait_s=self.s.store_lock_wait_s,
            tokenize=tokenize if req.api.token_ids_in_answer else None,
            related_tokens=self.s.kv_block_size_tokens,
        )
        if choice.superseded is not None:
            self.deps.tasks.start(self._release_superseded(choice.superseded, req.tenant))
        if choice.prompt_ids is None or not tokenized:
            return choice.held, None
        return choice.held, replace(tokenized[-1], ids=choice.prompt_ids)

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

    async def _tokenize(self, req: TurnRequest, prefill: Backend) -> Tokenized:
        """The prompt's token ids: from the router's own tokenizer where it mirrors the
        request (:mod:`.prompts`), else from ``prefill`` (:func:`legs.tokenize`)."""
        t0 = self.deps.clock.now_unix_s()
        if self.prompts is not None:
            ids = await self.prompts.atoken_ids(req.endpoint, req.body)
            if ids is not None:
                self.deps.metrics.tokenizations.labels("router").inc()
                return Tokenized(ids, self.deps.clock.now_unix_s() - t0, by_router=True)
        self.deps.metrics.tokenizations.labels("prefill").inc()
        ids = await legs.tokenize(prefill, req.endpoint, req.body)
        return Tokenized(ids, self.deps.clock.now_unix_s() - t0, by_router=False)

    def _check_tokenized(self, router_ids: list[int] | None, reported: list[int]) -> None:
        """The router's token ids for the prompt against those vLLM reported for it."""
        if router_ids is None or not reported or self.prompts is None:
            return
        if not self.prompts.check(router_ids, reported):
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

    # ---------------------------------------------------------------- running a plan
    async def _run_locked(self, turn: _Turn) -> Response:
        try:
            return await self._execute(turn)
        except BaseException:
            turn.finish()
            raise

    async def _execute(self, turn: _Turn) -> Response:
        """Run the turn's plan: the prefill leg (unless decode computes the turn), then the
        decode leg, whose answer is relayed."""
        req, clock = turn.req, self.deps.clock
        plan = turn.plan = await self._plan_turn(turn)
        leg = None
        if plan.compute is Compute.PREFILL_LEG:
            leg = await self._run_prefill(turn, plan)
            if leg is None:
                plan = turn.plan = replace(plan, compute=Compute.DECODE_ALONE)
        # Decode alone keeps nothing: vLLM retains only a P/D request's KV, and a
        # local-prefill request's (kvtether's connector tracks it as one).
        handle_key = (uuid.uuid4().hex
                      if self.policy.leases and plan.compute is not Compute.DECODE_ALONE
                      else None)
        if plan.local:
            self.deps.metrics.local_prefills.inc()
        body = decode_body(req.body, req.api.token_ids_in_answer, plan, leg, handle_key,
                           initial_lease_s(self.s, req.hints), self._ids_for_decode(turn, leg))
        decode_sent = clock.now_unix_s()
        opened, local_work = await self._open_decode(turn, plan, leg, body)
        if turn.conv is not None:
            turn.conv.decode_instance = opened.backend.name
        turn.ctx = self._context(turn, leg, opened, handle_key, decode_sent)
        turn.ctx.local_work = local_work
        if not req.stream:
            return await relay_once(turn.ctx, turn, clock)
        relay = relay_events if req.api.named_events else relay_stream
        return relay(turn.ctx, turn, clock, self.deps.metrics)

    def _ids_for_decode(self, turn: _Turn, leg: legs.PrefillResult | None) -> list[int] | None:
        """The chat prompt's token ids decode takes instead of rendering it again (kvtether
        policy): those prefill rendered, or on a local prefill those the turn was planned with
        when vLLM rendered them (prefill's ``/tokenize``) or the router's tokenizer vouches
        for its own (:meth:`.prompts.PromptTokenizer.vouches`)."""
        plan = turn.plan
        if plan is None or not self.policy.checks_prefix or turn.req.api.name != "chat":
            return None
        if leg is not None:
            return leg.prompt_token_ids or None
        ids = plan.reuse.prompt_token_ids
        if not plan.local or not ids:
            return None
        if plan.router_ids is None:
            return ids  # from prefill's /tokenize
        if ids == plan.router_ids and self.prompts is not None and self.prompts.vouches():
            turn.forwarded_router_ids = True
            return ids
        return None

    async def _run_prefill(self, turn: _Turn, plan: TurnPlan) -> legs.PrefillResult | None:
        """The prefill leg; None when it timed out (decode then answers alone)."""
        req, timings = turn.req, turn.timings
        try:
            leg = await self._prefill_leg(plan.prefill, set(plan.refused), req,
                                          plan.reuse.handle, plan.holder, plan.work_tokens)
        except legs.PrefillTimedOutError as exc:
            # A frozen or hopelessly queued prefill: decode answers alone (recomputing the
            # prompt). A handle taken for the leg stays under its hand-off lease: P may still
            # be reading it, and a read frees it.
            logger.warning("%s; the turn of %s runs on decode alone", exc.message,
                           req.conversation_id or "(no conversation)")
            self.deps.metrics.prefill_timeouts.inc()
            timings.prefill_leg_s = exc.timeout_s
            return None
        except RouterHTTPError as exc:
            # The handle is unread: vLLM rejects bad requests (4xx) before scheduling them, and
            # a refused connection reached nobody; decode keeps it for the client's retry.
            unread = 400 <= exc.status < 500 or isinstance(exc, legs.PrefillRefusedError)
            if plan.taken is not None and unread and turn.conv is not None:
                self.retention.restore(turn.conv, plan.taken)
            raise
        self.deps.metrics.prefill_leg_s.observe(leg.leg_s)
        timings.prefill_leg_s, timings.prefill = leg.leg_s, leg.engine
        if plan.taken is not None and leg.pull == p.PullOutcome.FAILED.value:
            # P recomputed instead (a declined or failed read): D still holds the KV under its
            # hand-off lease, which nobody will read now.
            self._release_unread(plan.taken)
        return leg

    async def _open_decode(
        self, turn: _Turn, plan: TurnPlan, leg: legs.PrefillResult | None, body: dict[str, Any],
    ) -> tuple[legs.DecodeLeg, Slot | None]:
        """The decode leg, opened; with a local prefill's prompt work counted on the decode
        instance that holds its KV (:meth:`_prefills_locally`) until its first token."""
        local_work = None
        if plan.local:
            assert plan.holder is not None
            local_work = plan.holder.prompt_work(plan.work_tokens)
        try:
            opened = await legs.open_decode(
                self.pool, plan.preferred, turn.req.endpoint, body, turn.req.request_id,
                round_robin=not self.policy.affinity,
                stream_idle_timeout_s=self.s.stream_idle_timeout_s,
                source=leg.prefill if leg is not None else None,
            )
        except BaseException:
            if local_work is not None:
                local_work.release()
            if plan.local and turn.conv is not None and plan.taken is not None:
                self.retention.restore(turn.conv, plan.taken)  # still held on decode, unread
            raise
        return opened, local_work

    def _context(self, turn: _Turn, leg: legs.PrefillResult | None, opened: legs.DecodeLeg,
                 handle_key: str | None, decode_sent: float) -> TurnContext:
        """The turn's record and what relaying its answer needs."""
        req, plan, conv, decode = turn.req, turn.plan, turn.conv, opened.backend
        assert plan is not None
        outcome = turn_outcome(plan, leg, decode, self.s)
        record = p.TurnRecord(
            turn=conv.next_turn if conv else 1,
            outcome=outcome.label,
            reused_tokens=outcome.reused_tokens,
            reusable_tokens=outcome.reusable_tokens,
            prompt_tokens=(len(leg.prompt_token_ids) if leg is not None
                           else len(plan.reuse.prompt_token_ids or ()) if plan.local else 0),
            stream=req.stream,
            prefill_instance=leg.prefill.name if leg is not None else None,
            decode_instance=decode.name,
            local_prefill=plan.local,
            started_unix_s=turn.received,
            timings=turn.timings,
        )
        self._count(outcome, record)
        ctx = TurnContext(
            conv=conv,
            decode=decode,
            upstream=opened.upstream,
            slot=opened.slot,
            record=record,
            headers=self._headers(req, record, plan.reuse),
            handle_key=handle_key if decode.control_url else None,
            wants_token_ids=req.wants_token_ids,
            decode_sent_unix_s=decode_sent,
            api=req.api,
            first=(leg.first if leg is not None and req.stream and self.s.relay_prefill_token
                   and greedy_single(req.body) else None),
        )
        if not req.api.token_ids_in_answer and leg is not None:
            ctx.prompt_ids = list(leg.prompt_token_ids)  # D's report replaces these, if any
        return ctx

    def _release_unread(self, taken: RetainedKV) -> None:
        holder = self.pool.by_name(taken.decode_instance)
        if holder is None or not taken.handle_key:
            return
        self.deps.tasks.start(self.deps.leases.release(holder, taken.handle_key))

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
    async def _plan_turn(self, turn: _Turn) -> TurnPlan:
        """What the turn reads and where it computes, with what that took asked of the
        instances (tokenizing, the hand-off lease, decode's prefix cache)."""
        req, conv, timings, clock = turn.req, turn.conv, turn.timings, self.deps.clock
        refused: set[str] = set()  # prefill instances that refused this turn's connection
        prefill = self._pick_prefill(refused)
        self._check_decode_reachable()
        planning = clock.now_unix_s()
        tokenized = [turn.tokenized]
        cached_decode: Backend | None = None
        if turn.store_down:
            reuse = ReusePlan(None, 0, p.MissCause.STORE_UNAVAILABLE)
        else:
            while True:
                try:
                    reuse, tok = await self._plan(req, conv, prefill, timings, turn.tokenized)
                    break
                except legs.PrefillRefusedError as exc:
                    prefill = self._instead_of_refused(refused, exc)
            found, tok2 = await self._cached_on_decode(req, conv, reuse, prefill, timings,
                                                       turn.tokenized)
            tokenized += [tok, tok2]
            if found is not None:
                reuse, cached_decode = found
                self.deps.metrics.prefix_cache_returns.inc()
        timings.plan_s = clock.now_unix_s() - planning
        had_retained = conv is not None and conv.retained is not None
        previous = conv.last_token_ids if conv is not None else None
        taken = await self._take_or_release(conv, reuse)
        router_ids = next((t.ids for t in reversed(tokenized)
                           if t is not None and t.by_router and t.ids is not None), None)
        return self._route(
            turn, reuse, prefill, frozenset(refused), cached_decode, taken,
            had_retained=had_retained, previous=previous, router_ids=router_ids,
        )

    def _check_decode_reachable(self) -> None:
        """Every decode instance just refused a connection: a prefill leg now would only pin
        its prompt's KV on P (until vLLM's prefill lease lapses) for nobody. The same for
        every decode instance stalled (a frozen worker)."""
        if self.pool.decode and not any(b.available for b in self.pool.decode):
            stalled = next((b for b in self.pool.decode if b.stalled_step_s is not None), None)
            if stalled is not None:
                raise BackendStalledError(stalled)
            raise RouterHTTPError(503, "no decode instance is reachable; retry shortly",
                                  code="upstream_unavailable")

    async def _take_or_release(self, conv: Conversation | None,
                               reuse: ReusePlan) -> RetainedKV | None:
        """The conversation's retained KV, taken for the turn if it reads it, else freed."""
        if conv is None or conv.retained is None:
            return None
        if reuse.handle is None:
            # Nobody will read this KV: free it on D now, not when its lease lapses.
            await self.retention.release(conv, reuse.cause or p.MissCause.NOT_RETAINED)
            return None
        # Handed to P, so consumed (D frees the blocks once read); no release or eviction may
        # touch it meanwhile.
        return self.retention.take(conv)

    def _route(
        self, turn: _Turn, reuse: ReusePlan, prefill: Backend, refused: frozenset[str],
        cached_decode: Backend | None, taken: RetainedKV | None, *,
        had_retained: bool, previous: list[int] | None, router_ids: list[int] | None,
    ) -> TurnPlan:
        """Where the turn computes (no I/O): on the decode instance whose prefix cache still
        holds its prompt, on the one that holds its KV when few tokens are new, else on P."""
        conv = turn.conv
        if cached_decode is not None:
            # No handle: the plan's cause is the miss, so nothing was taken.
            holder, local = cached_decode, True
        else:
            holder = self.pool.by_name(taken.decode_instance) if taken is not None else None
            local = holder is not None and self._prefills_locally(reuse, holder, prefill)
        preferred = conv.decode_instance if conv is not None and self.policy.affinity else None
        if local:
            assert holder is not None
            preferred = holder.name
        ids = turn.tokenized.ids if turn.tokenized is not None else None
        return TurnPlan(
            reuse=reuse,
            compute=Compute.LOCAL if local else Compute.PREFILL_LEG,
            prefill=prefill, refused=refused, holder=holder, taken=taken, preferred=preferred,
            work_tokens=((reuse.new_tokens or 0) if local
                         else prompt_work(turn.req.body, reuse, ids)),
            previous=previous, conversation=conv is not None, had_retained=had_retained,
            store_down=turn.store_down, from_prefix_cache=cached_decode is not None,
            router_ids=router_ids,
        )

    async def _plan(
        self, req: TurnRequest, conv: Conversation | None, prefill: Backend,
        timings: p.TurnTimings, tokenized: Tokenized | None,
    ) -> tuple[ReusePlan, Tokenized | None]:
        """What the prefill leg reads (the reuse policy's plan), with the prompt's token ids
        where they had to be asked for."""
        if conv is None:
            return ReusePlan(None, 0, p.MissCause.NO_CONVERSATION_ID), None
        checked_by_prefill = not req.api.token_ids_in_answer
        policy = self.policy

        def plan(prompt_ids: list[int] | None,
                 safety_margin_s: float = self.s.lease_safety_margin_s) -> ReusePlan:
            return policy.plan(conv, prompt_ids, checked_by_prefill=checked_by_prefill,
                               safety_margin_s=safety_margin_s)

        if not policy.checks_prefix:
            return plan(None), None
        holder = None
        if conv.retained is not None:
            holder = self.pool.by_name(conv.retained.decode_instance)
            if holder is None or not holder.available:
                self.retention.take(conv)
                conv.gone_cause = p.MissCause.DECODE_UNAVAILABLE
        if conv.retained is None:
            return plan(None), None
        if checked_by_prefill:
            # Responses / Messages: vLLM has no /tokenize for these; prefill's connector checks
            # the prompt against the handle's block hashes and reads only what matches.
            await self._lease_for_handoff(conv, timings)
            return plan(None), None
        if tokenized is not None and tokenized.ids is not None:
            timings.plan_tokenize_s = tokenized.tokenize_s  # while choosing its branch
            assert holder is not None
            # No safety margin: it guards a handle forwarded to prefill, and a turn decode
            # computes forwards none. If the lease ends before decode schedules the turn, its
            # prefix cache still holds the blocks unless it needed the space, and the turn's
            # record says what vLLM reported it computed (_check_local_hit).
            local = plan(tokenized.ids, safety_margin_s=0.0)
            if self._prefills_locally(local, holder, prefill):
                # Decode computes this turn on what its prefix cache holds: no handle goes to
                # prefill, so nothing need outlive a prefill queue, and no renewal is made.
                return local, None
            await self._lease_for_handoff(conv, timings)
            return plan(tokenized.ids), None
        tok, _ = await asyncio.gather(self._tokenize(req, prefill),
                                      self._lease_for_handoff(conv, timings))
        timings.plan_tokenize_s = tok.tokenize_s
        # No await from here until the handle is taken: a DELETE or eviction meanwhile has
        # already dropped conv.retained, and the plan says so.
        return plan(tok.ids), tok

    async def _lease_for_handoff(self, conv: Conversation, timings: p.TurnTimings) -> None:
        t0 = self.deps.clock.now_unix_s()
        await self.retention.extend_for_handoff(conv)
        timings.plan_lease_s = self.deps.clock.now_unix_s() - t0

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
            self.policy.checks_prefix and plan.cause is None
            and plan.handle is not None and new is not None
            and 0 < new <= self.s.local_prefill_max_tokens and holder.available
            and holder.prompt_backlog_tokens <= prefill.prompt_backlog_tokens
        )

    async def _cached_on_decode(
        self, req: TurnRequest, conv: Conversation | None, plan: ReusePlan, prefill: Backend,
        timings: p.TurnTimings, tokenized: Tokenized | None,
    ) -> tuple[tuple[ReusePlan, Backend] | None, Tokenized | None]:
        """A conversation whose decode-held KV has gone (its lease lapsed while a person
        thought, it was evicted or released) goes back to the decode instance that held it,
        to compute the turn there on what that instance's prefix cache still holds, when the
        cache holds all it could reuse and the rest is few tokens (``local_prefill_max_tokens``).

        vLLM keeps a freed block's KV, findable by its hash, until it needs the space: a lapsed
        lease ends the promise, not the data. The plan that comes back keeps its miss cause
        (``lease_expired`` ...): if decode has reused the space by the time the turn is
        scheduled, the turn records that miss, from what vLLM reports it computed.
        Also the prompt's token ids, where they had to be asked for.
        """
        if (
            conv is None or not self.policy.checks_prefix or plan.cause not in _GONE
            or conv.decode_instance is None or not conv.last_token_ids
            or self.s.local_prefill_max_tokens <= 0 or not req.api.token_ids_in_answer
        ):
            return None, None
        decode = self.pool.by_name(conv.decode_instance)
        if decode is None or not decode.available or not decode.control_url:
            return None, None
        prompt = plan.prompt_token_ids or (tokenized.ids if tokenized is not None else None)
        tok = None
        if prompt is None:
            try:
                tok = await self._tokenize(req, prefill)
            except RouterHTTPError:
                return None, None  # the prefill leg meets (and reports) the same problem
            timings.plan_tokenize_s = tok.tokenize_s
            prompt = tok.ids
            if prompt is None:
                return None, tok
        block, threshold = self.s.kv_block_size_tokens, self.s.kv_recompute_threshold_tokens
        reusable = p.reusable_prefix_tokens(conv.last_token_ids, prompt)
        if reusable < max(threshold, 1) or len(prompt) - reusable > self.s.local_prefill_max_tokens:
            return None, tok
        t0 = self.deps.clock.now_unix_s()
        cached = await self.deps.leases.cached_prefix(decode, prompt[:reusable])
        timings.plan_prefix_cache_s = self.deps.clock.now_unix_s() - t0
        if cached is None:
            return None, tok
        _, fires = p.reuse_verdict(reusable, cached, block_size=block,
                                   recompute_threshold_tokens=threshold)
        if not fires or not 0 < len(prompt) - cached <= self.s.local_prefill_max_tokens:
            return None, tok
        return (replace(plan, expected_reused_tokens=cached, prompt_token_ids=prompt), decode), tok

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
            sizing = LeaseSizing(initial_lease_s(self.s, hints),
                                 "default" if hints.next_turn_gap_s is None else "hints")
        else:
            # No hints (a coding agent): how the answer ended sizes its lease.
            sizing = size_after_answer(self.s, conv, ctx.answer.end(), ctx.record,
                                       conv.last_active_unix_s)
        conv.lease_basis = None
        await self.policy.keep(Answered(conv, decode, handle, ctx.prompt_ids + ctx.output_ids,
                                        ctx.handle_key, sizing, hints))

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
