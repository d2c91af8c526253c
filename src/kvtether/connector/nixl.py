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
``"NixlConnector"`` by name (``config/vllm.py``, ``platforms/cpu.py``). The module is over 400
lines on purpose: its three classes override one upstream module's three classes and are
read against each other; what stands alone (leases, prefix check, control API, stall watch)
has its own module.

The scheduler side does the work; workers run upstream code, except that decode's worker
credits its heartbeats when it checks prefill's deadline (below). The flow on decode (D):

* ``request_finished``: upstream delays freeing the blocks of a finished turn and puts
  ``request_id -> perf_counter() + decoder_kv_blocks_ttl`` into ``_reqs_need_send``. kvtether
  replaces that deadline with the lease's (``kvtether_lease_ttl_s`` from the request's
  ``kv_transfer_params``, else from extra_config), adds the prefix hashes to the handle, and
  publishes it under ``kvtether_handle_key`` (else under the request id).
* The worker is told a lease's deadline plus ``kvtether_worker_slack_s``: the lease table, not
  the worker, owns expiry, so the control channel answers a renewal at once
  (``kvtether.connector._leases``).
* ``build_connector_meta`` (once per engine step) first drains the lease table into
  ``_reqs_need_send``: renewals and releases since the last step, and the leases whose deadline
  has passed (ended now). Upstream ships that dict to the worker as ``reqs_to_send`` with
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
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cachetools import TTLCache

from kvtether.connector._compat import check_vllm_version

