"""kvtether's vLLM KV connector: vLLM 0.32's NIXL pull connector, plus leases on decode-held
KV, handle publication for streamed turns, and a prefix check before prefill reads.

Load it on every prefill and decode instance with::

    --kv-transfer-config '{"kv_connector": "NixlConnector",
        "kv_connector_module_path": "kvtether.connector.nixl", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {
            "bidirectional_kv_xfer": true, "kvtether_control_port": 5900,
            "kvtether_lease_ttl_s": 60}}'

vLLM's factory imports ``kv_connector_module_path`` and takes the class named
``kv_connector`` from it; the class keeps upstream's name because vLLM checks for
``"NixlConnector"`` by name (``config/vllm.py``, ``platforms/cpu.py``). Its three classes
override one upstream module's three classes and are read against each other; the private
upstream state they change is reached through :mod:`._compat.upstream`, and what stands alone
has its own module: the two sides of a turn (:mod:`._sides`), leases, prefix check, control
API, leg timings, stall watch.

The scheduler side does the work; workers run upstream code, except that decode's worker
credits its heartbeats when it checks prefill's deadline (below). The flow on decode (D):

* ``request_finished``: upstream delays freeing the blocks of a finished turn and sends the
  worker ``request_id -> perf_counter() + decoder_kv_blocks_ttl`` as its deadline. kvtether
  replaces that deadline with the lease's (``kvtether_lease_ttl_s`` from the request's
  ``kv_transfer_params``, else from extra_config), adds the prefix hashes to the handle, and
  publishes it under ``kvtether_handle_key`` (else under the request id).
* The worker is told a lease's deadline plus ``kvtether_worker_slack_s``: the lease table, not
  the worker, owns expiry, so the control channel answers a renewal at once
  (``kvtether.connector._leases``).
* ``build_connector_meta`` (once per engine step) first drains the lease table into those
  deadlines: renewals and releases since the last step, and the leases whose deadline has
  passed (ended now). Upstream ships them to the worker as ``reqs_to_send`` with
  ``scheduler_clock``, and the worker *overwrites* its deadline for every request it still
  holds (rebased onto its clock; unlike the ``HB:`` heartbeat path, which only extends with
  ``max``). A renewal is a later deadline; an ended lease's is at or before the scheduler's
  clock, so the worker's reaper frees the blocks in the same step.
* The worker reports freed blocks as ``finished_sending`` (P read the handle, a lease ended),
  vLLM frees them, and ``update_connector_output`` closes the lease as consumed, expired,
  released or evicted.

On prefill (P), ``get_num_new_matched_tokens`` checks a decode handle's block hashes against
the prompt and cuts the handle to the matching whole-block prefix before upstream code reads
it; P's response ``kv_transfer_params`` report what happened (``kvtether_pull``, ...), and
carry P's own deadline for the new turn's KV (``remote_blocks_expiry_time``, which upstream
sets only on D's handles), so that D declines a read that comes after P may have freed it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from cachetools import TTLCache

from kvtether.connector._compat.upstream import (
    EXPIRED_SEND_MESSAGE,
    READ_MARGIN_S,
    UPSTREAM_WORKER_LOGGER,
    VLLM_VERSION,
    KVConnectorRole,
    NixlBaseConnector,
    NixlPullConnector,
    NixlWrapper,
    PullScheduler,
    PullWorker,
)
from kvtether.connector._control import ControlServer, start_control_server
from kvtether.connector._cores import keep_thread_affinity
from kvtether.connector._idle import EngineWaker, HeldDeadlines
from kvtether.connector._leases import LeaseTable
from kvtether.connector._quiet import progress_thread_delay, shorten_rpc_spin
from kvtether.connector._settings import ConnectorSettings
from kvtether.connector._sides import DecodeSide, PrefillSide, is_prefill_request
from kvtether.connector._stall import process_watch, rpcs_watched
from kvtether.connector._timings import LegTimings, StepClock
from kvtether.protocol import ConnectorStatus, IdleInfo, PrefixCacheAnswer
from kvtether.protocol._kv_params import KV_PARAM_LOCAL_PREFILL

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["NixlConnector", "KVTetherScheduler", "KVTetherWorker", "VLLM_VERSION"]

logger = logging.getLogger(__name__)


class _EndedByKVTether(logging.Filter):
    """Upstream's worker logs every send-side deadline that passes as a WARNING ("Releasing
    expired KV blocks ..."), including the deadline kvtether sets to end a lease (released,
    evicted, or lapsed, which the lease table logs itself). This filter logs those at DEBUG
    instead. Blocks the worker frees at its own deadline (a lease's plus the slack: the engine
    loop did not end it in time), and prefill's hold of KV that no decode read, keep
    upstream's warning."""

    def __init__(self) -> None:
        super().__init__()
        # A request marked here that is never reaped (not retained after all) ages out.
        self.ended: TTLCache[str, None] = TTLCache(maxsize=65536, ttl=300.0)

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith(EXPIRED_SEND_MESSAGE)
                and record.args and isinstance(record.args, tuple)):
            return True
        request_id = record.args[0]
        if request_id not in self.ended:
            return True
        del self.ended[request_id]
        logger.debug("request %s: KV freed, its lease ended by kvtether", request_id)
        return False


