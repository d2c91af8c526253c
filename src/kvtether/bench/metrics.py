"""Per-turn reuse outcomes and per-strategy metrics, the same arithmetic for every strategy.

A turn's outcome is decided from token ids alone, so it means the same for a colocated vLLM and
for any P/D router, and the same as the router's ``X-KVTether-Reuse`` label
(docs/wire-contract.md):

* ``reusable`` tokens: the longest common prefix of this turn's prompt and the token sequence
  the previous turn built (its prompt and its answer, less the answer's last token, whose KV
  no engine computed): what earlier turns had computed KV for.
* ``reused`` tokens: what the serving side reports it did not compute (prefix cache hits plus
  tokens read from decode).
* **eligible** and **fired**: :func:`kvtether.protocol.reuse_verdict`, the router's own rule
  (eligible when ``reusable >= max(threshold, 1)``; fired when eligible and it recomputed less
  than ``max(threshold, block_size)`` of the reusable tokens). An eligible turn that did not
  fire lost KV: a **miss**.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from kvtether.bench._measure import percentile
from kvtether.protocol import reusable_prefix_tokens, reuse_verdict

__all__ = ["StrategyMetrics", "TurnResult", "classify", "same_turn_ratios", "summarize"]


@dataclass
class TurnResult:
    session: str
    turn: int  # 1-based
    stream: bool
    started_s: float
    ttft_s: float | None = None  # streamed turns only
    latency_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    reused_tokens: int = 0
    reusable_tokens: int = 0
    eligible: bool = False
    fired: bool = False
    router_outcome: str | None = None  # the router's X-KVTether-Reuse, where there is one
    output_digest: str | None = None
    diverged: bool | None = None  # against the reference strategy's same turn
    gap_kind: str = "end"
    gap_s: float = 0.0
    error: str | None = None
    # Where the turn's time went, from the router's turn record (P/D strategies): stage ->
    # seconds (protocol.TurnTimings.stages()).
    timings: dict[str, float] | None = None

    @property
    def recomputed_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.reused_tokens)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def classify(result: TurnResult, built: list[int] | None, prompt_ids: list[int], *,
             block_size: int, threshold: int) -> None:
    """Fill ``reusable_tokens``, ``eligible`` and ``fired`` of ``result``."""
    if built is None or not prompt_ids:
        return
    result.reusable_tokens = reusable_prefix_tokens(built, prompt_ids)
    result.eligible, result.fired = reuse_verdict(
        result.reusable_tokens, result.reused_tokens, block_size=block_size,
        recompute_threshold_tokens=threshold)


def _q(values: list[float], q: float) -> float | None:
    return None if not values else round(percentile(values, q), 4)


def streamed_ttfts(turns: list[dict[str, Any]]) -> dict[tuple[str, int], float]:
    """The TTFT of each streamed turn 2+ (the turns the TTFT figures cover), by (session,
    turn), from a results file's turn records."""
    return {(t["session"], t["turn"]): t["ttft_s"] for t in turns
            if t["turn"] > 1 and t["stream"] and t["ttft_s"]}


