"""The two sides of a P/D turn on the connector's scheduler side: prefill and decode.

Every instance runs vLLM's ``kv_both`` role, so one engine may serve both sides (the stack
gives each instance one, a single engine serving both is allowed); which side a request is on
is upstream's own marker, ``do_remote_decode`` in its ``kv_transfer_params`` (this engine
prefills for a remote decode), decided once per hook by the scheduler
(:class:`kvtether.connector.nixl.KVTetherScheduler`), which then hands the request to one of:

* :class:`PrefillSide` — before upstream reads a decode handle (bidirectional turn N+1), check
  that the prompt repeats decode's blocks and cut the handle to the prefix it repeats; when the
  turn finishes, report what was read and export this engine's own deadline for the new turn's
  KV (upstream sets ``remote_blocks_expiry_time`` only on decode's handles), so decode declines
  a read that comes after prefill may have freed the blocks and recomputes instead.
* :class:`DecodeSide` — when a turn finishes, retain its KV under a lease (deadline from
  ``kvtether_lease_ttl_s``), add the prefix identity to the handle and publish it; a
  local-prefill turn (decode computes the new tokens on the KV it retains) is held like a P/D
  decode request.

Plain Python: vLLM's requests and the upstream scheduler's send-side state come in as
arguments (:class:`~kvtether.connector._compat.upstream.PullScheduler`).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Protocol

from kvtether.connector._compat import mark_remote_read_done, remote_read_done
from kvtether.connector._leases import LeaseTable
from kvtether.connector._prefix import (
    PullRecord,
    annotate_handle,
    apply_prefix_decision,
    decide_prefix,
)
from kvtether.protocol._kv_params import (
    KV_PARAM_CACHED_TOKENS,
    KV_PARAM_HANDLE_KEY,
    KV_PARAM_LEASE_KEY,
    KV_PARAM_LEASE_TTL_S,
    KV_PARAM_OUTPUT_TOKEN_IDS,
    KV_PARAM_PROMPT_TOKEN_IDS,
    KV_PARAM_PULL,
    KV_PARAM_REPORT_TOKEN_IDS,
    KV_PARAM_TIMINGS,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from vllm.v1.request import Request

__all__ = ["DecodeSide", "Finished", "PrefillSide", "SendState", "is_prefill_request"]

logger = logging.getLogger(__name__)

# What request_finished returns to vLLM: delay freeing the blocks, the response's params.
Finished = tuple[bool, dict[str, Any] | None]


class SendState(Protocol):
    """The upstream scheduler's send-side state that the sides change."""

    def send_deadline(self, request_id: str) -> float | None: ...
    def set_send_deadlines(self, deadlines: Mapping[str, float]) -> None: ...
    def drop_send_deadline(self, request_id: str) -> None: ...
    def track_for_reader(self, request_id: str) -> None: ...


def is_prefill_request(params: Mapping[str, Any]) -> bool:
    """This engine prefills the request for a remote decode (upstream's own marker)."""
    return bool(params.get("do_remote_decode"))


def _is_decode_handle(params: Mapping[str, Any] | None) -> bool:
    """A prefill request carrying decode-held KV to read (bidirectional turn N+1)."""
    return bool(params and is_prefill_request(params) and params.get("remote_block_ids"))


class PrefillSide:
    """Prefill for a remote decode: the prefix check on decode handles, the read's report."""

    def __init__(self, leases: LeaseTable, *, require_block_hashes: bool) -> None:
        self.leases = leases
        self.require_block_hashes = require_block_hashes
        self._pulls: dict[str, PullRecord] = {}

    def may_read(self, request: Request, num_computed_tokens: int) -> bool:
        """Whether upstream may offer the request's remote KV (False: it loads none)."""
        params = request.kv_transfer_params
        if not _is_decode_handle(params):
            return True
        assert params is not None
        if remote_read_done(params):
            # One read per request. Upstream would offer the handle again after a failed read
            # (recompute policy) or a preemption, but never start that read: the request
            # would wait for KV forever, or read blocks decode has freed since.
            return False
        record = self._pulls.get(request.request_id) or self._check(request, params)
        remote = min(int(params.get("remote_num_tokens") or 0), request.num_prompt_tokens)
        record.offered_tokens = remote - num_computed_tokens
        # Not allowed: update_state_after_alloc still tells decode to free its blocks.
        return record.allowed

    def _check(self, request: Request, params: dict[str, Any]) -> PullRecord:
        decision = decide_prefix(params, request.prompt_token_ids or [],
                                 require_hashes=self.require_block_hashes)
        record = PullRecord(decision, apply_prefix_decision(params, decision))
        self._pulls[request.request_id] = record
        if decision.prefix_break:
            logger.info("request %s: prompt repeats %d of %d decode-held tokens; reusing only "
                        "those", request.request_id, decision.match_tokens,
                        decision.remote_tokens)
        return record

    def allocated(self, request: Request, num_external_tokens: int) -> None:
        record = self._pulls.get(request.request_id)
        params = request.kv_transfer_params
        if record is not None and params is not None and not remote_read_done(params):
            record.allocated(num_external_tokens)

    def read_failed(self, request_id: str) -> None:
        if (record := self._pulls.get(request_id)) is not None:
            record.failed()

    def forget(self, request_id: str) -> None:
        self._pulls.pop(request_id, None)

    def finished(self, request: Request, delay: bool, out: dict[str, Any] | None,
                 timings: dict[str, float | None] | None, send_deadline: float | None
                 ) -> Finished:
        """Report what was read from decode and this engine's deadline for the turn's KV."""
        record = self._pulls.pop(request.request_id, None)
        if out is None:
            return delay, out
        if timings is not None:
            out[KV_PARAM_TIMINGS] = timings
        if record is not None:
            out.update(record.as_params())
            self._count(record)
        if (request.kv_transfer_params or {}).get(KV_PARAM_REPORT_TOKEN_IDS):
            out[KV_PARAM_PROMPT_TOKEN_IDS] = list(request.prompt_token_ids or [])
        if delay and out.get("remote_blocks_expiry_time") is None:
            # A decode engine stalled past kv_lease_duration sends no heartbeats: with this
            # deadline it declines the late read and recomputes, instead of reading whatever
            # fills prefill's freed blocks by then.
            out["remote_blocks_expiry_time"] = send_deadline
        return delay, out

    def _count(self, record: PullRecord) -> None:
        self.leases.count(f"pulls_{record.as_params()[KV_PARAM_PULL]}")
        self.leases.count("pulled_tokens", record.reused_tokens)
        if record.decision.prefix_break:
            self.leases.count("prefix_breaks")


