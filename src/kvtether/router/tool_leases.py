"""Leases for clients that send no hints: coding-agent harnesses (Claude Code, Codex,
OpenCode), which neither predict their next turn nor heartbeat while their tools run.

The router relays every answer and sees how it ended (:mod:`.answers`):

* handed back to a person: the KV is held as long as stock vLLM would hold it,
  ``max(lease_ttl_s, decoder_kv_blocks_ttl_s)`` (at most ``max_lease_s``);
* in tool calls: for the time this conversation's next turn is expected to come after those
  tools, times :data:`TOOL_GAP_FACTOR`, plus ``lease_safety_margin_s``; at least
  ``lease_ttl_s``, at most ``max_lease_s``. Parallel calls: the longest estimate. Until the
  conversation has shown how long its tools take, as long as for a person: a first tool run of
  minutes keeps its KV, and what is learned from it shortens the leases after fast tools.

The expected time is learned per conversation (:class:`ToolGaps`): the gap between an answer
that ended in tool calls and the conversation's next request, per tool and command
(``Bash:pytest``), falling back to the tool (``Bash``), then to this conversation's tools in
general, then to :data:`TOOL_GAP_DEFAULT_S`. It is the client's kind of estimate
(``kvtether.session``'s growth predictor): a running median in log space, robust to the rare
huge gap, where a key with few samples leans on the level above it. The gap is what the router
can see: the tool's run, the harness's own work and any wait for the person's permission.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from kvtether.protocol import Phase
from kvtether.router.answers import AnswerEnd

if TYPE_CHECKING:
    from kvtether.protocol import TurnRecord
    from kvtether.router.settings import RouterSettings

__all__ = ["AwaitingTools", "LeaseBasis", "LeaseSizing", "MAX_TOOL_KEYS", "TOOL_GAP_DEFAULT_S",
           "TOOL_GAP_FACTOR", "ToolGaps", "ToolTracking", "person_lease_s",
           "size_after_answer"]

# How the lease of a conversation's last turn was sized (GET /v1/sessions/{id}).
LeaseBasis = Literal["hints", "default", "tool_calls", "person"]

# Before a conversation has shown its tools: the mean tool call of coding agents (TraceLab,
# 432k Claude Code / Codex tool calls: mean 18.4 s, p50 0.3 s, p90 13.6 s), the time that
# dominates held KV.
TOOL_GAP_DEFAULT_S = 18.4
# The estimate is a median and nothing renews the lease: cover most of the spread above it.
TOOL_GAP_FACTOR = 2.0
MAX_TOOL_KEYS = 32  # learned keys per conversation; the least recently seen goes first
_ALPHA = 0.15  # weight of the newest gap once a key has a few (as the client's predictor)
_ALL = "*"  # this conversation's tools in general
_MAX_GAP_S = 86400.0


class ToolGaps:
    """One conversation's learned gaps after tool calls: key -> (samples, mean of log s)."""

    __slots__ = ("_stats",)

    def __init__(self, stats: dict[str, tuple[int, float]] | None = None) -> None:
        self._stats: dict[str, tuple[int, float]] = dict(stats or {})  # oldest seen first

    def __len__(self) -> int:
        return len(self._stats)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ToolGaps) and self._stats == other._stats

    def observe(self, keys: Iterable[str], gap_s: float) -> None:
        """The next turn came ``gap_s`` after an answer that called ``keys``. Parallel calls
        each learn the whole gap: it bounds each one's time, and a lease covers the longest."""
        value = math.log(min(max(gap_s, 1e-3), _MAX_GAP_S))
        for key in dict.fromkeys(k for key in keys for k in _levels(key)):
            n, mean = self._stats.pop(key, (0, 0.0))
            n += 1
            mean += max(1.0 / n, _ALPHA) * (value - mean)
            self._stats[key] = (n, mean)
        while len(self._stats) > MAX_TOOL_KEYS:
            del self._stats[next(k for k in self._stats if k != _ALL)]

    def estimate_s(self, key: str) -> float:
        """The expected gap after a call of ``key``: each level shrinks toward the one above
        it while it has few samples (half a sample's worth, as the client's predictor)."""
        log = math.log(TOOL_GAP_DEFAULT_S)
        for level in _levels(key):
            stat = self._stats.get(level)
            if stat is not None:
                n, mean = stat
                w = n / (n + 0.5)
                log = w * mean + (1.0 - w) * log
        return math.exp(log)

    def to_json(self) -> list[list[Any]]:
        return [[k, n, mean] for k, (n, mean) in self._stats.items()]

    @classmethod
    def from_json(cls, data: Any) -> ToolGaps:
        stats: dict[str, tuple[int, float]] = {}
        for row in data if isinstance(data, list) else ():
            if isinstance(row, list) and len(row) == 3:
                stats[str(row[0])] = (int(row[1]), float(row[2]))
        return cls(stats)


def _levels(key: str) -> tuple[str, ...]:
    """``Bash:pytest`` -> (``*``, ``Bash``, ``Bash:pytest``): the chain an estimate walks."""
    name = key.split(":", 1)[0]
    return (_ALL, name) if name == key else (_ALL, name, key)


@dataclass(frozen=True, slots=True)
class AwaitingTools:
    """An answer that ended in tool calls, until the conversation's next turn comes."""

    keys: tuple[str, ...]
    answered_unix_s: float
    turn: int


@dataclass(frozen=True, slots=True)
class LeaseSizing:
    lease_s: float
    basis: LeaseBasis


class ToolTracking(Protocol):
    """What :func:`size_after_answer` reads and updates on a conversation (a
    ``router.conversations.Conversation``), named here so that module need not be imported."""

    awaiting_tools: AwaitingTools | None
    tool_gaps: ToolGaps
    phase: Phase | None


def person_lease_s(s: RouterSettings) -> float:
    """A turn handed back to a person: never shorter than stock vLLM would hold it."""
    return min(max(s.lease_ttl_s, s.decoder_kv_blocks_ttl_s), s.max_lease_s)


def size_after_answer(s: RouterSettings, conv: ToolTracking, end: AnswerEnd,
                      record: TurnRecord, now_unix_s: float) -> LeaseSizing:
    """The lease of an unhinted turn that just answered; first, what its arrival says about
    the tools the conversation's previous answer called."""
    awaiting = conv.awaiting_tools
    if awaiting is not None and record.turn == awaiting.turn + 1:
        conv.tool_gaps.observe(awaiting.keys, record.started_unix_s - awaiting.answered_unix_s)
    if not end.tool_calls:
        conv.awaiting_tools = None
        conv.phase = Phase.IDLE  # a person's reply: the budget values it below a tool's
        return LeaseSizing(person_lease_s(s), "person")
    conv.awaiting_tools = AwaitingTools(end.tool_keys, now_unix_s, record.turn)
    conv.phase = Phase.TOOL_RUNNING
    if not conv.tool_gaps:  # nothing learned yet
        return LeaseSizing(person_lease_s(s), "tool_calls")
    expected_s = max(conv.tool_gaps.estimate_s(k) for k in end.tool_keys)
    lease_s = expected_s * TOOL_GAP_FACTOR + s.lease_safety_margin_s
    return LeaseSizing(min(max(lease_s, s.lease_ttl_s), s.max_lease_s), "tool_calls")
