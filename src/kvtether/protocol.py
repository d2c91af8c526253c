"""The kvtether wire contract: headers, hints, reuse outcomes, session API and control messages.

This is the one module that the client session layer, the router and the vLLM connector all
import. Everything here is public and versioned by ``PROTOCOL_VERSION``; change it only in
backward-compatible ways (new optional fields, new miss causes) unless the version changes.

Why one module of ~500 lines: it is the contract, read top to bottom by whoever implements a
client, router or connector of another version; splitting it would make them chase names
across files. It holds only constants, pydantic models and small pure helpers.
"""

from __future__ import annotations

import copy
import enum
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "PROTOCOL_VERSION",
    "HEADER_CONVERSATION_ID",
    "CONVERSATION_ID_HEADER_ALIASES",
    "BODY_CONVERSATION_ID",
    "HEADER_HINTS",
    "BODY_HINTS",
    "HEADER_REUSE",
    "HEADER_REUSED_TOKENS",
    "HEADER_PROMPT_TOKENS",
    "HEADER_TURN",
    "HEADER_DECODE_INSTANCE",
    "HEADER_SALVAGED_TOKENS",
    "HEADER_ROUTER",
    "HEADER_REUSABLE_TOKENS",
    "HEADER_TIMINGS",
    "MAX_CONVERSATION_ID_LEN",
    "CONVERSATION_ID_CHARACTERS",
    "conversation_id_problem",
    "KVTETHER_BODY_FIELDS",
    "Phase",
    "MissCause",
    "NOT_ELIGIBLE_CAUSES",
    "ReuseOutcome",
    "reuse_verdict",
    "TurnHints",
    "HeartbeatRequest",
    "HeartbeatResponse",
    "TurnRecord",
    "TurnTimings",
    "EngineTimings",
    "parse_timings_header",
    "SessionStatus",
    "ErrorBody",
    "error_body",
    "parse_reuse_header",
    "format_reuse_header",
    "parse_hints_header",
    "block_hashes",
    "matching_prefix_tokens",
    "common_prefix_tokens",
    "tail_block_hash",
    "CONTROL_API_PREFIX",
    "CONTROL_SECRET_ENV",
    "KV_PARAM_HANDLE_KEY",
    "KV_PARAM_LEASE_TTL_S",
    "KV_PARAM_LEASE_KEY",
    "KV_PARAM_BLOCK_SIZE",
    "KV_PARAM_BLOCK_HASHES",
    "KV_PARAM_TAIL_HASH",
    "KV_PARAM_REMOTE_TOKENS",
    "KV_PARAM_PREFIX_MATCH_TOKENS",
    "KV_PARAM_PREFIX_BREAK",
    "KV_PARAM_REUSED_TOKENS",
    "KV_PARAM_PULL",
    "KV_PARAM_TIMINGS",
    "PREFILL_READ_MARGIN_S",
    "FieldError",
    "first_field_error",
    "truncate_handle",
    "LeaseState",
    "PullOutcome",
    "LeaseRenewRequest",
    "LeaseInfo",
    "LeaseTotals",
    "LeaseList",
    "HandleResponse",
    "ConnectorStatus",
    "IdleInfo",
]

PROTOCOL_VERSION = "1"

# --- request side -------------------------------------------------------------------------
HEADER_CONVERSATION_ID = "X-Conversation-Id"
# Accepted as aliases, in this order of precedence after X-Conversation-Id.
CONVERSATION_ID_HEADER_ALIASES = ("X-Session-Id",)
# What vLLM's own multi-turn benchmark sends in the JSON body.
BODY_CONVERSATION_ID = "conversation_id"

# Hints travel either as a JSON object in this header or as this body field.
HEADER_HINTS = "X-KVTether-Hints"
BODY_HINTS = "kvtether_hints"

# Body fields that belong to kvtether and are stripped before a request reaches vLLM.
KVTETHER_BODY_FIELDS = (BODY_CONVERSATION_ID, BODY_HINTS)

