"""Synthetic agent sessions shaped by published agent-loop measurements.

Shapes: tool-call durations pooled over all tools p50 0.3 s, p90 13.6 s, p99 3.6 min
(TraceLab); per-step prefix growth p50 ~700-950 tokens, p90 3-8K; 12-60 model calls per
session; LLM step generation p50 4.9 s, p90 20.2 s; human think time p50 1.4 min, p90 20.6
min. Each tool has its own duration and result-size profile, and ``bash`` runs commands whose
first word predicts their duration, as in real coding agents.

Everything is drawn from ``random.Random(seed)``: the same arguments give the same sessions on
any machine. ``time_scale`` and ``token_scale`` shrink sessions for fast tests.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvtether.session import GrowthPredictor, tool_key

__all__ = [
    "ToolProfile",
    "Command",
    "TOOLS",
    "Step",
    "AgentSession",
    "generate_sessions",
    "workload_stats",
    "filler_text",
    "PredictionScores",
    "score_predictions",
    "score_predictions_by_turn",
    "GAP_FLOOR_S",
    "GROWTH_FLOOR_TOKENS",
]

_Z90 = 1.2816  # standard normal quantile at 0.9: sigma = ln(p90 / p50) / _Z90


@dataclass(frozen=True, slots=True)
class Command:
    """A first word of a shell command, with its own duration and output size."""

    word: str
    weight: float
    duration_p50_s: float
    result_p50_tokens: float


@dataclass(frozen=True, slots=True)
class ToolProfile:
    name: str
    weight: float  # share of tool calls
    duration_p50_s: float
    duration_sigma: float  # of ln(duration)
    result_p50_tokens: float
    result_sigma: float
    arg_name: str
    commands: tuple[Command, ...] = ()  # when set, they replace the p50s above


_BASH_COMMANDS = (
    Command("ls", 0.30, 0.15, 120.0),
    Command("git", 0.25, 0.4, 350.0),
    Command("python", 0.20, 4.0, 500.0),
    Command("pytest", 0.15, 30.0, 1800.0),
    Command("pip", 0.10, 15.0, 600.0),
)
TOOLS: tuple[ToolProfile, ...] = (
    ToolProfile("read_file", 0.30, 0.1, 0.8, 700.0, 1.1, "path"),
    ToolProfile("grep", 0.18, 0.6, 0.9, 300.0, 1.0, "pattern"),
    ToolProfile("edit_file", 0.14, 0.2, 0.6, 60.0, 0.6, "path"),
    ToolProfile("bash", 0.28, 0.0, 0.8, 0.0, 0.9, "command", commands=_BASH_COMMANDS),
    ToolProfile("web_fetch", 0.05, 3.0, 1.2, 3000.0, 0.8, "url"),
    ToolProfile("run_tests", 0.04, 90.0, 1.3, 2200.0, 0.8, "target"),
)

_OUTPUT_P50_TOKENS, _OUTPUT_SIGMA = 220.0, 1.1
_GENERATION_P50_S, _GENERATION_SIGMA = 4.9, math.log(20.2 / 4.9) / _Z90
_THINK_P50_S, _THINK_SIGMA = 84.0, math.log(1236.0 / 84.0) / _Z90
_USER_P50_TOKENS, _USER_SIGMA = 120.0, 1.0
_FIRST_PROMPT_P50_TOKENS, _FIRST_PROMPT_SIGMA = 3000.0, 0.4
_TEMPLATE_TOKENS_PER_MESSAGE = 12  # role markers and separators around each appended message
_USER_TURN_PROBABILITY = 0.1  # ~9 user requests per ~74 tool steps in TraceLab sessions
_WORDS = ("alpha", "beta", "gamma", "delta", "kernel", "cache", "token", "lease", "router")


@dataclass(frozen=True, slots=True)
class Step:
    """One model call and what the agent did with its reply."""

    index: int
    prompt_tokens: int
    output_tokens: int
    generation_s: float
    action: Literal["tool", "user", "end"]
    tool_name: str | None = None
    tool_args: dict[str, str] = field(default_factory=dict)
    gap_s: float = 0.0  # tool duration, or the person's think time; 0 after the last step
    appended_tokens: int = 0  # tool result or user message, template tokens included


@dataclass(frozen=True, slots=True)
class AgentSession:
    session_id: str
    steps: tuple[Step, ...]


def _lognormal(rng: random.Random, p50: float, sigma: float) -> float:
    return p50 * math.exp(rng.gauss(0.0, sigma))


def _pick(rng: random.Random, items: Sequence[ToolProfile] | Sequence[Command]) -> int:
    weights = [item.weight for item in items]
    return rng.choices(range(len(items)), weights=weights)[0]


def _tool_call(
    rng: random.Random, tools: Sequence[ToolProfile]
) -> tuple[str, dict[str, str], float, float]:
    tool = tools[_pick(rng, tools)]
    duration_p50, result_p50 = tool.duration_p50_s, tool.result_p50_tokens
    arg = f"{rng.choice(_WORDS)}_{rng.randrange(1000)}"
    if tool.commands:
        cmd = tool.commands[_pick(rng, tool.commands)]
        duration_p50, result_p50 = cmd.duration_p50_s, cmd.result_p50_tokens
        arg = f"{cmd.word} {arg}"
    duration_s = _lognormal(rng, duration_p50, tool.duration_sigma)
    result_tokens = _lognormal(rng, result_p50, tool.result_sigma)
    return tool.name, {tool.arg_name: arg}, duration_s, result_tokens


def _session(
    index: int,
    seed: int,
    steps: tuple[int, int],
    time_scale: float,
    token_scale: float,
    tools: Sequence[ToolProfile],
) -> AgentSession:
    rng = random.Random(seed * 1_000_003 + index)
    n_steps = rng.randint(*steps)
    prompt = _lognormal(rng, _FIRST_PROMPT_P50_TOKENS, _FIRST_PROMPT_SIGMA)
    out: list[Step] = []
    for i in range(n_steps):
        output = _lognormal(rng, _OUTPUT_P50_TOKENS, _OUTPUT_SIGMA)
        generation_s = _lognormal(rng, _GENERATION_P50_S, _GENERATION_SIGMA)
        name: str | None = None
        args: dict[str, str] = {}
        gap_s = appended = 0.0
        action: Literal["tool", "user", "end"] = "end"
        if i < n_steps - 1 and rng.random() < _USER_TURN_PROBABILITY:
            action = "user"
            gap_s = _lognormal(rng, _THINK_P50_S, _THINK_SIGMA)
            appended = _lognormal(rng, _USER_P50_TOKENS, _USER_SIGMA)
        elif i < n_steps - 1:
            action = "tool"
            name, args, gap_s, appended = _tool_call(rng, tools)
        if action != "end":
            appended += _TEMPLATE_TOKENS_PER_MESSAGE
        out.append(
            Step(
                index=i,
                prompt_tokens=max(1, round(prompt * token_scale)),
                output_tokens=max(1, round(output * token_scale)),
                generation_s=generation_s * time_scale,
                action=action,
                tool_name=name,
                tool_args=args,
                gap_s=gap_s * time_scale,
                appended_tokens=round(appended * token_scale),
            )
        )
        prompt += output + appended
    return AgentSession(session_id=f"wl-{seed}-{index}", steps=tuple(out))


def generate_sessions(
    n: int,
    *,
    seed: int = 0,
    steps: tuple[int, int] = (12, 60),
    time_scale: float = 1.0,
    token_scale: float = 1.0,
    tools: Sequence[ToolProfile] = TOOLS,
) -> list[AgentSession]:
    """``n`` sessions; session ``i`` depends only on ``(seed, i)`` and the shape arguments."""
    if n < 0 or not (1 <= steps[0] <= steps[1]) or time_scale <= 0 or token_scale <= 0:
        raise ValueError("need n >= 0, 1 <= steps[0] <= steps[1], positive scales")
    return [_session(i, seed, steps, time_scale, token_scale, tools) for i in range(n)]


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else math.nan


def workload_stats(sessions: Sequence[AgentSession]) -> dict[str, float]:
    """The quantiles the generator is shaped to, for checking it against the sources."""
    tool_s = [s.gap_s for x in sessions for s in x.steps if s.action == "tool"]
    growth = [
        b.prompt_tokens - a.prompt_tokens
        for x in sessions
        for a, b in zip(x.steps, x.steps[1:], strict=False)
    ]
    return {
        "sessions": float(len(sessions)),
        "steps_mean": statistics.fmean(len(x.steps) for x in sessions) if sessions else 0.0,
        "tool_p50_s": _quantile(tool_s, 0.5),
        "tool_p90_s": _quantile(tool_s, 0.9),
        "tool_p99_s": _quantile(tool_s, 0.99),
        "tool_mean_s": statistics.fmean(tool_s) if tool_s else math.nan,
        "growth_p50_tokens": _quantile(growth, 0.5),
        "growth_p90_tokens": _quantile(growth, 0.9),
    }


def filler_text(tokens: int, seed: int = 0) -> str:
    """Roughly ``tokens`` tokens of deterministic text, for replaying a step against a server."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(max(0, tokens)))


