"""The kvtether connector's control channel (served from each vLLM instance) and the keys
kvtether adds to vLLM's ``kv_transfer_params``."""

from __future__ import annotations

import enum
from typing import Any

from pydantic import BaseModel, Field

from kvtether.protocol._models import _Strict
from kvtether.protocol._wire import PROTOCOL_VERSION


# --- connector control channel --------------------------------------------------------------
# The kvtether vLLM connector (``kvtether.connector.nixl``) serves this HTTP API from each
# vLLM instance's engine-core process, on ``kv_connector_extra_config.kvtether_control_port``:
#
#   GET    /kvtether/v1/status                  ConnectorStatus
#   GET    /kvtether/v1/leases                  LeaseList
#   GET    /kvtether/v1/leases/{key}            LeaseInfo
#   POST   /kvtether/v1/leases/{key}/renew      LeaseRenewRequest -> LeaseInfo
#   DELETE /kvtether/v1/leases/{key}?wait_s=0   LeaseInfo: 200 (state "released") once
#                                               freed, 202 while being freed (after at most
#                                               wait_s; default 10 s). Started at once, as
#                                               a renewal is; the worker learns both at the
#                                               next engine step
#   GET    /kvtether/v1/handles/{key}?wait_s=5  HandleResponse (long-poll until published)
#   POST   /kvtether/v1/prefix-cache            PrefixCacheQuery -> PrefixCacheAnswer: how many
#                                               leading tokens the engine's prefix cache holds
#                                               (501 "not_supported" without kvtether's
#                                               scheduler class, or on a hybrid model)
#   GET    /kvtether/v1/metrics                 Prometheus text
#
# Errors use ``ErrorBody``; for a lease or handle that ended, 410 with ``error.code`` = the
# ``LeaseState`` and a ``lease`` field holding the final ``LeaseInfo``. With a shared secret in
# the connector's environment (``CONTROL_SECRET_ENV``) every request carries
# ``Authorization: Bearer <secret>`` (else 401, ``error.code`` "invalid_control_secret").
# Past its connection cap the channel answers 503, ``error.code`` "too_many_connections".
CONTROL_API_PREFIX = "/kvtether/v1"
CONTROL_SECRET_ENV = "KVTETHER_CONTROL_SECRET"

# vLLM's prefill side declines to read a handle whose expiry is this close (seconds). This is
# vLLM 0.32's ``_KV_BLOCKS_EXPIRY_SAFETY_MARGIN``, written here because the router and tests
# must not import vLLM; the connector reports the running vLLM's own value in
# ``ConnectorStatus.read_margin_s``, which is the one to trust when they differ. The router's
# ``lease_safety_margin_s`` (default 6 s) must stay above it, or it forwards handles that P
# then declines (a miss, never wrong KV).
PREFILL_READ_MARGIN_S = 5.0

# Eviction order, decode side and router side (why they differ, in one place):
# * The connector on D (``kvtether_max_retained_tokens``) evicts the lease with the earliest
#   deadline first. It sees no client hints, and the lease closest to lapsing is the one whose
#   loss costs least: it would be freed soonest anyway.
# * The router (``max_retained_tokens``) evicts the lease of least expected value first
#   (``kvtether.router.budget.lease_value``: expected reuse share x freshness x phase). It sees
#   the hints (phase, next prompt size, idle time) the connector does not.
# The router learns of a connector eviction when a renewal answers "gone" or P's read fails
# (a miss either way, never wrong KV), so the two orders may disagree without harm.


class LeaseState(str, enum.Enum):
    """Where a lease on decode-held KV stands."""

    ACTIVE = "active"  # blocks retained, deadline in the future
    RELEASING = "releasing"  # release or eviction asked; blocks freed within one engine step
    CONSUMED = "consumed"  # a prefill read the handle (or skipped it): decode freed the blocks
    RELEASED = "released"  # freed by DELETE
    EXPIRED = "expired"  # freed because the deadline passed
    EVICTED = "evicted"  # freed to stay under kvtether_max_retained_tokens
    NOT_RETAINED = "not_retained"  # the turn ended without retaining KV (aborted, error, ...)