# --- response side ------------------------------------------------------------------------
HEADER_REUSE = "X-KVTether-Reuse"  # "fired" or "miss:<cause>"
HEADER_REUSED_TOKENS = "X-KVTether-Reused-Tokens"  # prompt tokens served from cached KV
# Prompt tokens that repeat the sequence the conversation's previous finished turn built
# (its prompt + output): the most this turn could have reused.
HEADER_REUSABLE_TOKENS = "X-KVTether-Reusable-Tokens"
# Where the turn's time went before decode began (TurnTimings.header_value()): the stages known
# when the answer starts, "stage=seconds;...".
HEADER_TIMINGS = "X-KVTether-Timings"
HEADER_PROMPT_TOKENS = "X-KVTether-Prompt-Tokens"
HEADER_TURN = "X-KVTether-Turn"  # 1-based turn index within the conversation
HEADER_DECODE_INSTANCE = "X-KVTether-Decode-Instance"
# Whenever the prompt diverged from decode's retained sequence: the whole-block prefix of
# decode's KV that still matched and was offered to prefill.
HEADER_SALVAGED_TOKENS = "X-KVTether-Salvaged-Tokens"
# Set by the round-robin front of several router replicas: which replica answered.
HEADER_ROUTER = "X-KVTether-Router"

MAX_CONVERSATION_ID_LEN = 256
# Visible ASCII only: an id travels in an HTTP header and in the session API's URL paths.
CONVERSATION_ID_CHARACTERS = "A-Za-z0-9._:@~+=-"
_CONVERSATION_ID = re.compile(f"[{CONVERSATION_ID_CHARACTERS}]+")


def conversation_id_problem(value: object) -> str | None:
    """What is wrong with ``value`` as a conversation id, or None when it is a valid one: 1 to
    :data:`MAX_CONVERSATION_ID_LEN` characters from :data:`CONVERSATION_ID_CHARACTERS`. The
    one rule, applied by the client before sending and by the router on every request."""
    if not isinstance(value, str) or not value:
        return "must be a non-empty string"
    if len(value) > MAX_CONVERSATION_ID_LEN:
        return f"is longer than {MAX_CONVERSATION_ID_LEN} characters"
    if not _CONVERSATION_ID.fullmatch(value):
        return f"may only use the characters [{CONVERSATION_ID_CHARACTERS}]"
    return None


class Phase(str, enum.Enum):
    """What the agent is doing between model calls."""

    THINKING = "thinking"
    TOOL_RUNNING = "tool_running"
    IDLE = "idle"
    FINAL = "final"


class MissCause(str, enum.Enum):
    """Why a turn did not reuse what it could have.

    A turn is *eligible* when at least ``kv_recompute_threshold_tokens`` (and at least one) of
    its prompt tokens repeat the sequence its conversation's previous finished turn built
    (``reusable_tokens``). An eligible turn *fires* when the tokens it recomputed of those,
    ``reusable_tokens - reused_tokens``, are fewer than ``max(kv_recompute_threshold_tokens,
    kv_block_size_tokens)`` (recomputing less than that is by design); otherwise it misses,
    and the cause says how the KV was lost. The first four causes, and ``store_unavailable``
    (the router could not know the conversation), are the turns that are not eligible
    (:data:`NOT_ELIGIBLE_CAUSES`).
    """

    FIRST_TURN = "first_turn"  # no earlier turn of the conversation finished
    NO_CONVERSATION_ID = "no_conversation_id"
    BELOW_THRESHOLD = "below_threshold"  # the previous turn's sequence is too short to reuse
    PREFIX_BREAK = "prefix_break"  # the prompt diverged before anything reusable
    LEASE_EXPIRED = "lease_expired"
    RELEASED = "released"
    EVICTED = "evicted"
    DECODE_UNAVAILABLE = "decode_unavailable"
    TRANSFER_FAILED = "transfer_failed"  # a handle went to prefill, and too little was read
    NOT_RETAINED = "not_retained"  # previous turn left no handle (e.g. aborted, or error)
    # The router's shared conversation store did not answer: the turn ran as plain P/D.
    STORE_UNAVAILABLE = "store_unavailable"