class DecodeSide:
    """Decode (and local prefill): leases on retained KV and handle publication."""

    def __init__(self, sends: SendState, leases: LeaseTable, *, block_size: int,
                 default_lease_ttl_s: float) -> None:
        self.sends, self.leases = sends, leases
        self.block_size = block_size
        self.default_lease_ttl_s = default_lease_ttl_s
        # Local-prefill turns: request id -> prompt tokens found in this engine's prefix cache.
        self._local_hits: dict[str, int] = {}

    def local_prefill_hit(self, request: Request, num_computed_tokens: int) -> None:
        """vLLM passes the prompt tokens its prefix cache holds: for a local-prefill turn, the
        conversation's retained KV (its blocks are held, so they are hits)."""
        self._local_hits.setdefault(request.request_id, num_computed_tokens)

    def hold_local_prefill(self, request: Request) -> None:
        """Retain a local-prefill turn when it finishes, like a P/D decode request: the worker
        tracks it for a remote reader (upstream does this only for requests that took the P/D
        path)."""
        self.sends.track_for_reader(request.request_id)
        assert request.kv_transfer_params is not None
        mark_remote_read_done(request.kv_transfer_params)

    def forget(self, request_id: str) -> None:
        self._local_hits.pop(request_id, None)

    def finished(self, request: Request, delay: bool, out: dict[str, Any] | None,
                 timings: dict[str, float | None] | None) -> Finished:
        """Open a lease on the turn's retained KV and publish its handle."""
        params = request.kv_transfer_params or {}
        key = params.get(KV_PARAM_HANDLE_KEY)
        local_hit = self._local_hits.pop(request.request_id, None)
        if not remote_read_done(params):
            return self._skipped_pd_path(request, delay, out, key)
        if out is not None and timings is not None:
            out[KV_PARAM_TIMINGS] = timings
        if not delay or out is None:
            if key:
                self.leases.not_retained(str(key), request.request_id)
            return delay, out
        if local_hit is not None:
            out[KV_PARAM_CACHED_TOKENS] = local_hit
        return delay, self._open_lease(request, out, str(key or request.request_id), params)

    def _skipped_pd_path(self, request: Request, delay: bool, out: dict[str, Any] | None,
                         key: Any) -> Finished:
        """Upstream would retain this decode request's blocks, but its worker never tracked it
        (it never took the remote-prefill path), so they would never be freed."""
        if delay:
            self.sends.drop_send_deadline(request.request_id)
            logger.warning("request %s: not retaining KV of a request that skipped the P/D "
                           "path (kv_transfer_params=%s)", request.request_id,
                           request.kv_transfer_params)
        if key:
            self.leases.not_retained(str(key), request.request_id)
        return False, (None if delay else out)

    def _open_lease(self, request: Request, handle: dict[str, Any], key: str,
                    params: Mapping[str, Any]) -> dict[str, Any]:
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
            ttl_s=self.initial_ttl_s(params),
        )
        self.sends.set_send_deadlines(opened.updates)
        # The lease's own deadline (the worker's is later, see _leases): prefill trusts it.
        handle["remote_blocks_expiry_time"] = opened.deadline
        return handle

    def initial_ttl_s(self, params: Mapping[str, Any]) -> float:
        """The lease the request asked for (``kvtether_lease_ttl_s``), else the default."""
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
