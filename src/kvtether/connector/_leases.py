"""The lease table: which decode-held KV is retained, for whom, and until when.

Plain Python (no vLLM), shared by two kinds of threads:

* the **engine loop** (vLLM's scheduler, through ``kvtether.connector.nixl``) opens a lease
  when a turn finishes, ends every lease whose deadline has passed and hands the worker every
  new deadline once per step (:meth:`LeaseTable.drain`), and closes a lease when the worker
  reports its blocks freed (:meth:`LeaseTable.on_freed`);
* the **control channel**'s HTTP threads read snapshots, long-poll for handles, and renew and
  release leases, both decided at once.

The table, not the worker, owns expiry. The worker is told a lease's deadline plus
``worker_slack_s``, and the engine loop ends the lease at its own deadline (the worker frees the
blocks in that step). So a renewal is answered as soon as the table holds it: the later
deadline reaches the worker at the next step, long before the worker's own, later, deadline
could free the blocks under it, even with a step or two in flight (async scheduling). A release
only ever ends a lease early, so it is safe whenever it arrives.

Answers are domain results (:class:`Renewed`, :class:`Released`, :class:`Releasing`,
:class:`Gone`, :class:`TooLateToRenew`, :class:`NotFound`, :class:`Published`); only the
control channel (:mod:`._control`) turns them into HTTP status codes and bodies.

All state sits behind one ``threading.Condition``; every method holds it only briefly. Deadlines
are in the engine-core process's ``time.perf_counter()`` domain, the same clock vLLM stamps
``remote_blocks_expiry_time`` with and echoes in its NIXL handshake.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvtether.protocol import (
    LeaseInfo,
    LeaseList,
    LeaseState,
    LeaseTotals,
    PullOutcome,
)

__all__ = [
    "COUNTER_NAMES", "Gone", "HandleResult", "LeaseTable", "NotFound", "Opened", "Published",
    "ReleaseResult", "Released", "Releasing", "RenewResult", "Renewed", "TooLateToRenew",
]

logger = logging.getLogger(__name__)

COUNTER_NAMES = (
    "leases_created",
    "leases_renewed",
    "leases_released",
    "leases_expired",
    "leases_consumed",
    "leases_evicted",
    "handles_published",
    "handles_not_retained",
    # Prefill side: what happened to decode handles this instance was given.
    *(f"pulls_{outcome.value}" for outcome in PullOutcome),
    "pulled_tokens",
    "prefix_breaks",
)
_END_COUNTER = {
    LeaseState.RELEASED: "leases_released",
    LeaseState.EXPIRED: "leases_expired",
    LeaseState.CONSUMED: "leases_consumed",
    LeaseState.EVICTED: "leases_evicted",
}
_LIVE = (LeaseState.ACTIVE, LeaseState.RELEASING)


@dataclass(frozen=True)
class _Answered:
    """A lease's state after the call: the subclass says what happened to it."""

    info: LeaseInfo


class Renewed(_Answered):
    """The lease now ends no earlier than asked."""


class Released(_Answered):
    """The lease has ended (freed by this release, or ended before it)."""


class Releasing(_Answered):
    """The lease is released; the worker frees its blocks within a step or two."""


@dataclass(frozen=True)
class Gone:
    """The lease ended (or is ending) as ``state``: no handle, no renewal."""

    state: LeaseState
    info: LeaseInfo


@dataclass(frozen=True)
class TooLateToRenew:
    """The lease ends within ``renew_guard_s``: a renewal might reach the worker too late."""

    remaining_s: float
    info: LeaseInfo


@dataclass(frozen=True)
class NotFound:
    """No lease (or handle) under ``key``, live or remembered."""

    key: str


@dataclass(frozen=True)
class Published:
    """The handle of an active lease, with the lease's own deadline."""

    key: str
    info: LeaseInfo
    kv_transfer_params: dict[str, Any]


RenewResult = Renewed | Gone | TooLateToRenew | NotFound
ReleaseResult = Released | Releasing | NotFound
HandleResult = Published | Gone | NotFound


@dataclass(frozen=True)
class Opened:
    """What :meth:`LeaseTable.open` decided: the new lease's deadline (what its handle
    carries) and ``{request_id: deadline}`` for the worker."""

    deadline: float
    updates: dict[str, float]


@dataclass
class _Lease:
    key: str
    request_id: str
    handle: dict[str, Any]
    retained_blocks: int
    retained_tokens: int
    deadline: float
    created: float
    state: LeaseState = LeaseState.ACTIVE
    end_as: LeaseState | None = None  # final state once a RELEASING lease is freed
    renewals: int = 0
    ended: float | None = None