# Misses of turns that had nothing (or too little) to reuse: they are not eligible.
NOT_ELIGIBLE_CAUSES = frozenset({
    MissCause.FIRST_TURN, MissCause.NO_CONVERSATION_ID, MissCause.BELOW_THRESHOLD,
    MissCause.PREFIX_BREAK, MissCause.STORE_UNAVAILABLE,
})


def reuse_verdict(
    reusable_tokens: int, reused_tokens: int, *, block_size: int, recompute_threshold_tokens: int
) -> tuple[bool, bool]:
    """``(eligible, fired)`` of a turn, by the rule in :class:`MissCause`: the one definition,
    applied by the router to every turn and by ``kvtether bench`` to every strategy's."""
    eligible = reusable_tokens >= max(recompute_threshold_tokens, 1)
    lost = max(0, reusable_tokens - reused_tokens)
    return eligible, eligible and lost < max(recompute_threshold_tokens, block_size)


class ReuseOutcome(BaseModel):
    """The outcome of one turn: reuse fired, or a miss with its cause."""

    model_config = ConfigDict(frozen=True)

    fired: bool
    cause: MissCause | None = None
    reused_tokens: int = 0
    reusable_tokens: int = 0

    @classmethod
    def hit(cls, reused_tokens: int, reusable_tokens: int = 0) -> ReuseOutcome:
        return cls(fired=True, reused_tokens=reused_tokens, reusable_tokens=reusable_tokens)

    @classmethod
    def miss(
        cls, cause: MissCause, reused_tokens: int = 0, reusable_tokens: int = 0
    ) -> ReuseOutcome:
        return cls(fired=False, cause=cause, reused_tokens=reused_tokens,
                   reusable_tokens=reusable_tokens)

    @property
    def eligible(self) -> bool:
        """The turn had enough to reuse (see :class:`MissCause`): fired or lost KV."""
        return self.fired or self.cause not in NOT_ELIGIBLE_CAUSES

    @property
    def label(self) -> str:
        return format_reuse_header(self)


def format_reuse_header(outcome: ReuseOutcome) -> str:
    if outcome.fired:
        return "fired"
    assert outcome.cause is not None
    return f"miss:{outcome.cause.value}"


def parse_reuse_header(
    value: str | None, reused_tokens: str | None = None, reusable_tokens: str | None = None
) -> ReuseOutcome | None:
    """Parse ``X-KVTether-Reuse`` (and the reused / reusable tokens headers); ``None`` if
    absent or foreign."""
    if not value:
        return None
    tokens = int(reused_tokens) if reused_tokens and reused_tokens.isdigit() else 0
    reusable = int(reusable_tokens) if reusable_tokens and reusable_tokens.isdigit() else 0
    if value == "fired":
        return ReuseOutcome.hit(tokens, reusable)
    if value.startswith("miss:"):
        try:
            return ReuseOutcome.miss(MissCause(value[5:]), tokens, reusable)
        except ValueError:
            return None
    return None


NonNegInt = Annotated[int, Field(ge=0)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TurnHints(_Strict):
    """Optional client hints about what comes after this turn.

    The router uses them to size the initial lease and to decide whether retaining the KV is
    worth it at all (a ``final`` turn is not retained).
    """

    next_prompt_tokens: NonNegInt | None = Field(
        default=None, description="Expected prompt tokens of the next turn."
    )
    next_turn_gap_s: NonNegFloat | None = Field(
        default=None, description="Expected seconds until the next turn arrives."
    )
    phase: Phase | None = Field(default=None, description="What the agent does next.")


def parse_hints_header(value: str) -> TurnHints:
    """Parse the ``X-KVTether-Hints`` header; raises ``ValueError`` with a readable message."""
    try:
        data = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{HEADER_HINTS} must be a JSON object: {exc.msg}") from None
    try:
        return TurnHints.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"invalid {HEADER_HINTS}: {first_field_error(exc)}") from None


