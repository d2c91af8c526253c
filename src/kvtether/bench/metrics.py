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

Beside reuse, per strategy: TTFT, TPOT and inter-token gaps of streamed turns 2+, prompt tokens
computed, KV moved between the instances and the time its reads took (P/D strategies), and the
CPU time of the strategy's processes per completed turn (:func:`summarize`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from kvtether.bench._measure import percentile
from kvtether.protocol import reusable_prefix_tokens, reuse_verdict

__all__ = ["StrategyMetrics", "TurnResult", "classify", "same_turn_ratios", "summarize",
           "summarize_replay"]


@dataclass
class TurnResult:
    session: str
    turn: int  # 1-based
    stream: bool
    started_s: float
    ttft_s: float | None = None  # streamed turns only
    latency_s: float | None = None
    # Streamed turns: seconds per output token after the first, and the gap before each chunk
    # that carried tokens after the first one (replay.token_times). The gaps stay out of the
    # results file (as_dict keeps only the longest, itl_max_s): every token of every turn.
    tpot_s: float | None = None
    itl_s: list[float] | None = field(default=None, repr=False)
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

    @property
    def prefill_read_tokens(self) -> int:
        """Tokens prefill read from decode's retained KV (D->P): the turn's reused tokens,
        when the router's record shows prefill reading (its ``prefill_read`` stage)."""
        return self.reused_tokens if "prefill_read" in (self.timings or {}) else 0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        gaps = out.pop("itl_s")
        out["itl_max_s"] = max(gaps) if gaps else None
        return out


def classify(result: TurnResult, built: list[int] | None, prompt_ids: list[int], *,
             block_size: int, threshold: int) -> None:
    """Fill ``reusable_tokens``, ``eligible`` and ``fired`` of ``result``."""
    if built is None or not prompt_ids:
        return
    result.reusable_tokens = reusable_prefix_tokens(built, prompt_ids)
    result.eligible, result.fired = reuse_verdict(
        result.reusable_tokens, result.reused_tokens, block_size=block_size,
        recompute_threshold_tokens=threshold)


def _q(values: list[float], q: float, digits: int = 4) -> float | None:
    return None if not values else round(percentile(values, q), digits)


def streamed_ttfts(turns: list[dict[str, Any]], key: str = "ttft_s"
                   ) -> dict[tuple[str, int], float]:
    """The TTFT (or ``key``: ``tpot_s``) of each streamed turn 2+ (the turns the TTFT and TPOT
    figures cover), by (session, turn), from a results file's turn records."""
    return {(t["session"], t["turn"]): t[key] for t in turns
            if t["turn"] > 1 and t["stream"] and t.get(key)}


def same_turn_ratios(turns: list[dict[str, Any]], base: list[dict[str, Any]],
                     key: str = "ttft_s") -> dict[str, Any]:
    """Each streamed turn 2+'s TTFT (or ``key``: ``tpot_s``) in ``turns`` over the same turn's
    (session and turn) in ``base``: their p50 and p99, and how many turns had one in both.

    A TTFT p99 over its p50 mixes the spread of the scenario's turn sizes (a long addition
    takes several times a median one, wherever it runs) with the waiting a deployment adds;
    the same turn's ratio keeps the second only."""
    mine, theirs = streamed_ttfts(turns, key), streamed_ttfts(base, key)
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
    # Streamed turns 2+: seconds per output token after the first, per turn; and every gap
    # between token-carrying chunks of those turns, pooled.
    tpot_p50_s: float | None = None
    tpot_p99_s: float | None = None
    tpot_turns: int = 0
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    # Prompt tokens computed (recomputed_tokens is the total over every turn): the mean over
    # completed turns 2+.
    recomputed_per_turn_tokens: float | None = None
    # KV moved between the instances (P/D strategies). P->D: decode reading each turn's KV
    # from prefill, from the decode instances' NIXL metrics (vllm:nixl_bytes_transferred);
    # D->P: prefill reading decode's retained KV on reuse, from the prefill instances' NIXL
    # metrics where the replay read them, else the tokens read (TurnResult.prefill_read_tokens)
    # x kv_bytes_per_token (kv_d2p_source: "nixl" / "tokens"). Per turn: over completed turns.
    kv_bytes_per_token: int | None = None
    kv_p2d_bytes: int | None = None
    kv_p2d_bytes_per_turn: float | None = None
    kv_d2p_bytes: int | None = None
    kv_d2p_bytes_per_turn: float | None = None
    kv_d2p_source: str | None = None
    # Read times, medians over the turns that read (all turns; the connectors' EngineTimings
    # read_s: decode_read P->D, prefill_read D->P), and NIXL's own per-transfer p50 on decode.
    kv_p2d_read_p50_s: float | None = None
    kv_d2p_read_p50_s: float | None = None
    kv_xfer_p50_s: float | None = None
    # CPU seconds (user + system) of every process the strategy started, while the sessions
    # ran, per completed turn; and in the drain after them (held KV waiting to go).
    core_s: float | None = None
    core_s_per_turn: float | None = None
    drain_core_s: float | None = None

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
    drain_s: float, compress: float, not_run: int, core_s: float | None = None,
    drain_core_s: float | None = None, nixl: dict[str, dict[str, Any]] | None = None,
    kv_bytes_per_token: int | None = None,
) -> StrategyMetrics:
    """One strategy's figures from its turns and retained-KV samples; ``core_s``,
    ``drain_core_s``, ``nixl`` and ``kv_bytes_per_token`` as in
    :class:`~kvtether.bench.replay.ReplayResult` (:func:`summarize_replay` passes them)."""
    ok = [t for t in turns if t.error is None]
    later = [t for t in ok if t.turn >= 2]
    eligible = [t for t in later if t.eligible]
    fired = [t for t in eligible if t.fired]
    ttft = [t.ttft_s for t in later if t.ttft_s is not None]
    tpot = [t.tpot_s for t in later if t.tpot_s is not None]
    gaps = [g for t in later for g in (t.itl_s or [])]
    latency = [t.latency_s for t in later if t.latency_s is not None]
    compared = [t for t in ok if t.diverged is not None]
    routed = [t for t in ok if t.router_outcome is not None]
    token_s = kv_token_seconds(kv)
    moved = _kv_moved(ok, nixl or {}, kv_bytes_per_token)
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
        tpot_p50_s=_q(tpot, 50, 5), tpot_p99_s=_q(tpot, 99, 5), tpot_turns=len(tpot),
        itl_p50_s=_q(gaps, 50, 5), itl_p99_s=_q(gaps, 99, 5),
        recomputed_per_turn_tokens=(
            round(sum(t.recomputed_tokens for t in later) / len(later), 1) if later else None),
        kv_bytes_per_token=kv_bytes_per_token,
        **moved,
        core_s=core_s,
        core_s_per_turn=round(core_s / len(ok), 3) if core_s is not None and ok else None,
        drain_core_s=drain_core_s,
    )