class PullOutcome(str, enum.Enum):
    """What a prefill instance did with a decode handle it was given."""

    PULLED = "pulled"  # read kvtether_reused_tokens tokens from decode
    LOCAL_HIT = "local_hit"  # its own prefix cache already held what decode offered
    BELOW_THRESHOLD = "below_threshold"  # fewer new tokens than kv_recompute_threshold
    NO_MATCH = "no_match"  # the prompt's first block differs from decode's sequence
    FAILED = "failed"  # the read was declined (lease near expiry) or failed; recomputed


class LeaseRenewRequest(_Strict):
    """Body of ``POST /kvtether/v1/leases/{key}/renew``: new deadline = now + ``ttl_s``."""

    ttl_s: float = Field(gt=0, allow_inf_nan=False, description="Seconds from now.")


class PrefixCacheQuery(_Strict):
    """Body of ``POST /kvtether/v1/prefix-cache``: a token sequence to look up."""

    token_ids: list[int] = Field(max_length=1 << 20, description="The sequence, from its start.")


class PrefixCacheAnswer(BaseModel):
    """How many leading tokens of a :class:`PrefixCacheQuery` the engine's prefix cache holds
    now (whole blocks; a snapshot: the blocks stay evictable until a request takes them)."""

    cached_tokens: int
    block_size: int


class LeaseInfo(BaseModel):
    """One lease on decode-held KV. Times: unix seconds, and decode's perf_counter clock."""

    key: str
    request_id: str
    state: LeaseState
    retained_blocks: int
    retained_tokens: int
    deadline_unix_s: float
    remaining_s: float
    # Decode's time.perf_counter() domain: what vLLM's prefill compares (after its handshake
    # clock offset). Forward a handle with this value, never an older one.
    remote_blocks_expiry_time: float
    renewals: int = 0
    created_unix_s: float
    ended_unix_s: float | None = None


class LeaseTotals(BaseModel):
    active_leases: int
    retained_blocks: int
    retained_tokens: int


class LeaseList(BaseModel):
    """Body of ``GET /kvtether/v1/leases``."""

    leases: list[LeaseInfo]
    recently_ended: list[LeaseInfo]
    totals: LeaseTotals
    unix_time: float
    perf_counter: float


class HandleResponse(BaseModel):
    """Body of ``GET /kvtether/v1/handles/{key}``.

    ``kv_transfer_params`` is the dict to pass to the next turn's prefill as its
    ``kv_transfer_params``, with ``remote_blocks_expiry_time`` set to the current deadline.
    """

    key: str
    lease: LeaseInfo
    kv_transfer_params: dict[str, Any]


class IdleInfo(BaseModel):
    """How a sleeping engine was woken (``IdleSleepScheduler`` only)."""

    tick_s: float
    engine_steps: int
    wakeups: dict[str, int]


class ConnectorStatus(BaseModel):
    """Body of ``GET /kvtether/v1/status``."""

    protocol_version: str = PROTOCOL_VERSION
    engine_id: str
    role: str | None = None
    vllm_version: str
    block_size: int
    default_lease_ttl_s: float
    max_lease_ttl_s: float
    max_retained_tokens: int | None = None
    read_margin_s: float = PREFILL_READ_MARGIN_S
    totals: LeaseTotals
    counters: dict[str, int]
    # Read together: deadline_perf - perf_counter = seconds left, in decode's clock.
    unix_time: float
    perf_counter: float
    # Present when the engine runs kvtether's IdleSleepScheduler.
    idle: IdleInfo | None = None
    # How long the engine's step in flight has waited for its worker (IdleSleepScheduler
    # only): None between steps. A frozen worker shows as a number that keeps growing; the
    # router stops sending to an instance past its stall_after_s.
    step_running_s: float | None = None
