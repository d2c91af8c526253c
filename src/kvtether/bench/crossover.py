"""`kvtether bench crossover`: where P/D + kvtether beats a colocated vLLM on this host.

A grid of context length x concurrency. Each strategy is started once; for every context length
a seeded coding-agent scenario is generated (as many sessions as the highest concurrency, every
turn streamed, sessions ending at 75-100% of that length, a quarter of it system prompt), and
replayed once per concurrency level (at most N sessions at a time, each starting as soon as a
slot is free; tool and think gaps kept). Every cell has its own system prompt and conversation
ids, so no cell is served KV or prefix cache that an earlier cell left behind.

Per cell and strategy: turn 2+ TTFT p50, TPOT p50, turns/s, reuse and divergent outputs (against
``colocated`` in the same cell). The verdict of a cell compares kvtether with the better of the
colocated baselines that ran (``colocated``, ``colocated-dp``): its TTFT p50 ratio and its
throughput ratio. Writes ``crossover.json``, ``crossover.md`` and ``crossover.png``; the same
command, run on a GPU host with ``--profile gpu``, answers the question there.
"""

from __future__ import annotations

import argparse
import datetime
import math
import shlex
import sys
import uuid
from pathlib import Path
from typing import Any

from kvtether.bench import report
from kvtether.bench.metrics import summarize_replay
from kvtether.bench.runner import (
    REFERENCE,
    Replay,
    StartStrategy,
    check_levels,
    mark_divergences,
    replay_each_strategy,
    run_meta,
)
from kvtether.bench.scenario import Scenario, generate_scenario
from kvtether.bench.strategies import STRATEGIES, start_strategy

__all__ = ["build_parser", "cell_scenario", "main", "run_crossover", "verdicts"]

BASELINES = ("colocated", "colocated-dp")
DEFAULT_STRATEGIES = ("colocated", "colocated-dp", "kvtether")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtether bench crossover",
        description="Context length x concurrency grid: where P/D + kvtether beats a colocated "
        "vLLM (all the cores the P/D stack uses) and N colocated replicas behind vllm-router, "
        "on this host. Writes crossover.json, crossover.md and crossover.png.",
    )
    parser.add_argument("--context-tokens", type=int, nargs="+", default=[4096, 16384, 32768],
                        metavar="TOKENS",
                        help="context lengths: sessions end at 75-100%% of each "
                        "(default 4096 16384 32768)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4], metavar="N",
                        help="sessions at a time (default 1 4)")
    parser.add_argument("--strategies", nargs="+", default=[
        s for s in DEFAULT_STRATEGIES if s in STRATEGIES], choices=list(STRATEGIES),
        help="default: colocated colocated-dp kvtether")
    parser.add_argument("--profile", default="cpu-agents",
                        help="stack profile (default cpu-agents: 64K context on CPU; gpu on a "
                        "GPU host)")
    parser.add_argument("--sessions", type=int, default=None,
                        help="sessions per context length (default: the highest concurrency)")
    parser.add_argument("--turns", type=int, nargs=2, default=(4, 6), metavar=("MIN", "MAX"),
                        help="model calls per session (default 4 6)")
    parser.add_argument("--system-share", type=float, default=0.25,
                        help="share of each context length that is system prompt and tool "
                        "schemas (default 0.25)")
    parser.add_argument("--max-output-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compress", type=float, default=16.0,
                        help="time compression of tool and think gaps (default 16)")
    parser.add_argument("--prefill-cache", action=argparse.BooleanOptionalAction,
                        default=False, help="prefix cache on the P/D prefill instance")
    parser.add_argument("--port", type=int, default=8800)
    parser.add_argument("--turn-timeout-s", type=float, default=900.0)
    parser.add_argument("--state-dir", type=Path, default=Path(".kvtether/bench"))
    parser.add_argument("--out", type=Path, default=None,
                        help="results directory (default .kvtether/bench/crossover-<time>)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plot")
    return parser


def _options(args: argparse.Namespace) -> argparse.Namespace:
    """The namespace the run core reads (strategy options, replay options)."""
    return argparse.Namespace(
        **vars(args), max_retained_tokens=None, baseline_connector="kvtether")