@dataclass(frozen=True, slots=True)
class PredictionScores:
    """Errors of one prediction point against the naive baseline (next prompt = this prompt,
    next gap = the previous gap). Relative errors are ``|predicted - actual| / actual``; for
    gaps the actual is taken as at least ``GAP_FLOOR_S``."""

    samples: int
    tokens_mape: float
    tokens_mape_naive: float
    tokens_median_abs_error: float
    tokens_median_abs_error_naive: float
    gap_median_abs_error_s: float
    gap_median_abs_error_naive_s: float
    gap_median_abs_log_ratio: float  # |ln(predicted / actual)|: 0.69 = off by a factor of 2
    gap_median_abs_log_ratio_naive: float
    tokens_median_rel_error: float = math.nan
    tokens_p90_rel_error: float = math.nan
    tokens_median_rel_error_naive: float = math.nan
    tokens_p90_rel_error_naive: float = math.nan
    gap_median_rel_error: float = math.nan
    gap_p90_rel_error: float = math.nan
    gap_median_rel_error_naive: float = math.nan
    gap_p90_rel_error_naive: float = math.nan
    # |predicted - actual| over the actual growth (next prompt - this prompt, at least
    # GROWTH_FLOOR_TOKENS): the part of a long prompt a prediction can get wrong. The naive
    # baseline (no growth) scores 1.0 on every sample.
    growth_median_rel_error: float = math.nan
    growth_p90_rel_error: float = math.nan