class _KVSample(Protocol):
    @property
    def t_s(self) -> float: ...
    @property
    def tokens(self) -> float: ...


class Replayed(Protocol):
    """What :func:`summarize_replay` reads of a replay: a
    :class:`~kvtether.bench.replay.ReplayResult` (the replay builds on this module, so this
    module names the fields it reads instead of importing it)."""

    @property
    def turns(self) -> list[TurnResult]: ...
    @property
    def kv(self) -> Sequence[_KVSample]: ...
    @property
    def wall_s(self) -> float: ...
    @property
    def drain_s(self) -> float: ...
    @property
    def not_run(self) -> int: ...
    @property
    def core_s(self) -> float | None: ...
    @property
    def drain_core_s(self) -> float | None: ...
    @property
    def nixl(self) -> dict[str, dict[str, Any]]: ...
    @property
    def kv_bytes_per_token(self) -> int | None: ...


def summarize_replay(strategy: str, replayed: Replayed, *, compress: float
                     ) -> StrategyMetrics:
    """:func:`summarize` of one replay, with everything it measured."""
    return summarize(
        strategy, replayed.turns, [(s.t_s, s.tokens) for s in replayed.kv],
        wall_s=replayed.wall_s, drain_s=replayed.drain_s, compress=compress,
        not_run=replayed.not_run, core_s=replayed.core_s, drain_core_s=replayed.drain_core_s,
        nixl=replayed.nixl, kv_bytes_per_token=replayed.kv_bytes_per_token)


# TurnTimings.stages() of the connectors inside vLLM (EngineTimings), not the router's.
_ENGINE_STAGES = frozenset(f"{leg}_{k}" for leg in ("prefill", "decode")
                           for k in ("queue", "read", "engine"))


def _kv_moved(ok: list[TurnResult], nixl: dict[str, dict[str, Any]],
              bytes_per_token: int | None) -> dict[str, Any]:
    """The KV-transfer fields of :class:`StrategyMetrics` (see there); none for a strategy
    with neither a router's turn timings nor NIXL figures (nothing moved between instances)."""
    timed = [t for t in ok if t.timings]
    if not timed and not nixl:
        return {}

    def per_turn(total: int | None) -> float | None:
        return None if total is None or not ok else round(total / len(ok), 1)

    p2d = nixl.get("decode", {}).get("bytes")
    d2p, source = nixl.get("prefill", {}).get("bytes"), "nixl"
    # The estimate needs the connectors' timings, which say which turns prefill read on
    # (vLLM's own NixlConnector reports none).
    connector_timed = any(k in _ENGINE_STAGES for t in timed for k in t.timings or {})
    if d2p is None and bytes_per_token is not None and connector_timed:
        d2p, source = sum(t.prefill_read_tokens for t in ok) * bytes_per_token, "tokens"
    reads = {leg: [stages[f"{leg}_read"] for stages in (t.timings or {} for t in timed)
                   if f"{leg}_read" in stages] for leg in ("decode", "prefill")}
    return {
        "kv_p2d_bytes": p2d, "kv_p2d_bytes_per_turn": per_turn(p2d),
        "kv_d2p_bytes": d2p, "kv_d2p_bytes_per_turn": per_turn(d2p),
        "kv_d2p_source": source if d2p is not None else None,
        "kv_p2d_read_p50_s": _q(reads["decode"], 50),
        "kv_d2p_read_p50_s": _q(reads["prefill"], 50),
        "kv_xfer_p50_s": nixl.get("decode", {}).get("xfer_p50_s"),
    }


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
