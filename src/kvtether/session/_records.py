"""What a session remembers: one record per model request (turn), per tool run, per incident,
and totals over all of them (a session lists only the most recent ones)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvtether.protocol import ReuseOutcome, TurnHints

__all__ = [
    "PrefixStatus",
    "PrefixCheck",
    "ToolRun",
    "Turn",
    "SessionEvent",
    "EventKind",
    "SessionTotals",
]


class PrefixStatus(str, enum.Enum):
    """How a turn's prompt relates to the previous turn's prompt plus the reply it produced."""

    FIRST = "first"  # nothing to compare with yet
    EXTENDS = "extends"  # previous prompt + reply, unchanged, then new messages: KV reusable
    RESENT = "resent"  # exactly the previous prompt + reply again (a retry or a re-ask)
    BREAK = "break"  # history was rewritten; decode-held KV is reusable only up to the break
    UNTRACKED = "untracked"  # a request shape the tracker does not follow (e.g. a batch prompt)


@dataclass(frozen=True, slots=True)
class PrefixCheck:
    status: PrefixStatus
    # Index of the first message (or, for /v1/completions, character) that differs from
    # what the previous turn left on decode; None unless status is BREAK.
    break_index: int | None = None
    # Why it broke: system_prompt_changed, reasoning_stripped, assistant_edited,
    # tool_results_reordered, message_dropped, message_edited, history_truncated, prompt_edited.
    cause: str | None = None
    detail: str = ""

    @property
    def label(self) -> str:
        if self.status is PrefixStatus.BREAK:
            return f"break@{self.break_index}:{self.cause}"
        return str(self.status.value)


@dataclass(slots=True)
class ToolRun:
    name: str
    key: str  # predictor key: name, or name:variant derived from the arguments
    after_turn: int  # the turn whose reply asked for this tool (0: before any turn)
    eta_s: float | None
    predicted_s: float
    duration_s: float = 0.0
    ok: bool = True
    error: str | None = None  # exception type name when the tool raised or was cancelled
    heartbeats: int = 0
    heartbeat_failures: int = 0


@dataclass(slots=True)
class Turn:
    """One model request and what the router and the model said about it."""

    turn: int  # 1-based, in the order this session sent requests
    endpoint: str  # "chat" or "completions"
    stream: bool
    step: int | None = None  # the @session.step call this request was made in, if any
    outcome: str = "unknown"  # "fired", "miss:<cause>", "unknown" (no router header), "error"
    reuse: ReuseOutcome | None = None
    reused_tokens: int = 0
    # Prompt tokens repeating what the previous turn built (X-KVTether-Reusable-Tokens).
    reusable_tokens: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    gap_before_s: float | None = None  # from the previous turn's end to this request
    tool_time_s: float = 0.0  # time spent in tools after this turn, before the next one
    tools: list[str] = field(default_factory=list)
    prefix: PrefixCheck = field(default_factory=lambda: PrefixCheck(PrefixStatus.FIRST))
    hints: TurnHints | None = None
    predicted_prompt_tokens: int | None = None  # what the previous turn predicted for this one
    finish_reason: str | None = None
    router_turn: int | None = None  # X-KVTether-Turn, the router's own count
    decode_instance: str | None = None
    http_status: int | None = None
    error: str | None = None
    attempts: int = 1  # >1 when the SDK retried this request
    completed: bool = True  # False when the caller stopped reading a stream early
    # Where the router says the time before decode went (X-KVTether-Timings): stage -> seconds
    # (router_wait, plan, prefill_leg, prefill_queue, prefill_read, prefill_engine).
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def prefix_status(self) -> str:
        return self.prefix.label

    @property
    def fired(self) -> bool:
        return self.outcome == "fired"

    @property
    def eligible(self) -> bool:
        """Enough was reusable for reuse to matter: the turn fired or lost KV (the router's
        definition, ``kvtether.protocol.MissCause``)."""
        return self.reuse is not None and self.reuse.eligible and self.outcome != "error"


class EventKind(str, enum.Enum):
    HEARTBEAT_FAILED = "heartbeat_failed"
    HEARTBEAT_REJECTED = "heartbeat_rejected"  # 400: router refused our body (version skew?)
    LEASE_NOT_FOUND = "lease_not_found"  # 404 on heartbeat: router forgot the conversation
    KV_GONE = "kv_gone"  # 410 on heartbeat
    REQUEST_FAILED = "request_failed"  # a model request did not reach the router
    RELEASED = "released"
    RELEASE_FAILED = "release_failed"
    PREFIX_BREAK = "prefix_break"


@dataclass(frozen=True, slots=True)
class SessionEvent:
    kind: EventKind
    detail: str
    at_unix_s: float
    turn: int | None = None


@dataclass(frozen=True, slots=True)
class SessionTotals:
    """Counts over every turn, tool run and event of a session, including the early ones that
    ``session.turns`` / ``tool_runs`` / ``events`` no longer list (``unlisted_*``)."""

    turns: int = 0
    unlisted_turns: int = 0
    fired: int = 0
    eligible: int = 0
    errors: int = 0  # turns whose request failed (outcome "error")
    reused_tokens: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    tool_time_s: float = 0.0  # time in tools after a turn, before the next one
    tool_runs: int = 0
    unlisted_tool_runs: int = 0
    events: dict[EventKind, int] = field(default_factory=dict)  # by kind
    unlisted_events: int = 0