# --- validation errors ----------------------------------------------------------------------
@dataclass(frozen=True)
class FieldError:
    """The first problem pydantic found, in the pieces every user-facing message is made of.

    ``str()`` gives ``"<loc>: <msg>"``; callers prefix what was being validated
    (``"invalid heartbeat: ..."``) or, like the CLI, turn ``path`` into a flag name.
    """

    path: tuple[str, ...]  # pydantic's loc, as strings; empty for the whole value
    msg: str
    input: Any = None
    cause: BaseException | None = None  # an exception a validator raised, if any

    @property
    def loc(self) -> str:
        return ".".join(self.path) or "body"

    def __str__(self) -> str:
        return f"{self.loc}: {self.msg}"


def first_field_error(exc: ValidationError) -> FieldError:
    """The first error of ``exc``: one clear problem is more useful to a user than a list."""
    err = exc.errors()[0]
    cause = (err.get("ctx") or {}).get("error")
    return FieldError(
        path=tuple(str(x) for x in err["loc"]),
        msg=err["msg"],
        input=err.get("input"),
        cause=cause if isinstance(cause, BaseException) else None,
    )


# --- session API --------------------------------------------------------------------------
class HeartbeatRequest(_Strict):
    """Body of ``POST /v1/sessions/{id}/heartbeat``. All fields optional; ``{}`` renews."""

    phase: Phase = Phase.TOOL_RUNNING
    tool_name: str | None = Field(default=None, max_length=200)
    expected_duration_s: NonNegFloat | None = Field(
        default=None, description="How much longer the current tool is expected to run."
    )
    lease_extension_s: NonNegFloat | None = Field(
        default=None, description="Ask for this lease length; capped by the router's maximum."
    )
    next_prompt_tokens: NonNegInt | None = Field(
        default=None,
        description="Expected prompt tokens of the turn after the tool (as in TurnHints).",
    )


class HeartbeatResponse(BaseModel):
    conversation_id: str
    lease_deadline_unix_s: float
    lease_remaining_s: float
    retained_tokens: int


class EngineTimings(BaseModel):
    """One leg inside a vLLM engine, measured by the kvtether connector (seconds).

    ``queue_s``: from the request's arrival at vLLM until its scheduler first took it up;
    ``read_s``: reading KV from the other instance over NIXL (prefill: decode's retained KV;
    decode: this turn's KV from prefill), ``None`` when nothing was read; ``engine_s``: arrival
    until the request finished in the engine (decode: the whole answer).
    """

    queue_s: float | None = None
    read_s: float | None = None
    engine_s: float | None = None


class TurnTimings(BaseModel):
    """Where one turn's time went (seconds; ``None``: not on this turn's path).

    From the router's clock: ``router_wait_s`` (waiting for the conversation: another turn of
    it in flight, the store), ``plan_s`` (prefill's ``/tokenize`` for the prefix check, with the
    lease check on decode alongside), ``prefill_leg_s`` (the prefill request, end to end),
    ``decode_first_token_s`` (decode leg sent until its first token reached the router; streamed
    turns). From the connectors inside vLLM: ``prefill`` and ``decode``
    (:class:`EngineTimings`).
    """

    router_wait_s: float | None = None
    plan_s: float | None = None
    prefill_leg_s: float | None = None
    decode_first_token_s: float | None = None
    prefill: EngineTimings | None = None
    decode: EngineTimings | None = None

    def stages(self) -> dict[str, float]:
        """Flat ``stage -> seconds`` of what was measured (metric labels, tables)."""
        out = {k: v for k, v in (
            ("router_wait", self.router_wait_s), ("plan", self.plan_s),
            ("prefill_leg", self.prefill_leg_s), ("decode_first_token", self.decode_first_token_s),
        ) if v is not None}
        for leg, engine in (("prefill", self.prefill), ("decode", self.decode)):
            if engine is not None:
                out.update({f"{leg}_{k[:-2]}": v for k, v in engine.model_dump().items()
                            if v is not None})
        return out

    def header_value(self) -> str:
        """:data:`HEADER_TIMINGS`: ``stage=seconds`` pairs joined by ``;`` (ms precision)."""
        return ";".join(f"{k}={v:.3f}" for k, v in self.stages().items())


def parse_timings_header(value: str | None) -> dict[str, float]:
    """``stage -> seconds`` from :data:`HEADER_TIMINGS`; malformed pairs are skipped."""
    out: dict[str, float] = {}
    for pair in (value or "").split(";"):
        name, _, seconds = pair.partition("=")
        try:
            out[name.strip()] = float(seconds)
        except ValueError:
            continue
    return {k: v for k, v in out.items() if k and v >= 0}