class LeaseTable:
    def __init__(
        self,
        *,
        max_lease_ttl_s: float = 86400.0,
        max_retained_tokens: int | None = None,
        renew_guard_s: float = 1.0,
        op_timeout_s: float = 10.0,
        worker_slack_s: float = 30.0,
        clock: Callable[[], float] = time.perf_counter,
        wall: Callable[[], float] = time.time,
        history: int = 256,
    ) -> None:
        self.max_lease_ttl_s = max_lease_ttl_s
        self.max_retained_tokens = max_retained_tokens
        self.renew_guard_s = renew_guard_s
        self.op_timeout_s = op_timeout_s
        self.worker_slack_s = worker_slack_s
        self._clock, self._wall, self._history = clock, wall, history
        self._cond = threading.Condition()
        self._live: dict[str, _Lease] = {}
        self._key_of: dict[str, str] = {}  # request id -> key of its live lease
        self._ended: OrderedDict[str, _Lease] = OrderedDict()
        # Keys released before their turn finished (the router gave up on a stream): the lease
        # they would open is released at once. Bounded like the history.
        self._released_early: OrderedDict[str, None] = OrderedDict()
        # Deadlines decided off the engine loop (a renewal, a release), for the worker at the
        # next step.
        self._updates: dict[str, float] = {}
        self._counters: Counter[str] = Counter({name: 0 for name in COUNTER_NAMES})
        # Called (outside the lock) when the worker has a new deadline to learn: a sleeping
        # engine steps to tell it (kvtether.connector.scheduler).
        self.on_queued: Callable[[], None] | None = None

    # --- engine loop ----------------------------------------------------------------------
    def open(
        self,
        key: str,
        request_id: str,
        handle: dict[str, Any],
        *,
        retained_blocks: int,
        retained_tokens: int,
        ttl_s: float,
    ) -> Opened:
        """Start a lease and publish its handle; returns its deadline and the deadlines to
        send to the worker (the new lease's, plus any lease evicted to make room)."""
        with self._cond:
            now = self._clock()
            self._free_key(key)
            lease = _Lease(key, request_id, dict(handle), retained_blocks, retained_tokens,
                           deadline=now + min(ttl_s, self.max_lease_ttl_s), created=now)
            updates = self._make_room(lease, now)
            if self._released_early.pop(key, False) is None:
                self._start_release(lease, now, LeaseState.RELEASED)
            self._live[key] = lease
            self._key_of[request_id] = key
            if lease.state is LeaseState.ACTIVE:
                self._counters["leases_created"] += 1
                self._counters["handles_published"] += 1
            else:
                self._counters["handles_not_retained"] += 1
            updates[request_id] = self._worker_deadline(lease)
            self._cond.notify_all()
            return Opened(lease.deadline, updates)

    def _make_room(self, lease: _Lease, now: float) -> dict[str, float]:
        cap = self.max_retained_tokens
        if cap is None:
            return {}
        if lease.retained_tokens > cap:  # alone too large: free it at once
            self._start_release(lease, now, LeaseState.NOT_RETAINED)
            return {}
        updates: dict[str, float] = {}
        held = sum(x.retained_tokens for x in self._live.values() if x.state is LeaseState.ACTIVE)
        for victim in sorted(self._active(), key=lambda x: x.deadline):
            if held + lease.retained_tokens <= cap:
                break
            self._start_release(victim, now, LeaseState.EVICTED)
            updates[victim.request_id] = victim.deadline
            held -= victim.retained_tokens
        return updates

    def not_retained(self, key: str, request_id: str) -> None:
        """The turn carrying ``key`` ended without retaining KV: answer waiters with 410."""
        with self._cond:
            now = self._clock()
            self._free_key(key)
            lease = _Lease(key, request_id, {}, 0, 0, deadline=now, created=now,
                           state=LeaseState.NOT_RETAINED, ended=now)
            self._remember(lease)
            self._counters["handles_not_retained"] += 1
            self._cond.notify_all()

    def drain(self) -> dict[str, float]:
        """End the leases whose deadline has passed; returns ``{request_id: new deadline}``
        for the worker: those, and the renewals and releases decided since the last step."""
        with self._cond:
            now = self._clock()
            for lease in self._active():
                if now >= lease.deadline:
                    # In place of upstream's worker warning, which kvtether's ended leases skip.
                    logger.warning("lease %s (request %s) lapsed after %d renewal(s); freeing "
                                   "its %d blocks", lease.key, lease.request_id,
                                   lease.renewals, lease.retained_blocks)
                    self._start_release(lease, lease.deadline, LeaseState.EXPIRED)
                    self._updates[lease.request_id] = lease.deadline
            updates, self._updates = self._updates, {}
            return updates

    def next_deadline(self) -> float | None:
        """The earliest deadline of a live lease (a sleeping engine wakes to end it)."""
        with self._cond:
            return min((x.deadline for x in self._active()), default=None)

    def on_freed(self, request_ids: Iterable[str]) -> None:
        """The worker freed these requests' blocks (``finished_sending``): close their leases."""
        with self._cond:
            now = self._clock()
            for request_id in request_ids:
                key = self._key_of.pop(request_id, None)
                if key is None:
                    continue  # not a lease (e.g. prefill-held blocks a decode read)
                lease = self._live.pop(key, None)
                if lease is None:
                    continue
                if lease.state is LeaseState.RELEASING:
                    assert lease.end_as is not None
                    lease.state = lease.end_as
                elif now >= lease.deadline:
                    lease.state = LeaseState.EXPIRED
                else:
                    lease.state = LeaseState.CONSUMED
                lease.ended = now
                if lease.state in _END_COUNTER:
                    self._counters[_END_COUNTER[lease.state]] += 1
                self._remember(lease)
            self._cond.notify_all()

    def has_pending_work(self, window_s: float = 2.0) -> bool:
        """The worker has deadlines to learn, a lease's deadline has passed, or a lease that
        ended in the last ``window_s`` is not freed yet (an engine step does each)."""
        with self._cond:
            if self._updates:
                return True
            now = self._clock()
            return any(now >= x.deadline and (x.state is LeaseState.ACTIVE
                                              or now - x.deadline <= window_s)
                       for x in self._live.values())

    def count(self, name: str, n: int = 1) -> None:
        with self._cond:
            self._counters[name] += n

    # --- control channel ------------------------------------------------------------------
    def renew(self, key: str, ttl_s: float) -> RenewResult:
        """Extend ``key``'s lease to at least ``ttl_s`` from now, decided at once: the worker
        learns the later deadline at the next step, well before its own deadline passes (see
        the module docstring)."""
        with self._cond:
            result = self._renew(key, ttl_s)
        if isinstance(result, Renewed) and self.on_queued is not None:
            self.on_queued()  # a sleeping engine steps to tell its worker
        return result

    def release(self, key: str, wait_s: float | None = None) -> ReleaseResult:
        """Start freeing ``key``'s blocks, then wait up to ``wait_s`` (default
        ``op_timeout_s``) for the worker to have freed them: :class:`Released` with the final
        state once freed, else :class:`Releasing` (freed within a step or two).

        Decided at once: a release only ever ends a lease, so nothing can read blocks the
        answer promised (the lease is ``releasing`` from now on: no handle, no renewal), and
        the worker is told at the next step. A loaded engine's step can take seconds, longer
        than a session client waits for its DELETE.
        """
        with self._cond:
            result = self._release(key)
        if not isinstance(result, Releasing):
            return result
        if self.on_queued is not None:
            self.on_queued()  # a sleeping engine steps to tell its worker
        wait = self.op_timeout_s if wait_s is None else min(wait_s, self.op_timeout_s)
        end = self._clock() + wait
        with self._cond:
            self._cond.wait_for(lambda: key not in self._live, max(0.0, end - self._clock()))
            lease = self._ended.get(key)
            if lease is not None and lease.state is not LeaseState.RELEASING:
                return Released(self._info(lease))
        return result

    def handle(self, key: str, wait_s: float) -> HandleResult:
        """The published handle for ``key``, waiting up to ``wait_s`` for it to appear."""
        with self._cond:
            self._cond.wait_for(lambda: key in self._live or key in self._ended, wait_s)
            lease = self._live.get(key) or self._ended.get(key)
            if lease is None:
                return NotFound(key)
            if lease.state is not LeaseState.ACTIVE:
                return self._gone(lease)
            params = dict(lease.handle, remote_blocks_expiry_time=lease.deadline)
            return Published(key, self._info(lease), params)

    def lease(self, key: str) -> LeaseInfo | NotFound:
        with self._cond:
            lease = self._live.get(key) or self._ended.get(key)
            return NotFound(key) if lease is None else self._info(lease)

    def leases(self) -> LeaseList:
        with self._cond:
            return LeaseList(
                leases=[self._info(x) for x in self._live.values()],
                recently_ended=[self._info(x) for x in reversed(self._ended.values())],
                totals=self._totals(),
                unix_time=self._wall(),
                perf_counter=self._clock(),
            )

    def totals(self) -> LeaseTotals:
        with self._cond:
            return self._totals()

    def counters(self) -> dict[str, int]:
        with self._cond:
            return dict(self._counters)

    # --- internals (call with the lock held) -----------------------------------------------
    def _renew(self, key: str, ttl_s: float) -> RenewResult:
        lease = self._live.get(key)
        if lease is None:
            ended = self._ended.get(key)
            # Renewing a lease that ended is not possible.
            return NotFound(key) if ended is None else self._gone(ended)
        if lease.state is not LeaseState.ACTIVE:
            return self._gone(lease)
        now = self._clock()
        if lease.deadline - now < self.renew_guard_s:
            return TooLateToRenew(lease.deadline - now, self._info(lease))
        # Extend only: a handle already forwarded carries the old deadline, and P trusts it.
        # Ending a lease early is what release is for.
        lease.deadline = max(lease.deadline, now + min(ttl_s, self.max_lease_ttl_s))
        lease.renewals += 1
        self._counters["leases_renewed"] += 1
        self._updates[lease.request_id] = self._worker_deadline(lease)
        return Renewed(self._info(lease))

    def _release(self, key: str) -> ReleaseResult:
        lease = self._live.get(key)
        if lease is None:
            ended = self._ended.get(key)
            if ended is not None:
                return Released(self._info(ended))  # DELETE is idempotent
            # Its turn may still be finishing: free what it retains when it opens.
            self._released_early[key] = None
            while len(self._released_early) > self._history:
                self._released_early.popitem(last=False)
            return NotFound(key)
        if lease.state is LeaseState.ACTIVE:
            self._start_release(lease, self._clock(), LeaseState.RELEASED)
            self._updates[lease.request_id] = lease.deadline
        return Releasing(self._info(lease))

    def _free_key(self, key: str) -> None:
        """A reused key belongs to the newest turn; an older live lease keeps its request id."""
        old = self._live.pop(key, None)
        if old is not None:
            old.key = old.request_id
            self._live[old.key] = old
            self._key_of[old.request_id] = old.key
        self._ended.pop(key, None)

    def _start_release(self, lease: _Lease, now: float, end_as: LeaseState) -> None:
        lease.state, lease.end_as, lease.deadline = LeaseState.RELEASING, end_as, now

    def _worker_deadline(self, lease: _Lease) -> float:
        """When the worker would free ``lease``'s blocks on its own: a live lease's deadline
        plus the slack (the engine loop ends it at its deadline); an ended one's, at once."""
        if lease.state is LeaseState.ACTIVE:
            return lease.deadline + self.worker_slack_s
        return lease.deadline

    def _active(self) -> list[_Lease]:
        return [x for x in self._live.values() if x.state is LeaseState.ACTIVE]

    def _remember(self, lease: _Lease) -> None:
        self._ended[lease.key] = lease
        self._ended.move_to_end(lease.key)
        while len(self._ended) > self._history:
            self._ended.popitem(last=False)

    def _totals(self) -> LeaseTotals:
        live = list(self._live.values())
        return LeaseTotals(
            active_leases=sum(x.state is LeaseState.ACTIVE for x in live),
            retained_blocks=sum(x.retained_blocks for x in live),
            retained_tokens=sum(x.retained_tokens for x in live),
        )

    def _gone(self, lease: _Lease) -> Gone:
        state = lease.end_as if lease.state is LeaseState.RELEASING else lease.state
        assert state is not None
        return Gone(state, self._info(lease))

    def _info(self, lease: _Lease) -> LeaseInfo:
        now, wall = self._clock(), self._wall()
        live = lease.state in _LIVE
        return LeaseInfo(
            key=lease.key,
            request_id=lease.request_id,
            state=lease.state,
            retained_blocks=lease.retained_blocks if live else 0,
            retained_tokens=lease.retained_tokens if live else 0,
            deadline_unix_s=wall + (lease.deadline - now),
            remaining_s=max(0.0, lease.deadline - now) if live else 0.0,
            remote_blocks_expiry_time=lease.deadline,
            renewals=lease.renewals,
            created_unix_s=wall + (lease.created - now),
            ended_unix_s=None if lease.ended is None else wall + (lease.ended - now),
        )

