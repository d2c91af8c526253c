"""``Session.report()``: a plain-text table a person can read in a terminal or a log.

The table shows the turns the session lists (its most recent ones); the summary line counts
every turn, from the session's totals.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from kvtether.session._ledger import totals_of
from kvtether.session._records import SessionTotals, Turn

__all__ = ["format_report"]

_COLUMNS = (
    ("turn", 4),
    ("outcome", -22),
    ("reused", 7),
    ("reusable", 8),
    ("prompt", 7),
    ("output", 6),
    ("ttft_s", 7),
    ("latency_s", 9),
    ("gap_s", 7),
    ("tools after", -18),
    ("tool_s", 7),
    ("prefix", -30),
)


def _cell(value: object, width: int) -> str:
    text = value if isinstance(value, str) else "-" if value is None else str(value)
    if len(text) > abs(width):
        text = text[: abs(width) - 1] + "…"
    return text.ljust(-width) if width < 0 else text.rjust(width)


def _seconds(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}"


def _row(t: Turn) -> list[object]:
    outcome = t.outcome if t.outcome != "error" else f"error:{t.http_status or 'no answer'}"
    return [
        t.turn,
        outcome,
        t.reused_tokens,
        t.reusable_tokens,
        t.prompt_tokens,
        t.output_tokens,
        _seconds(t.ttft_s),
        _seconds(t.latency_s),
        _seconds(t.gap_before_s),
        ",".join(t.tools) or None,
        _seconds(t.tool_time_s) if t.tools else None,
        t.prefix_status,
    ]


def format_report(
    conversation_id: str,
    base_url: str | None,
    turns: Sequence[Turn],
    totals: SessionTotals | None = None,
) -> str:
    """``totals``: over every turn, listed or not (default: over ``turns``)."""
    totals = totals if totals is not None else totals_of(turns)
    lines = [f"kvtether session {conversation_id} · router {base_url or '(unknown)'}"]
    lines.append("  ".join(_cell(name, width) for name, width in _COLUMNS).rstrip())
    for t in turns:
        cells = zip(_row(t), _COLUMNS, strict=True)
        lines.append("  ".join(_cell(v, w) for v, (_, w) in cells).rstrip())
    lines.append(_summary(totals))
    errors = [
        abs(t.predicted_prompt_tokens - t.prompt_tokens) / t.prompt_tokens
        for t in turns
        if t.predicted_prompt_tokens and t.prompt_tokens and t.outcome != "error"
    ]
    if errors:
        lines.append(
            f"next-prompt prediction: median error {statistics.median(errors):.1%} "
            f"over {len(errors)} turns"
        )
    if (where := _where_time_went(turns)) is not None:
        lines.append(where)
    if totals.events:
        counts = ", ".join(f"{kind.value} x{n}" for kind, n in totals.events.items())
        lines.append(f"events: {counts}")
    return "\n".join(lines)


def _summary(t: SessionTotals) -> str:
    """Every turn's totals in one line, saying how many early turns the table leaves out."""
    rate = f" ({t.fired / t.eligible:.0%})" if t.eligible else ""
    share = f" ({t.reused_tokens / t.prompt_tokens:.0%})" if t.prompt_tokens else ""
    errors = f", {t.errors} failed" if t.errors else ""
    unlisted = f", the first {t.unlisted_turns:,} not listed" if t.unlisted_turns else ""
    return (
        f"fired {t.fired:,}/{t.eligible:,} eligible turns{rate}, {t.turns:,} in all{errors}"
        f"{unlisted} · reused {t.reused_tokens:,} of {t.prompt_tokens:,} prompt tokens{share}"
        f" · tool time {t.tool_time_s:.1f} s"
    )


def _where_time_went(turns: Sequence[Turn]) -> str | None:
    """Median of each stage before the first token over turns 2+ (the router's
    X-KVTether-Timings), and what remained of the client's TTFT: decode to its first token."""
    later = [t for t in turns[1:] if t.timings and t.ttft_s is not None]
    if not later:
        return None

    def med(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} s"

    def stage(name: str) -> list[float]:
        return [t.timings[name] for t in later if name in t.timings]

    parts = [f"TTFT {med([t.ttft_s for t in later if t.ttft_s is not None])}"]
    for label, name in (("waiting for the conversation", "router_wait"),
                        ("tokenize", "plan"), ("prefill", "prefill_leg")):
        if values := stage(name):
            parts.append(f"{label} {med(values)}")
    inside = [f"{label} {med(values)}" for label, name in (
        ("queue", "prefill_queue"), ("KV read", "prefill_read")) if (values := stage(name))]
    if inside:
        parts[-1] += f" ({', '.join(inside)})"
    before = [sum(t.timings.get(k, 0.0) for k in ("router_wait", "plan", "prefill_leg"))
              for t in later]
    rest = [t.ttft_s - b for t, b in zip(later, before, strict=True) if t.ttft_s is not None]
    parts.append(f"decode to first token {med(rest)}")
    return f"where turn 2+ time went (median of {len(later)}): " + " · ".join(parts)