_ENDED_BY_KVTETHER = _EndedByKVTether()


def quiet_ended_leases() -> None:
    """Put the filter on upstream's worker logger (once per process)."""
    upstream = logging.getLogger(UPSTREAM_WORKER_LOGGER)
    if _ENDED_BY_KVTETHER not in upstream.filters:
        upstream.addFilter(_ENDED_BY_KVTETHER)


class KVTetherScheduler(PullScheduler):
    """Scheduler side (engine-core process): upstream's hooks hand each request to its side
    (:mod:`._sides`), and hold the lease table, the control channel, the leg timings and what a
    sleeping engine needs to know."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, engine_id, kv_cache_config)
        assert vllm_config.kv_transfer_config is not None
        self.settings = settings = ConnectorSettings.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config
        )
        self.default_lease_ttl_s = float(settings.lease_ttl_s or self.decoder_kv_blocks_ttl)
        self.leases = LeaseTable(
            max_lease_ttl_s=settings.max_lease_ttl_s,
            max_retained_tokens=settings.max_retained_tokens,
            renew_guard_s=settings.renew_guard_s,
            op_timeout_s=settings.op_timeout_s,
            worker_slack_s=settings.worker_slack_s,
        )
        self.prefill = PrefillSide(self.leases, require_block_hashes=settings.require_block_hashes)
        self.decode = DecodeSide(self, self.leases, block_size=self.block_size,
                                 default_lease_ttl_s=self.default_lease_ttl_s)
        self.timings: dict[str, LegTimings] = {}
        self.held = HeldDeadlines()
        self.steps = StepClock()
        self._waker: EngineWaker | None = None
        # The engine core waits for each step's result on the worker's response queue,
        # spinning on sched_yield: a core-share taken from the workers while a loaded engine
        # steps back to back.
        shorten_rpc_spin(settings.rpc_busy_loop_s)
        # The engine's prefix-cache lookup, attached by kvtether's scheduler class (the
        # connector itself cannot see vLLM's block pool).
        self._prefix_cache: Callable[[list[int]], PrefixCacheAnswer | None] | None = None
        self._control: ControlServer | None = start_control_server(
            settings, vllm_config.parallel_config.data_parallel_index,
            self.leases, self.status, self.prefix_cache,
        )

    def status(self) -> ConnectorStatus:
        return ConnectorStatus(
            engine_id=self.engine_id,
            role=self.settings.role,
            vllm_version=VLLM_VERSION,
            block_size=self.block_size,
            default_lease_ttl_s=self.default_lease_ttl_s,
            max_lease_ttl_s=self.settings.max_lease_ttl_s,
            max_retained_tokens=self.settings.max_retained_tokens,
            read_margin_s=READ_MARGIN_S,
            totals=self.leases.totals(),
            counters=self.leases.counters(),
            unix_time=time.time(),
            perf_counter=time.perf_counter(),
            idle=None if self._waker is None else IdleInfo(
                tick_s=self._waker.tick_s, engine_steps=self._waker.steps,
                wakeups=dict(self._waker.wakeups),
            ),
            step_running_s=self.steps.running_s(),
        )

    def attach_prefix_cache(
        self, lookup: Callable[[list[int]], PrefixCacheAnswer | None]
    ) -> None:
        self._prefix_cache = lookup

    def prefix_cache(self, token_ids: list[int]) -> PrefixCacheAnswer | None:
        """What this engine's prefix cache holds of ``token_ids`` (None: cannot tell)."""
        lookup = self._prefix_cache
        return None if lookup is None else lookup(token_ids)

    # --- steps (kvtether.connector.scheduler.TetherScheduler reports them) -----------------
    def step_began(self) -> None:
        self.steps.began()

    def step_ended(self) -> None:
        self.steps.ended()

    def step_running_s(self) -> float | None:
        return self.steps.running_s()

    # --- sleeping engine (kvtether.connector.scheduler.IdleSleepScheduler) -----------------
    def attach_waker(self, waker: EngineWaker) -> None:
        """Renewals and releases from the control channel wake the sleeping engine (its
        worker learns the new deadline at the next step)."""
        self._waker = waker
        self.leases.on_queued = lambda: waker.request_step("control")

    def next_deadline(self) -> float | None:
        """Earliest deadline of blocks held for a remote reader (a lease's own, which the
        engine loop ends; the worker's otherwise); ``None`` if none is held."""
        deadlines = [self.held.earliest(), self.leases.next_deadline()]
        return min((d for d in deadlines if d is not None), default=None)

    def needs_step(self) -> bool:
        """Work only an engine step can do: deadlines the worker has yet to learn, leases
        ended or due to end, deadlines that just passed."""
        return self.leases.has_pending_work() or self.held.just_passed()

    # --- upstream's hooks: each request goes to its side ------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params:
            self.timings.setdefault(request.request_id, LegTimings(taken_up=time.time()))
        if params and params.get(KV_PARAM_LOCAL_PREFILL):
            self.decode.local_prefill_hit(request, num_computed_tokens)
            return 0, False
        if not self.prefill.may_read(request, num_computed_tokens):
            return 0, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if params and params.get(KV_PARAM_LOCAL_PREFILL):
            self.decode.hold_local_prefill(request)
            return
        self.prefill.allocated(request, num_external_tokens)
        if num_external_tokens > 0 and (timing := self.timings.get(request.request_id)):
            timing.read_started = time.time()
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(
        self, request: Request, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        timing = self.timings.pop(request_id, None)
        params = request.kv_transfer_params
        if not params:
            self.prefill.forget(request_id)
            self.decode.forget(request_id)
            return super().request_finished(request, block_ids)
        delay, out = super().request_finished(request, block_ids)
        timings = None if timing is None else timing.as_params(
            float(request.arrival_time), time.time())
        if is_prefill_request(params):
            self.decode.forget(request_id)
            return self.prefill.finished(request, delay, out, timings,
                                         self.send_deadline(request_id))
        self.prefill.forget(request_id)
        return self.decode.finished(request, delay, out, timings)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        # Renewed deadlines and ended leases ride upstream's reqs_to_send to the worker.
        self.set_send_deadlines(self.leases.drain())
        self.held.update(self.send_deadlines())
        return super().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        for request_id in connector_output.finished_recving or ():
            if (timing := self.timings.get(request_id)) is not None:
                timing.read_done = time.time()
        if connector_output.finished_sending:
            self.held.freed(connector_output.finished_sending)
            self.leases.on_freed(connector_output.finished_sending)
        for request_id in connector_output.failed_recving or ():
            self.prefill.read_failed(request_id)

    def shutdown(self) -> None:
        super().shutdown()
        if self._control is not None:
            self._control.close()
            self._control = None


class NixlConnector(NixlPullConnector):
    """Upstream's pull connector with :class:`KVTetherScheduler` on the scheduler side."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        # Same construction as NixlPullConnector.__init__, with our scheduler class.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KVTetherScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = KVTetherWorker(vllm_config, self.engine_id, kv_cache_config)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        # Every step binds its metadata first and asks for finished transfers last.
        if isinstance(self.connector_worker, KVTetherWorker):
            self.connector_worker.step_began()
        super().bind_connector_metadata(connector_metadata)


class HeartbeatRun(NamedTuple):
    """The heartbeats a decode worker sent prefill for one request (only decode sends them,
    for a new turn's KV waiting on prefill; upstream sends none for bidirectional reads)."""

    first: float  # perf_counter() of the first one sent
    last: float  # of the latest one
    unbroken: bool  # none came more than an extension after the one before


class KVTetherWorker(PullWorker):
    """Upstream's pull worker, built with the idle settings of :mod:`._quiet` when asked and
    left on the cores vLLM bound it to (:mod:`._cores`), that also declines decode's late read
    of prefill's KV (see :meth:`late_read_expired`) and reports a step that does not end
    (:mod:`._stall`)."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig):
        assert vllm_config.kv_transfer_config is not None
        settings = ConnectorSettings.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config
        )
        with (progress_thread_delay(NixlWrapper, settings.progress_thread_delay_us),
              keep_thread_affinity()):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        shorten_rpc_spin(settings.rpc_busy_loop_s)
        quiet_ended_leases()
        # Prefill-side request id -> the heartbeats this worker sent prefill for it.
        self._heartbeats: TTLCache[str, HeartbeatRun] = TTLCache(
            maxsize=65536, ttl=max(1.0, self.lease_extension_s)
        )
        # A step that does not end is logged with every thread's stack (see ._stall); under
        # WatchedCPUWorker the whole RPC is watched instead of the connector's part of it.
        self._step_watch = (None if settings.stall_report_s is None or rpcs_watched()
                            else process_watch(settings.stall_report_s))

    def start_load_kv(self, metadata: Any) -> None:
        # A deadline at or before the scheduler's clock is a lease kvtether ended (release,
        # eviction): its blocks are freed this step, and not worth upstream's warning.
        clock = getattr(metadata, "scheduler_clock", 0.0)
        if clock:
            for request_id, deadline in metadata.reqs_to_send.items():
                if deadline <= clock:
                    _ENDED_BY_KVTETHER.ended[request_id] = None
        super().start_load_kv(metadata)

    def step_began(self) -> None:
        """The engine sent this worker a step (before its forward pass)."""
        if self._step_watch is not None:
            self._step_watch.begin()

    def get_transfer_results(self) -> Any:
        # The last connector call of every step (upstream's get_finished goes through it).
        try:
            return super().get_transfer_results()
        finally:
            if self._step_watch is not None:
                self._step_watch.end()

    def heartbeats_sent(self, metadata: Any) -> None:
        now = time.perf_counter()
        gap_s = self.lease_extension_s - READ_MARGIN_S
        for engine_id, hb in metadata.heartbeat_by_engine.items():
            if not self.handshaken(engine_id):  # not sent: waiting for a handshake
                continue
            for rid in hb.req_ids:
                prev = self._heartbeats.get(rid)
                self._heartbeats[rid] = (
                    HeartbeatRun(now, now, True) if prev is None
                    else HeartbeatRun(prev.first, now, prev.unbroken and now - prev.last < gap_s)
                )

    def late_read_expired(self, meta: Any, upstream_expired: bool) -> bool:
        """Upstream's check, which prefill's exported deadline now also reaches for decode's
        read of a new turn, credited with the heartbeats this worker sent.

        A heartbeat extends prefill's hold to its arrival + ``kv_lease_duration * 2/3`` only
        if prefill still held the blocks then: credited when the first was sent before the
        exported deadline and none came later than an extension after the one before.
        """
        beats = self._heartbeats.pop(meta.remote.request_id, None)
        if not upstream_expired:
            return False
        if beats is None:
            return True
        deadline = meta.remote.blocks_expiry_time - self.clock_offset(meta.remote.engine_id)
        if not beats.unbroken or beats.first + READ_MARGIN_S >= deadline:
            return True
        return time.perf_counter() + READ_MARGIN_S >= beats.last + self.lease_extension_s
