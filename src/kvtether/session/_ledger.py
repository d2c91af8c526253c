"""``Ledger``: the records a session lists, bounded, and totals that cover every record.

A pooled conversation may never end, so a session lists only its most recent turns, tool runs
and events (``SessionSettings.max_turn_records`` of each) and folds each record it stops
listing into running totals. The totals (``SessionTotals``) therefore count every turn the
session ever had, as if nothing had been dropped. Not thread-safe: ``SessionState`` calls it
under its lock.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, replace

from kvtether.session._records import EventKind, SessionEvent, SessionTotals, ToolRun, Turn

__all__ = ["Ledger", "totals_of"]


@dataclass(slots=True)
class _TurnSums:
    turns: int = 0
    fired: int = 0
    eligible: int = 0
    errors: int = 0
    reused_tokens: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    tool_time_s: float = 0.0

    def add(self, turn: Turn) -> None:
        self.turns += 1
        self.fired += turn.fired
        self.eligible += turn.eligible
        self.errors += turn.outcome == "error"
        self.reused_tokens += turn.reused_tokens
        self.prompt_tokens += turn.prompt_tokens
        self.output_tokens += turn.output_tokens
        self.tool_time_s += turn.tool_time_s


class Ledger:
    """The last ``max_records`` turns, tool runs and events, and totals over all of them."""

    def __init__(self, max_records: int) -> None:
        self.turns: deque[Turn] = deque(maxlen=max_records)
        self.tool_runs: deque[ToolRun] = deque(maxlen=max_records)
        self.events: deque[SessionEvent] = deque(maxlen=max_records)
        self._unlisted = _TurnSums()  # the turns no longer listed
        self._unlisted_tool_runs = 0
        self._event_counts: Counter[EventKind] = Counter()  # every event, listed or not

    @property
    def last_turn(self) -> Turn | None:
        return self.turns[-1] if self.turns else None

    def add_turn(self, turn: Turn) -> None:
        if self.turns and self.turns[-1].turn == turn.turn:
            self.turns[-1] = turn  # a retry replaces its failed attempt
            return
        if len(self.turns) == self.turns.maxlen:
            self._unlisted.add(self.turns[0])  # final: only the last turn is ever replaced
        self.turns.append(turn)

    def add_tool_run(self, run: ToolRun) -> None:
        if len(self.tool_runs) == self.tool_runs.maxlen:
            self._unlisted_tool_runs += 1
        self.tool_runs.append(run)

    def add_event(self, event: SessionEvent) -> None:
        self._event_counts[event.kind] += 1
        self.events.append(event)

    def tool_finished(self, run: ToolRun) -> None:
        """Charge a finished run's time to the turn whose reply asked for it."""
        for turn in reversed(self.turns):
            if turn.turn == run.after_turn:
                turn.tools.append(run.name)
                turn.tool_time_s += run.duration_s
                return
        if run.after_turn > 0 and self._unlisted.turns:
            # Its turn is no longer listed (more turns ran meanwhile): the totals still count it.
            self._unlisted.tool_time_s += run.duration_s

    def totals(self) -> SessionTotals:
        counts = self._event_counts
        return replace(
            totals_of(self.turns, self._unlisted),
            unlisted_turns=self._unlisted.turns,
            tool_runs=self._unlisted_tool_runs + len(self.tool_runs),
            unlisted_tool_runs=self._unlisted_tool_runs,
            events=dict(counts),
            unlisted_events=sum(counts.values()) - len(self.events),
        )


def totals_of(turns: Iterable[Turn], unlisted: _TurnSums | None = None) -> SessionTotals:
    """The turn counts of ``turns`` (plus ``unlisted``); no tool runs or events."""
    sums = replace(unlisted) if unlisted is not None else _TurnSums()
    for turn in turns:
        sums.add(turn)
    return SessionTotals(
        turns=sums.turns,
        fired=sums.fired,
        eligible=sums.eligible,
        errors=sums.errors,
        reused_tokens=sums.reused_tokens,
        prompt_tokens=sums.prompt_tokens,
        output_tokens=sums.output_tokens,
        tool_time_s=sums.tool_time_s,
    )