def cell_scenario(args: argparse.Namespace, context_tokens: int) -> Scenario:
    """The scenario of one context length: seeded, streamed, no far-tail tools."""
    sessions = args.sessions or max(args.concurrency)
    return generate_scenario(
        sessions, seed=args.seed, turns=tuple(args.turns), context_tokens=context_tokens,
        system_tokens=max(64, round(context_tokens * args.system_share)),
        max_output_tokens=args.max_output_tokens, long_tools=0, stream_fraction=1.0,
        arrival_s=0.0, name=f"crossover-{context_tokens}",
    )


def run_crossover(args: argparse.Namespace, command: str, *,
                  start: StartStrategy = start_strategy) -> dict[str, Any]:
    """Replay every cell on every strategy; returns ``run``, ``rows`` (one summary per cell
    and strategy), ``verdicts`` (:func:`verdicts`) and ``detail`` (every turn)."""
    opts_ns = _options(args)
    run_id = uuid.uuid4().hex[:8]
    scenarios = {length: cell_scenario(args, length) for length in args.context_tokens}
    cells = {
        (length, level): Replay(
            scenarios[length].under_own_prompt(f"Cell {length} {level}"),
            f"{run_id}-{length}-{level}", level, f"{length} tokens, {level} at once")
        for length in args.context_tokens for level in args.concurrency}
    results, _ = replay_each_strategy(opts_ns, cells, start=start, label_width=34)
    reference = REFERENCE if REFERENCE in args.strategies else None
    rows: list[dict[str, Any]] = []
    detail: dict[str, dict[str, Any]] = {}
    for (length, level), by_name in results.items():
        mark_divergences(by_name, reference)
        for name, replayed in by_name.items():
            m = summarize_replay(name, replayed, compress=args.compress)
            rows.append({"context_tokens": length, "concurrency": level, **m.as_dict()})
            detail.setdefault(f"{length}x{level}", {})[name] = [
                t.as_dict() for t in replayed.turns]
    first = scenarios[args.context_tokens[0]]
    meta = run_meta(opts_ns, first, command, reference)
    meta.pop("scenario_summary", None)
    meta["scenario"] = {"name": "crossover", "source": {
        length: s.source for length, s in scenarios.items()}}
    meta.update(context_tokens=list(args.context_tokens), concurrency=list(args.concurrency),
                strategies=list(args.strategies))
    return {"run": meta, "rows": rows, "verdicts": verdicts(rows), "detail": detail}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell: kvtether against the better colocated baseline that ran (lower turn 2+ TTFT
    p50). ``ttft_ratio`` < 1 and ``throughput_ratio`` > 1 favour kvtether; ``wins`` is True
    when both do, False when neither does, None when they disagree or a figure is missing."""
    cells: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for row in rows:
        cells.setdefault((row["context_tokens"], row["concurrency"]), {})[row["strategy"]] = row
    out: list[dict[str, Any]] = []
    for (length, level), by_name in sorted(cells.items()):
        k = by_name.get("kvtether")
        baselines = [by_name[b] for b in BASELINES if b in by_name
                     and by_name[b].get("ttft_p50_s") is not None]
        if k is None or not baselines:
            continue
        best = min(baselines, key=lambda r: r["ttft_p50_s"])
        ttft = _ratio(k.get("ttft_p50_s"), best["ttft_p50_s"])
        rate = _ratio(k.get("turns_per_s"), best.get("turns_per_s"))
        tpot = _ratio(k.get("tpot_p50_s"), best.get("tpot_p50_s"))
        wins = None
        if ttft is not None and rate is not None:
            wins = True if ttft < 1 and rate > 1 else False if ttft >= 1 and rate <= 1 else None
        out.append({"context_tokens": length, "concurrency": level, "against": best["strategy"],
                    "ttft_ratio": ttft, "tpot_ratio": tpot, "throughput_ratio": rate,
                    "wins": wins})
    return out


def _fmt(v: Any, digits: int = 2) -> str:
    return report.fmt(v, digits)


def render_markdown(result: dict[str, Any]) -> str:
    meta = result["run"]
    names = meta["strategies"]
    lines = [f"# kvtether bench crossover — profile {meta['profile']}", "",
             f"- command: `{meta['command']}`", f"- date: {meta['date']}",
             f"- host: {meta['host']}", f"- time compression: {meta['compress']:g}x", "",
             "Turn 2+ TTFT p50 in seconds (TPOT p50 in ms) per strategy; kvtether's ratio to "
             "the better colocated baseline in the cell (TTFT below 1 and throughput above 1 "
             "favour kvtether).", "",
             "| context | at once | " + " | ".join(names)
             + " | kvtether TTFT ratio | throughput ratio | verdict |",
             "|---:|---:|" + "---:|" * len(names) + "---:|---:|---|"]
    by_cell: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for row in result["rows"]:
        by_cell.setdefault((row["context_tokens"], row["concurrency"]), {})[row["strategy"]] = row
    verdict = {(v["context_tokens"], v["concurrency"]): v for v in result["verdicts"]}
    for cell in sorted(by_cell):
        by_name = by_cell[cell]
        figures = []
        for name in names:
            row = by_name.get(name)
            if row is None:
                figures.append("-")
                continue
            tpot = row.get("tpot_p50_s")
            tpot_ms = None if tpot is None else tpot * 1000
            figures.append(f"{_fmt(row['ttft_p50_s'])} ({_fmt(tpot_ms, 0)})")
        v = verdict.get(cell, {})
        word = {True: "kvtether", False: v.get("against", "-"), None: "mixed"}[v.get("wins")]
        lines.append(f"| {cell[0]} | {cell[1]} | " + " | ".join(figures)
                     + f" | {_fmt(v.get('ttft_ratio'))} | {_fmt(v.get('throughput_ratio'))} "
                     f"| {word if v else '-'} |")
    lines += ["", "Reuse (fired / eligible turns) and divergent outputs against colocated:", ""]
    for row in result["rows"]:
        if row["strategy"] == "kvtether":
            lines.append(f"- {row['context_tokens']} tokens, {row['concurrency']} at once: "
                         f"reuse {row['fired_turns']}/{row['eligible_turns']}, divergent "
                         f"{_fmt(row['divergent_outputs'], 0)}, failed {row['failed_turns']}")
    return "\n".join(lines) + "\n"


def write_plot(result: dict[str, Any], out: Path) -> list[Path]:
    """crossover.png: kvtether's TTFT and throughput ratios to the better colocated baseline
    against the context length, one line per concurrency; [] without matplotlib."""
    plt = report.pyplot()
    if plt is None or not result["verdicts"]:
        return []
    out.mkdir(parents=True, exist_ok=True)
    fig, (ttft, rate) = plt.subplots(1, 2, figsize=(11, 4))
    levels = sorted({v["concurrency"] for v in result["verdicts"]})
    for level in levels:
        vs = sorted((v for v in result["verdicts"] if v["concurrency"] == level),
                    key=lambda v: v["context_tokens"])
        xs = [v["context_tokens"] for v in vs]
        ttft.plot(xs, [math.nan if v["ttft_ratio"] is None else v["ttft_ratio"] for v in vs],
                  marker="o", label=f"{level} at once")
        rate.plot(xs, [math.nan if v["throughput_ratio"] is None else v["throughput_ratio"]
                       for v in vs], marker="o", label=f"{level} at once")
    ttft.set(ylabel="kvtether / best colocated, TTFT p50 turns 2+",
             title="TTFT ratio (below 1: kvtether faster)")
    rate.set(ylabel="kvtether / best colocated, turns/s",
             title="Throughput ratio (above 1: kvtether more)")
    lengths = sorted({v["context_tokens"] for v in result["verdicts"]})
    ttft.set_yscale("log")  # ratios from a fraction to tens: even lies in the middle
    for ax in (ttft, rate):
        ax.axhline(1.0, color="grey", linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{n // 1024} K" for n in lengths])
        ax.minorticks_off()
        ax.set_xlabel("context length (tokens)")
    fig.tight_layout()
    return [report.save_plot(plt, fig, [ttft, rate], out / "crossover.png")]


def main(argv: list[str] | None = None, *, start: StartStrategy = start_strategy) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compress <= 0:
        parser.error("--compress must be > 0")
    check_levels(parser, args.concurrency)
    if any(n < 512 for n in args.context_tokens):
        parser.error("--context-tokens must be at least 512 each")
    if not 0 < args.system_share < 0.9:
        parser.error("--system-share must be between 0 and 0.9")
    if "kvtether" not in args.strategies or not set(BASELINES) & set(args.strategies):
        parser.error("--strategies needs kvtether and colocated or colocated-dp")
    out = args.out or args.state_dir / f"crossover-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    result = run_crossover(args, "kvtether bench crossover " + shlex.join(argv), start=start)
    paths = report.write_files(result, out, "crossover", render_markdown)
    if not args.no_plots:
        paths += write_plot(result, out)
    print(render_markdown(result))
    print("results: " + ", ".join(str(p) for p in paths))
    return 0