# A gap under a second is scored as a second: recorded traces round gaps to whole seconds (a
# recorded 0 is "under one"), and a lease sized for 0.2 s or for 1 s costs the same.
GAP_FLOOR_S = 1.0
GROWTH_FLOOR_TOKENS = 64  # a block: growth below it is scored as one block


class _Errors:
    def __init__(self) -> None:
        self.rows: list[tuple[float, float, float, float, float, float]] = []

    def add(
        self,
        tokens: float,
        naive_tokens: float,
        actual_tokens: float,
        gap_s: float,
        naive_gap_s: float,
        actual_gap_s: float,
    ) -> None:
        self.rows.append((tokens, naive_tokens, actual_tokens, gap_s, naive_gap_s, actual_gap_s))

    def _rel(self, i: int) -> list[float]:
        if i < 3:
            return [abs(r[i] - r[2]) / max(r[2], 1.0) for r in self.rows]
        return [abs(r[i] - r[5]) / max(r[5], GAP_FLOOR_S) for r in self.rows]

    def scores(self) -> PredictionScores:
        if not self.rows:
            return PredictionScores(0, *([math.nan] * 8))  # the rest default to nan

        def med(i: int, j: int) -> float:
            return statistics.median(abs(r[i] - r[j]) for r in self.rows)

        def log_ratio(i: int) -> float:
            return statistics.median(
                abs(math.log(max(r[i], 1e-3) / max(r[5], 1e-3))) for r in self.rows
            )

        rel = {i: self._rel(i) for i in (0, 1, 3, 4)}
        growth = [abs(r[0] - r[2]) / max(abs(r[2] - r[1]), GROWTH_FLOOR_TOKENS)
                  for r in self.rows]
        return PredictionScores(
            samples=len(self.rows),
            tokens_mape=statistics.fmean(rel[0]),
            tokens_mape_naive=statistics.fmean(rel[1]),
            tokens_median_abs_error=med(0, 2),
            tokens_median_abs_error_naive=med(1, 2),
            gap_median_abs_error_s=med(3, 5),
            gap_median_abs_error_naive_s=med(4, 5),
            gap_median_abs_log_ratio=log_ratio(3),
            gap_median_abs_log_ratio_naive=log_ratio(4),
            tokens_median_rel_error=statistics.median(rel[0]),
            tokens_p90_rel_error=_quantile(rel[0], 0.9),
            tokens_median_rel_error_naive=statistics.median(rel[1]),
            tokens_p90_rel_error_naive=_quantile(rel[1], 0.9),
            gap_median_rel_error=statistics.median(rel[3]),
            gap_p90_rel_error=_quantile(rel[3], 0.9),
            gap_median_rel_error_naive=statistics.median(rel[4]),
            gap_p90_rel_error_naive=_quantile(rel[4], 0.9),
            growth_median_rel_error=statistics.median(growth),
            growth_p90_rel_error=_quantile(growth, 0.9),
        )


