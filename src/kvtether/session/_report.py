"""``Session.report()``: a plain-text table a person can read in a terminal or a log."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence

from kvtether.session._records import SessionEvent, Turn

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
    events: Sequence[SessionEvent],
) -> str:
    lines = [f"kvtether session {conversation_id} · router {base_url or '(unknown)'}"]
    lines.append("  ".join(_cell(name, width) for name, width in _COLUMNS).rstrip())
    for t in turns:
        cells = zip(_row(t), _COLUMNS, strict=True)
        lines.append("  ".join(_cell(v, w) for v, (_, w) in cells).rstrip())
    fired = sum(t.fired for t in turns)
    eligible = sum(t.eligible for t in turns)
    reused = sum(t.reused_tokens for t in turns)
    prompt = sum(t.prompt_tokens for t in turns)
    tool_s = sum(t.tool_time_s for t in turns)
    share = f" ({reused / prompt:.0%})" if prompt else ""
    rate = f" ({fired / eligible:.0%})" if eligible else ""
    lines.append(
        f"fired {fired}/{eligible} eligible turns{rate}, {len(turns)} in all · reused "
        f"{reused:,} of {prompt:,} prompt tokens{share} · tool time {tool_s:.1f} s"
    )
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
    if events:
        counts = Counter(e.kind.value for e in events)
        lines.append("events: " + ", ".join(f"{k} x{n}" for k, n in counts.items()))
    return "\n".join(lines)


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