class TurnRecord(BaseModel):
    """One turn as the router saw it."""

    turn: int
    outcome: str  # header form: "fired" / "miss:<cause>"
    reused_tokens: int = 0
    reusable_tokens: int = 0  # prompt tokens repeating the previous turn's sequence
    prompt_tokens: int = 0
    output_tokens: int = 0
    stream: bool = False
    prefill_instance: str | None = None
    decode_instance: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    started_unix_s: float = 0.0
    timings: TurnTimings = Field(default_factory=TurnTimings)

    @property
    def reuse(self) -> ReuseOutcome | None:
        """``outcome`` and the token counts, typed (None for a label this version does not
        know)."""
        return parse_reuse_header(self.outcome, str(self.reused_tokens),
                                  str(self.reusable_tokens))


class SessionStatus(BaseModel):
    """Body of ``GET /v1/sessions/{id}``."""

    conversation_id: str
    decode_instance: str | None
    retained_tokens: int
    lease_deadline_unix_s: float | None
    lease_state: Literal["active", "none", "expired", "released", "evicted"]
    lease_key: str | None = None  # the lease on the decode instance's kvtether connector
    turns: list[TurnRecord]  # the most recent turns only (the router keeps a bounded number)
    # Totals over every turn of the conversation, including those no longer in ``turns``.
    turn_count: int = 0
    fired_turns: int = 0
    prompt_tokens_total: int = 0
    reused_tokens_total: int = 0


# --- errors -------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorBody(BaseModel):
    """OpenAI-style error body."""

    error: ErrorDetail


def error_body(message: str, type_: str, *, param: str | None = None, code: Any = None) -> dict:
    return ErrorBody(error=ErrorDetail(message=message, type=type_, param=param, code=code)).model_dump()


# --- prefix identity ----------------------------------------------------------------------
def block_hashes(token_ids: Sequence[int], block_size: int) -> list[str]:
    """Chained hashes of each full block of ``token_ids``: equal hash i ⇔ equal first i+1 blocks."""
    out: list[str] = []
    prev = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(",".join(map(str, token_ids[start : start + block_size])).encode())
        prev = h.digest()
        out.append(prev.hex())
    return out