VLLM_VERSION = check_vllm_version()

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.nixl_utils import NixlWrapper  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (  # noqa: E402
    NixlBaseConnector,
    NixlPullConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (  # noqa: E402
    NixlPullConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (  # noqa: E402
    _KV_BLOCKS_EXPIRY_SAFETY_MARGIN,
    NixlPullConnectorWorker,
)

from kvtether.connector._control import ControlServer  # noqa: E402
from kvtether.connector._cores import keep_thread_affinity  # noqa: E402
from kvtether.connector._idle import EngineWaker  # noqa: E402
from kvtether.connector._leases import LeaseTable  # noqa: E402
from kvtether.connector._quiet import progress_thread_delay, shorten_rpc_spin  # noqa: E402
from kvtether.connector._prefix import (  # noqa: E402
    PullRecord,
    annotate_handle,
    apply_prefix_decision,
    decide_prefix,
)
from kvtether.connector._settings import ConnectorSettings  # noqa: E402
from kvtether.connector._stall import process_watch, rpcs_watched  # noqa: E402
from kvtether.errors import ConfigError  # noqa: E402
from kvtether.protocol import (  # noqa: E402
    ConnectorStatus,
    PrefixCacheAnswer,
    IdleInfo,
)
from kvtether.protocol._kv_params import (  # noqa: E402
    KV_PARAM_CACHED_TOKENS,
    KV_PARAM_HANDLE_KEY,
    KV_PARAM_LEASE_KEY,
    KV_PARAM_LEASE_TTL_S,
    KV_PARAM_LOCAL_PREFILL,
    KV_PARAM_OUTPUT_TOKEN_IDS,
    KV_PARAM_PROMPT_TOKEN_IDS,
    KV_PARAM_PULL,
    KV_PARAM_REPORT_TOKEN_IDS,
    KV_PARAM_TIMINGS,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["NixlConnector", "KVTetherScheduler", "KVTetherWorker", "VLLM_VERSION"]

logger = logging.getLogger(__name__)

# How long past its deadline a held request keeps the engine stepping (the worker frees it on
# the first step after its own, slightly later, deadline); after that only the tick retries.
_PAST_DUE_STEP_S = 2.0

# Upstream's worker logs every send-side deadline that passes as a WARNING, "Releasing expired
# KV blocks ...", including the deadline kvtether sets to end a lease (released, evicted, or
# lapsed, which the lease table logs itself).
_UPSTREAM_WORKER_LOGGER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
_EXPIRED_MESSAGE = "Releasing expired KV blocks"


class _EndedByKVTether(logging.Filter):
    """Drops upstream's expiry warning for requests whose lease kvtether ended (a release, an
    eviction or a lapse reached the worker as a deadline at or before the scheduler's clock);
    logs them at DEBUG instead. Blocks the worker frees at its own deadline (a lease's plus
    the slack: the engine loop did not end it in time), and prefill's hold of KV that no
    decode read, keep upstream's warning."""

    def __init__(self) -> None:
        super().__init__()
        # A request marked here that is never reaped (not retained after all) ages out.
        self.ended: TTLCache[str, None] = TTLCache(maxsize=65536, ttl=300.0)

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith(_EXPIRED_MESSAGE)
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
    upstream = logging.getLogger(_UPSTREAM_WORKER_LOGGER)
    if _ENDED_BY_KVTETHER not in upstream.filters:
        upstream.addFilter(_ENDED_BY_KVTETHER)


class KVTetherScheduler(NixlPullConnectorScheduler):
    """Scheduler side (engine-core process): lease table, control channel, prefix check."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, engine_id, kv_cache_config)
        assert vllm_config.kv_transfer_config is not None
        self.settings = ConnectorSettings.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config
        )
        self.default_lease_ttl_s = float(self.settings.lease_ttl_s or self.decoder_kv_blocks_ttl)
        self.leases = LeaseTable(
            max_lease_ttl_s=self.settings.max_lease_ttl_s,
            max_retained_tokens=self.settings.max_retained_tokens,
            renew_guard_s=self.settings.renew_guard_s,
            op_timeout_s=self.settings.op_timeout_s,
            worker_slack_s=self.settings.worker_slack_s,
        )
        self._pulls: dict[str, PullRecord] = {}
        # Local-prefill turns (decode computes the new tokens on the KV it retains): request id
        # -> prompt tokens found in this engine's own prefix cache.
        self._local_hits: dict[str, int] = {}
        # Request id -> [first taken up by the scheduler, KV read started, read done]
        # (time.time(), like vLLM's request.arrival_time): the leg's EngineTimings.
        self._timings: dict[str, list[float | None]] = {}
        # Deadlines of every request whose blocks wait for a remote reader (both roles), as
        # sent to the worker: when a sleeping engine must wake to free them.
        self._held_deadlines: dict[str, float] = {}
        self._waker: EngineWaker | None = None
        # perf_counter() when the engine's step in flight was scheduled; None between steps.
        self._step_began: float | None = None
        # The engine core waits for each step's result on the worker's response queue, spinning
        # on sched_yield for up to a second: a core-share taken from the workers while a loaded
        # engine steps back to back (31% of a core measured at 16 conversations).
        shorten_rpc_spin(self.settings.rpc_busy_loop_s)
        # The engine's prefix-cache lookup, attached by kvtether's scheduler class (the
        # connector itself cannot see vLLM's block pool).
        self._prefix_cache: Callable[[list[int]], PrefixCacheAnswer | None] | None = None
        self._control: ControlServer | None = None
        if self.settings.control_port is not None:
            # Like the NIXL side channel: one port per data-parallel rank.
            port = self.settings.control_port + vllm_config.parallel_config.data_parallel_index
            host = self.settings.control_host
            secret = self.settings.control_secret
            try:
                self._control = ControlServer(
                    self.leases, self.status, host, port,
                    secret=secret.get_secret_value() if secret else None,
                    max_body_bytes=self.settings.control_max_body_bytes,
                    prefix_cache=self.prefix_cache,
                )
            except OSError as exc:
                raise ConfigError(
                    f"kvtether control channel cannot listen on {host}:{port} ({exc}); "
                    "set kv_connector_extra_config.kvtether_control_port to a free port"
                ) from exc
            self._control.start()

    def status(self) -> ConnectorStatus:
        return ConnectorStatus(
            engine_id=self.engine_id,
            role=self.settings.role,
            vllm_version=VLLM_VERSION,
            block_size=self.block_size,
            default_lease_ttl_s=self.default_lease_ttl_s,
            max_lease_ttl_s=self.settings.max_lease_ttl_s,
            max_retained_tokens=self.settings.max_retained_tokens,
            read_margin_s=_KV_BLOCKS_EXPIRY_SAFETY_MARGIN,
            totals=self.leases.totals(),
            counters=self.leases.counters(),
            unix_time=time.time(),
            perf_counter=time.perf_counter(),
            idle=None if self._waker is None else IdleInfo(
                tick_s=self._waker.tick_s, engine_steps=self._waker.steps,
                wakeups=dict(self._waker.wakeups),
            ),
            step_running_s=self.step_running_s(),
        )

    def attach_prefix_cache(
        self, lookup: Callable[[list[int]], PrefixCacheAnswer | None]
    ) -> None:
        self._prefix_cache = lookup

    def prefix_cache(self, token_ids: list[int]) -> PrefixCacheAnswer | None:
        """What this engine's prefix cache holds of ``token_ids`` (None: cannot tell)."""
        lookup = self._prefix_cache
        return None if lookup is None else lookup(token_ids)

    # --- steps (kvtether.connector.scheduler.IdleSleepScheduler reports them) --------------
    def step_began(self) -> None:
        if self._step_began is None:  # with a batch queue, the oldest step in flight
            self._step_began = time.perf_counter()

    def step_ended(self) -> None:
        self._step_began = None

    def step_running_s(self) -> float | None:
        """How long the step in flight has waited for the worker; None between steps."""
        began = self._step_began  # read once: the engine thread may clear it meanwhile
        return None if began is None else round(time.perf_counter() - began, 3)

    # --- sleeping engine (kvtether.connector.scheduler.IdleSleepScheduler) -----------------
    def attach_waker(self, waker: EngineWaker) -> None:
        """Renewals and releases from the control channel wake the sleeping engine (its
        worker learns the new deadline at the next step)."""
        self._waker = waker
        self.leases.on_queued = lambda: waker.request_step("control")

    def next_deadline(self) -> float | None:
        """Earliest deadline of blocks held for a remote reader (a lease's own, which the
        engine loop ends; the worker's otherwise); ``None`` if none is held."""
        now = time.perf_counter()
        stale = [r for r, d in self._held_deadlines.items() if now - d > _PAST_DUE_STEP_S]
        for request_id in stale:
            # Not freed on the steps after its deadline: leave it to the housekeeping tick.
            logger.debug("request %s: held past its deadline; not waking for it again",
                         request_id)
            del self._held_deadlines[request_id]
        deadlines = [*self._held_deadlines.values(), self.leases.next_deadline()]
        return min((d for d in deadlines if d is not None), default=None)

    def needs_step(self) -> bool:
        """Work only an engine step can do: deadlines the worker has yet to learn, leases
        ended or due to end, deadlines that just passed."""
        if self.leases.has_pending_work():
            return True
        now = time.perf_counter()
        return any(0 <= now - d <= _PAST_DUE_STEP_S for d in self._held_deadlines.values())

    # --- prefill side: prefix check before upstream reads a decode handle -------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if request.kv_transfer_params:
            self._timings.setdefault(request.request_id, [time.time(), None, None])
        params = request.kv_transfer_params
        if params and params.get(KV_PARAM_LOCAL_PREFILL):
            # vLLM passes the prompt tokens its prefix cache holds: for a local-prefill turn,
            # the conversation's retained KV (its blocks are held, so they are hits).
            self._local_hits.setdefault(request.request_id, num_computed_tokens)
            return 0, False
        if not _is_decode_handle(params):
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        assert params is not None
        if params.get("_remote_blocks_processed"):
            # One read per request. Upstream would offer the handle again after a failed read
            # (recompute policy) or a preemption, but never start that read: the request
            # would wait for KV forever, or read blocks decode has freed since.
            return 0, False
        record = self._pulls.get(request.request_id)
        if record is None:
            decision = decide_prefix(
                params, request.prompt_token_ids or [],
                require_hashes=self.settings.require_block_hashes,
            )
            record = PullRecord(decision, apply_prefix_decision(params, decision))
            self._pulls[request.request_id] = record
            if decision.prefix_break:
                logger.info(
                    "request %s: prompt repeats %d of %d decode-held tokens; reusing only those",
                    request.request_id, decision.match_tokens, decision.remote_tokens,
                )
        remote = min(int(params.get("remote_num_tokens") or 0), request.num_prompt_tokens)
        record.offered_tokens = remote - num_computed_tokens
        if not record.allowed:
            return 0, False  # update_state_after_alloc still tells decode to free its blocks
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if params and params.get(KV_PARAM_LOCAL_PREFILL):
            # Retained when it finishes, like a P/D decode request: the worker tracks it for a
            # remote reader (upstream does this only for requests that took the P/D path).
            self._reqs_in_batch.add(request.request_id)
            params["_remote_blocks_processed"] = True
            return
        record = self._pulls.get(request.request_id)
        if record is not None and params is not None and not params.get("_remote_blocks_processed"):
            record.allocated(num_external_tokens)
        if num_external_tokens > 0 and (timing := self._timings.get(request.request_id)):
            timing[1] = time.time()
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    # --- decode side: leases and handle publication ----------------------------------------
    def request_finished(
        self, request: Request, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        record = self._pulls.pop(request.request_id, None)
        timings = self._engine_timings(request)
        local_hit = self._local_hits.pop(request.request_id, None)
        if not params:
            return super().request_finished(request, block_ids)
        key = params.get(KV_PARAM_HANDLE_KEY)
        if not params.get("do_remote_decode") and not params.get("_remote_blocks_processed"):
            # Upstream would retain this decode request's blocks, but its worker never tracked
            # it (it never took the remote-prefill path), so they would never be freed.
            delay, out = super().request_finished(request, block_ids)
            if delay:
                self._reqs_need_send.pop(request.request_id, None)
                logger.warning("request %s: not retaining KV of a request that skipped the "
                               "P/D path (kv_transfer_params=%s)", request.request_id, params)
            if key:
                self.leases.not_retained(str(key), request.request_id)
            return False, (None if delay else out)
        delay, out = super().request_finished(request, block_ids)
        if out is not None and timings is not None:
            out[KV_PARAM_TIMINGS] = timings
        if params.get("do_remote_decode"):  # prefill role: report what was read from decode
            if out is not None and record is not None:
                out.update(record.as_params())
                self._count_pull(record)
            if out is not None and params.get(KV_PARAM_REPORT_TOKEN_IDS):
                out[KV_PARAM_PROMPT_TOKEN_IDS] = list(request.prompt_token_ids or [])
            if delay and out is not None and out.get("remote_blocks_expiry_time") is None:
                # Upstream exports a deadline only with decode-held KV. With prefill's too,
                # decode declines a read that comes after prefill may have freed the blocks
                # (a decode engine stalled past kv_lease_duration sends no heartbeats), and
                # recomputes, instead of reading whatever fills them by then.
                out["remote_blocks_expiry_time"] = self._reqs_need_send.get(request.request_id)
            return delay, out
        if not delay or out is None:
            if key:
                self.leases.not_retained(str(key), request.request_id)
            return delay, out
        if local_hit is not None:
            out[KV_PARAM_CACHED_TOKENS] = local_hit
        return delay, self._open_lease(request, out, str(key or request.request_id), params)

    def _engine_timings(self, request: Request) -> dict[str, float | None] | None:
        """The leg's :class:`~kvtether.protocol.EngineTimings`, as a JSON-ready dict."""
        timing = self._timings.pop(request.request_id, None)
        if timing is None:
            return None
        taken_up, read_start, read_done = timing
        now, arrival = time.time(), float(request.arrival_time)
        return {
            "queue_s": round(max(0.0, taken_up - arrival), 4) if taken_up else None,
            "read_s": (round(read_done - read_start, 4)
                       if read_start is not None and read_done is not None else None),
            "engine_s": round(max(0.0, now - arrival), 4),
        }

    def _open_lease(
        self, request: Request, handle: dict[str, Any], key: str, params: dict[str, Any]
    ) -> dict[str, Any]:
        tokens = int(handle.get("remote_num_tokens") or 0)
        annotate_handle(handle, request.all_token_ids[:tokens], self.block_size)
        handle[KV_PARAM_LEASE_KEY] = key
        if params.get(KV_PARAM_REPORT_TOKEN_IDS):
            # The router cannot see these in a Responses or Messages answer; it takes them out
            # of the handle before anyone reads it.
            handle[KV_PARAM_PROMPT_TOKEN_IDS] = list(request.prompt_token_ids or [])
            handle[KV_PARAM_OUTPUT_TOKEN_IDS] = list(request.output_token_ids)
        opened = self.leases.open(
            key, request.request_id, handle,
            retained_blocks=sum(len(group) for group in handle["remote_block_ids"]),
            retained_tokens=tokens,
            ttl_s=self._initial_ttl_s(params),
        )
        self._reqs_need_send.update(opened.updates)
        # The lease's own deadline (the worker's is later, see _leases): prefill trusts it.
        handle["remote_blocks_expiry_time"] = opened.deadline
        return handle

    def _initial_ttl_s(self, params: dict[str, Any]) -> float:
        raw = params.get(KV_PARAM_LEASE_TTL_S)
        if raw is None:
            return self.default_lease_ttl_s
        try:
            ttl = float(raw)
        except (TypeError, ValueError):
            ttl = math.nan
        if not math.isfinite(ttl) or ttl <= 0:
            logger.warning("ignoring %s=%r (want seconds > 0); using %.1fs",
                           KV_PARAM_LEASE_TTL_S, raw, self.default_lease_ttl_s)
            return self.default_lease_ttl_s
        return ttl

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        # Renewed deadlines and ended leases ride upstream's reqs_to_send to the worker.
        self._reqs_need_send.update(self.leases.drain())
        self._held_deadlines.update(self._reqs_need_send)
        return super().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        for request_id in connector_output.finished_recving or ():
            if (timing := self._timings.get(request_id)) is not None:
                timing[2] = time.time()
        if connector_output.finished_sending:
            for request_id in connector_output.finished_sending:
                self._held_deadlines.pop(request_id, None)
            self.leases.on_freed(connector_output.finished_sending)
        for request_id in connector_output.failed_recving or ():
            if (record := self._pulls.get(request_id)) is not None:
                record.failed()

    def _count_pull(self, record: PullRecord) -> None:
        params = record.as_params()
        self.leases.count(f"pulls_{params[KV_PARAM_PULL]}")
        self.leases.count("pulled_tokens", record.reused_tokens)
        if record.decision.prefix_break:
            self.leases.count("prefix_breaks")

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


class KVTetherWorker(NixlPullConnectorWorker):
    """Upstream's pull worker, built with the idle settings of :mod:`._quiet` when asked and
    left on the cores vLLM bound it to (:mod:`._cores`), that also declines decode's late read
    of prefill's KV (see :meth:`_is_turn2_read_expired`) and
    reports a step that does not end (:mod:`._stall`)."""

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
        # Prefill-side request id -> the heartbeats this worker sent prefill for it (only
        # decode sends them, for a new turn's KV waiting on prefill; upstream sends none for
        # bidirectional reads): (first sent, last sent, none more than an extension apart).
        self._heartbeats: TTLCache[str, tuple[float, float, bool]] = TTLCache(
            maxsize=65536, ttl=max(1.0, float(self._lease_extension))
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

    def _send_heartbeats(self, metadata: Any) -> None:
        super()._send_heartbeats(metadata)
        now = time.perf_counter()
        gap_s = self._lease_extension - _KV_BLOCKS_EXPIRY_SAFETY_MARGIN
        for engine_id, hb in metadata.heartbeat_by_engine.items():
            if engine_id not in self._remote_agents:  # not sent: waiting for a handshake
                continue
            for rid in hb.req_ids:
                prev = self._heartbeats.get(rid)
                self._heartbeats[rid] = ((now, now, True) if prev is None
                                         else (prev[0], now, prev[2] and now - prev[1] < gap_s))

    def _is_turn2_read_expired(self, meta: Any) -> bool:
        """Upstream's check, which prefill's exported deadline now also reaches for decode's
        read of a new turn, credited with the heartbeats this worker sent.

        A heartbeat extends prefill's hold to its arrival + ``kv_lease_duration * 2/3`` only
        if prefill still held the blocks then: credited when the first was sent before the
        exported deadline and none came later than an extension after the one before.
        """
        beats = self._heartbeats.pop(meta.remote.request_id, None)
        if not super()._is_turn2_read_expired(meta):
            return False
        if beats is None:
            return True
        first, last, unbroken = beats
        margin = _KV_BLOCKS_EXPIRY_SAFETY_MARGIN
        deadline = meta.remote.blocks_expiry_time - self._engine_clock_offset[meta.remote.engine_id]
        if not unbroken or first + margin >= deadline:
            return True
        return time.perf_counter() + margin >= last + self._lease_extension


def _is_decode_handle(params: dict[str, Any] | None) -> bool:
    """A prefill request carrying decode-held KV to read (bidirectional turn N+1)."""
    return bool(params and params.get("do_remote_decode") and params.get("remote_block_ids"))