def same_turn_ratios(turns: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    """Each streamed turn 2+'s TTFT in ``turns`` over the same turn's (session and turn) in
    ``base``: their p50 and p99, and how many turns had a TTFT in both.

    A TTFT p99 over its p50 mixes the spread of the scenario's turn sizes (a long addition
    takes several times a median one, wherever it runs) with the waiting a deployment adds;
    the same turn's ratio keeps the second only."""
    mine, theirs = streamed_ttfts(turns), streamed_ttfts(base)
    ratios = [ttft / theirs[key] for key, ttft in mine.items() if key in theirs]
    return {"turns": len(ratios),
            "p50": round(percentile(ratios, 50), 3) if ratios else None,
            "p99": round(percentile(ratios, 99), 3) if ratios else None}


@dataclass
class StrategyMetrics:
    strategy: str
    turns: int
    failed_turns: int
    not_run_turns: int
    eligible_turns: int
    fired_turns: int
    reuse_rate: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    ttft_turns: int
    latency_p50_s: float | None
    latency_p90_s: float | None
    latency_p99_s: float | None
    prompt_tokens: int
    reused_tokens: int
    recomputed_tokens: int
    recomputed_reusable_tokens: int  # KV earlier turns had built, computed again
    divergent_outputs: int | None
    compared_outputs: int
    router_fired_turns: int | None  # the router's own label, where there is a router
    retained_kv_token_s: float  # wall token-seconds on the sampled instances
    retained_kv_token_s_workload: float  # x compress: token-seconds in workload time
    retained_kv_peak_tokens: float
    wall_s: float
    drain_s: float
    turns_per_s: float
    # Median seconds of each stage over turns 2+ (P/D strategies; TurnTimings.stages()).
    stage_p50_s: dict[str, float] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def kv_token_seconds(samples: list[tuple[float, float]]) -> float:
    """Trapezoid integral of (t, tokens) samples."""
    total = 0.0
    for (t0, v0), (t1, v1) in zip(samples, samples[1:], strict=False):
        total += (t1 - t0) * (v0 + v1) / 2
    return total


def summarize(
    strategy: str, turns: list[TurnResult], kv: list[tuple[float, float]], *, wall_s: float,
    drain_s: float, compress: float, not_run: int,
) -> StrategyMetrics:
    ok = [t for t in turns if t.error is None]
    later = [t for t in ok if t.turn >= 2]
    eligible = [t for t in later if t.eligible]
    fired = [t for t in eligible if t.fired]
    ttft = [t.ttft_s for t in later if t.ttft_s is not None]
    latency = [t.latency_s for t in later if t.latency_s is not None]
    compared = [t for t in ok if t.diverged is not None]
    routed = [t for t in ok if t.router_outcome is not None]
    token_s = kv_token_seconds(kv)
    return StrategyMetrics(
        strategy=strategy,
        turns=len(turns),
        failed_turns=len(turns) - len(ok),
        not_run_turns=not_run,
        eligible_turns=len(eligible),
        fired_turns=len(fired),
        reuse_rate=round(len(fired) / len(eligible), 4) if eligible else None,
        ttft_p50_s=_q(ttft, 50), ttft_p90_s=_q(ttft, 90), ttft_p99_s=_q(ttft, 99),
        ttft_turns=len(ttft),
        latency_p50_s=_q(latency, 50), latency_p90_s=_q(latency, 90),
        latency_p99_s=_q(latency, 99),
        prompt_tokens=sum(t.prompt_tokens for t in ok),
        reused_tokens=sum(t.reused_tokens for t in ok),
        recomputed_tokens=sum(t.recomputed_tokens for t in ok),
        recomputed_reusable_tokens=sum(max(0, t.reusable_tokens - t.reused_tokens) for t in ok),
        divergent_outputs=sum(bool(t.diverged) for t in compared) if compared else None,
        compared_outputs=len(compared),
        router_fired_turns=(
            sum(t.router_outcome == "fired" for t in routed if t.turn >= 2) if routed else None
        ),
        retained_kv_token_s=round(token_s, 1),
        retained_kv_token_s_workload=round(token_s * compress, 1),
        retained_kv_peak_tokens=max((v for _, v in kv), default=0.0),
        wall_s=round(wall_s, 2),
        drain_s=round(drain_s, 2),
        turns_per_s=round(len(ok) / wall_s, 4) if wall_s > 0 else math.nan,
        stage_p50_s=_stage_medians(later),
    )


def _stage_medians(turns: list[TurnResult]) -> dict[str, float] | None:
    stages: dict[str, list[float]] = {}
    for t in turns:
        for name, seconds in (t.timings or {}).items():
            stages.setdefault(name, []).append(seconds)
    return {name: _q(v, 50) for name, v in stages.items()} or None  # type: ignore[misc]


def mark_divergence(reference: list[TurnResult], others: list[TurnResult]) -> None:
    """Compare each turn's output with the reference's same (session, turn); both must have run.

    Greedy decoding on identical prompts gives identical tokens when the KV is right; after a
    divergence the prompts differ too, so later turns of that session are compared as well
    (they are counted, but the first divergence is the finding).
    """
    ref = {(t.session, t.turn): t.output_digest for t in reference if t.error is None}
    for t in others:
        if t.error is None and (t.session, t.turn) in ref:
            t.diverged = t.output_digest != ref[(t.session, t.turn)]