def matching_prefix_tokens(cached: Sequence[int], prompt: Sequence[int], block_size: int) -> int:
    """Tokens of ``cached`` that ``prompt`` repeats exactly, rounded down to whole blocks.

    Never more than ``len(prompt) - 1``: the last prompt token must be computed to sample from.
    """
    n = min(len(cached), len(prompt) - 1)
    i = 0
    while i < n and cached[i] == prompt[i]:
        i += 1
    return (i // block_size) * block_size


def common_prefix_tokens(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences (any int sequences)."""
    n = min(len(a), len(b))
    # Compare in chunks (C speed), then token by token inside the first differing chunk.
    chunk, i = 1024, 0
    while i + chunk <= n and list(a[i : i + chunk]) == list(b[i : i + chunk]):
        i += chunk
    while i < n and a[i] == b[i]:
        i += 1
    return i


def tail_block_hash(token_ids: Sequence[int], block_size: int) -> str | None:
    """Hash of the trailing partial block of ``token_ids``, chained on its full blocks.

    ``None`` when ``len(token_ids)`` is a multiple of ``block_size`` (no partial block).
    Equal tail hashes mean equal ``token_ids`` (the chain covers every earlier block).
    """
    n_full = len(token_ids) // block_size
    if len(token_ids) == n_full * block_size:
        return None
    chain = block_hashes(token_ids[: n_full * block_size], block_size)
    h = hashlib.blake2b(bytes.fromhex(chain[-1]) if chain else b"", digest_size=16)
    # A distinct separator keeps a tail from ever colliding with a full block's hash.
    h.update(b"tail:" + ",".join(map(str, token_ids[n_full * block_size :])).encode())
    return h.hexdigest()


# --- connector control channel --------------------------------------------------------------
# The kvtether vLLM connector (``kvtether.connector.nixl``) serves this HTTP API from each
# vLLM instance's engine-core process, on ``kv_connector_extra_config.kvtether_control_port``:
#
#   GET    /kvtether/v1/status                  ConnectorStatus
#   GET    /kvtether/v1/leases                  LeaseList
#   GET    /kvtether/v1/leases/{key}            LeaseInfo
#   POST   /kvtether/v1/leases/{key}/renew      LeaseRenewRequest -> LeaseInfo
#   DELETE /kvtether/v1/leases/{key}            LeaseInfo (state "released" once freed)
#   GET    /kvtether/v1/handles/{key}?wait_s=5  HandleResponse (long-poll until published)
#   GET    /kvtether/v1/metrics                 Prometheus text
#
# Errors use ``ErrorBody``; for a lease or handle that ended, 410 with ``error.code`` = the
# ``LeaseState`` and a ``lease`` field holding the final ``LeaseInfo``. With a shared secret in
# the connector's environment (``CONTROL_SECRET_ENV``) every request carries
# ``Authorization: Bearer <secret>`` (else 401, ``error.code`` "invalid_control_secret").
CONTROL_API_PREFIX = "/kvtether/v1"
CONTROL_SECRET_ENV = "KVTETHER_CONTROL_SECRET"

# Keys kvtether adds to vLLM's ``kv_transfer_params`` (vLLM passes unknown keys through).
KV_PARAM_HANDLE_KEY = "kvtether_handle_key"  # router -> D: publish the handle under this key
KV_PARAM_LEASE_TTL_S = "kvtether_lease_ttl_s"  # router -> D: initial lease length
KV_PARAM_LEASE_KEY = "kvtether_lease_key"  # D -> router: the key to renew / release
KV_PARAM_BLOCK_SIZE = "kvtether_block_size"  # D -> P: block size the hashes are over
KV_PARAM_BLOCK_HASHES = "kvtether_block_hashes"  # D -> P: block_hashes() of retained tokens
KV_PARAM_TAIL_HASH = "kvtether_tail_hash"  # D -> P: tail_block_hash() of retained tokens
KV_PARAM_REMOTE_TOKENS = "kvtether_remote_tokens"  # P -> router: tokens D offered
KV_PARAM_PREFIX_MATCH_TOKENS = "kvtether_prefix_match_tokens"  # P: offered tokens repeated
KV_PARAM_PREFIX_BREAK = "kvtether_prefix_break"  # P: the prompt differs from D's sequence
KV_PARAM_REUSED_TOKENS = "kvtether_reused_tokens"  # P: tokens actually read from D
KV_PARAM_PULL = "kvtether_pull"  # P: a PullOutcome value
KV_PARAM_TIMINGS = "kvtether_timings"  # P and D -> router: EngineTimings of the leg

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


def truncate_handle(
    params: dict[str, Any], n_blocks: int, block_size: int
) -> dict[str, Any] | None:
    """A copy of a decode handle cut to its first ``n_blocks`` blocks; ``None`` if it cannot be.

    Only single-group handles are cut. Hybrid models (sliding-window or mamba layers) keep only
    a window's tail in some KV cache groups, so "the first n blocks" is not the same tokens in
    every group there: such a handle is read whole or not at all, never cut (never wrong KV).
    """
    groups = params.get("remote_block_ids")
    if (not isinstance(groups, list) or len(groups) != 1 or not isinstance(groups[0], list)
            or n_blocks <= 0):
        return None
    cut = copy.deepcopy(params)
    cut["remote_block_ids"] = [list(groups[0][:n_blocks])]
    cut["remote_num_tokens"] = n_blocks * block_size
    # The prefix identity travels with the cut: a prefill checking the hashes against
    # remote_num_tokens would otherwise find them inconsistent and read nothing.
    hashes = cut.get(KV_PARAM_BLOCK_HASHES)
    if isinstance(hashes, list):
        cut[KV_PARAM_BLOCK_HASHES] = hashes[:n_blocks]
    cut.pop(KV_PARAM_TAIL_HASH, None)  # whole blocks only now: no partial tail block
    return cut


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
