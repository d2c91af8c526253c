"""Client hints, the session API's bodies and the per-turn record and timings."""

from __future__ import annotations

import enum
import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvtether._validation import first_field_error
from kvtether.protocol._outcome import ReuseOutcome, parse_reuse_header
from kvtether.protocol._wire import HEADER_HINTS


class Phase(str, enum.Enum):
    """What the agent is doing between model calls."""

    THINKING = "thinking"
    TOOL_RUNNING = "tool_running"
    IDLE = "idle"
    FINAL = "final"


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
    lease check on decode alongside; each of the two alone in ``plan_tokenize_s`` and
    ``plan_lease_s``; ``plan_prefix_cache_s``: asking decode's prefix cache about a
    conversation whose lease had ended), ``prefill_leg_s`` (the prefill request, end to end),
    ``decode_first_token_s`` (decode leg sent until its first token reached the router; streamed
    turns). From the connectors inside vLLM: ``prefill`` and ``decode``
    (:class:`EngineTimings`).
    """

    router_wait_s: float | None = None
    plan_s: float | None = None
    plan_tokenize_s: float | None = None
    plan_lease_s: float | None = None
    plan_prefix_cache_s: float | None = None
    prefill_leg_s: float | None = None
    decode_first_token_s: float | None = None
    prefill: EngineTimings | None = None
    decode: EngineTimings | None = None

    def stages(self) -> dict[str, float]:
        """Flat ``stage -> seconds`` of what was measured (metric labels, tables)."""
        out = {k: v for k, v in (
            ("router_wait", self.router_wait_s), ("plan", self.plan_s),
            ("plan_tokenize", self.plan_tokenize_s), ("plan_lease", self.plan_lease_s),
            ("plan_prefix_cache", self.plan_prefix_cache_s),
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
    # No prefill leg: decode computed the new tokens on the KV it retained (local prefill).
    local_prefill: bool = False
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


class BranchStatus(BaseModel):
    """One more branch of a conversation (a sequence besides its main one), in
    ``SessionStatus.branches``."""

    conversation_id: str  # ``<id>~b<k>``: GET /v1/sessions/{it} shows its turns
    decode_instance: str | None
    retained_tokens: int
    lease_state: Literal["active", "none", "expired", "released", "evicted"]
    turn_count: int = 0
    fired_turns: int = 0
    turns: list[TurnRecord] = Field(default_factory=list)  # its most recent turns


class SessionStatus(BaseModel):
    """Body of ``GET /v1/sessions/{id}``."""

    conversation_id: str
    decode_instance: str | None
    retained_tokens: int
    lease_deadline_unix_s: float | None
    # The conversation this one was spawned from (a subagent's main agent), when a request
    # named one (X-Parent-Conversation-Id, or a coding agent's own parent header).
    parent_id: str | None = None
    lease_state: Literal["active", "none", "expired", "released", "evicted"]
    lease_key: str | None = None  # the lease on the decode instance's kvtether connector
    # How the last turn's lease was sized: "hints" (the client's next_turn_gap_s), "default"
    # (hints without a gap: lease_ttl_s), and for a client that sends no hints (a coding
    # agent), "tool_calls" (the answer ended in tool calls: their learned duration) or
    # "person" (handed back to a person: at least vLLM's own TTL); null before any lease.
    lease_basis: Literal["hints", "default", "tool_calls", "person"] | None = None
    turns: list[TurnRecord]  # the most recent turns only (the router keeps a bounded number)
    # Totals over every turn of the conversation, including those no longer in ``turns``.
    turn_count: int = 0
    fired_turns: int = 0
    prompt_tokens_total: int = 0
    reused_tokens_total: int = 0
    # The conversation's other live sequences (a subagent or a parallel branch sharing its
    # id, a retry that diverged early, a harness's side request); this body's own fields are
    # branch 0's.
    branches: list[BranchStatus] = Field(default_factory=list)
    # The branch carrying the conversation (the one with the most turns; the most recently
    # active on a tie): this id, or one of ``branches``. A side request (OpenCode's title
    # request, a summariser) is a branch of its own with one turn.
    main_branch: str | None = None