_Row = tuple[float, float, float, float, float, float]


def _prediction_rows(
    sessions: Sequence[AgentSession],
) -> list[tuple[Literal["request", "tool"], int, _Row]]:
    """Each prediction a fresh ``GrowthPredictor`` per session makes, with its turn index
    (0 = the session's first model call) and what happened next."""
    rows: list[tuple[Literal["request", "tool"], int, _Row]] = []
    for session in sessions:
        predictor = GrowthPredictor()
        steps = session.steps
        previous_gap_s = 0.3
        for n, step in enumerate(steps[:-1]):
            following = steps[n + 1]
            if n > 0:
                before = steps[n - 1]
                predictor.observe_gap(before.gap_s, after_tool_calls=before.action == "tool")
            guess = predictor.at_request(step.prompt_tokens, tools_offered=True)
            rows.append(("request", n, (
                guess.next_prompt_tokens, step.prompt_tokens, following.prompt_tokens,
                guess.next_turn_gap_s, previous_gap_s, step.gap_s)))
            predictor.observe_turn(step.prompt_tokens, step.output_tokens, step.action == "tool")
            if step.action == "tool" and step.tool_name is not None:
                key = tool_key(step.tool_name, step.tool_args)
                guess = predictor.at_tool(key)
                rows.append(("tool", n, (
                    guess.next_prompt_tokens, step.prompt_tokens, following.prompt_tokens,
                    guess.next_turn_gap_s, previous_gap_s, step.gap_s)))
                predictor.observe_tool(key, step.gap_s)
            previous_gap_s = step.gap_s
    return rows


def score_predictions(sessions: Sequence[AgentSession]) -> dict[str, PredictionScores]:
    """Replay sessions through a fresh ``GrowthPredictor`` each and score its predictions.

    ``"request"``: the hints sent with each model request (the reply, and so the next tool,
    are unknown). ``"tool"``: the hints sent in heartbeats while a tool runs (tool known).
    """
    errors = {"request": _Errors(), "tool": _Errors()}
    for point, _, row in _prediction_rows(sessions):
        errors[point].add(*row)
    return {point: e.scores() for point, e in errors.items()}


def score_predictions_by_turn(
    sessions: Sequence[AgentSession], edges: Sequence[int] = (1, 5, 20)
) -> dict[str, dict[str, PredictionScores]]:
    """:func:`score_predictions` per turn-index bucket: ``edges`` (1-based turn numbers) start
    the buckets, so ``(1, 5, 20)`` gives turns 1-4, 5-19 and 20+. Empty buckets are left out."""
    starts = sorted(set(edges))
    if not starts or starts[0] < 1:
        raise ValueError("turn buckets start at turn 1 or later")
    labels = [f"{a}-{b - 1}" for a, b in itertools.pairwise(starts)]
    labels.append(f"{starts[-1]}+")
    errors = {p: {label: _Errors() for label in labels} for p in ("request", "tool")}
    for point, n, row in _prediction_rows(sessions):
        turn = n + 1
        if turn < starts[0]:
            continue
        index = max(i for i, a in enumerate(starts) if a <= turn)
        errors[point][labels[index]].add(*row)
    return {
        point: {label: e.scores() for label, e in buckets.items() if e.rows}
        for point, buckets in errors.items()
    }
