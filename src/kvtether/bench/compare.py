"""`kvtether bench` (``compare``): replay agent sessions against every strategy, side by side.

One scenario (generated from a seed, or read from a file), one time-compression factor, the
strategies one after the other on this host, each started fresh and stopped before the next
(also on errors and Ctrl-C). ``colocated`` runs first: its greedy outputs are the reference
the others are compared with. Writes ``results.json``, ``results.md`` and three plots to
``--out``, and prints the table. With ``--concurrency`` it runs the concurrency sweep instead
(:mod:`kvtether.bench.sweep`). The runs themselves are :mod:`kvtether.bench.runner`'s.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtether.bench import report, sweep
from kvtether.bench.runner import (
    StartStrategy,
    check_levels,
    replay_scenario,
    run_meta,
    strategy_options,
)
from kvtether.bench.runner import run_compare as run
from kvtether.bench.scenario import Scenario, ScenarioError, generate_scenario, load_scenario
from kvtether.bench.strategies import FIXED_TTL_S, STRATEGIES, start_strategy

# The run core's names stay importable from here, where the bench's library users found them.
__all__ = ["StartStrategy", "build_parser", "check_levels", "generate_main", "main",
           "replay_scenario", "run", "run_meta", "strategy_options"]

logger = logging.getLogger(__name__)


def _scenario_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("generated scenario (when --scenario is not given)")
    g.add_argument("--sessions", type=int, default=None,
                   help="agent sessions (default 8; with --concurrency: the highest level)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--turns", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="model calls per session (default 4 8; with --concurrency: 4 6)")
    g.add_argument("--context-tokens", type=int, default=2048,
                   help="sessions end at 75-100%% of this many prompt tokens (default 2048)")
    g.add_argument("--system-tokens", type=int, default=600,
                   help="shared system prompt + tool schemas (default 600)")
    g.add_argument("--max-output-tokens", type=int, default=128)
    g.add_argument("--long-tools", type=int, default=None,
                   help="tool calls drawn from the far tail, 540-900 s (default 2; with "
                   "--concurrency: 0)")
    g.add_argument("--stream-fraction", type=float, default=0.5,
                   help="share of sessions that stream (default 0.5)")
    g.add_argument("--arrival-s", type=float, default=60.0,
                   help="mean workload seconds between session starts (default 60; "
                   "--concurrency ignores it)")


def _scenario_defaults(args: argparse.Namespace, levels: Sequence[int] | None) -> None:
    """Fill the generated scenario's size where no flag set it: a sweep (``levels``) gets
    one session per slot of its highest level, shorter sessions and no far-tail tools, which
    at level 1 would run back to back (a sweep measures load, not TTL handling)."""
    if args.sessions is None:
        args.sessions = max(levels) if levels else 8
    if args.turns is None:
        args.turns = (4, 6) if levels else (4, 8)
    if args.long_tools is None:
        args.long_tools = 0 if levels else 2


def _generate(args: argparse.Namespace) -> Scenario:
    return generate_scenario(
        args.sessions, seed=args.seed, turns=tuple(args.turns),
        context_tokens=args.context_tokens, system_tokens=args.system_tokens,
        max_output_tokens=args.max_output_tokens, long_tools=args.long_tools,
        stream_fraction=args.stream_fraction, arrival_s=args.arrival_s,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtether bench",
        description="Replay agent sessions against colocated vLLM (one engine on the P/D "
        "stack's cores, one on one instance's, replicas behind vllm-router), P/D one-way, P/D "
        "bidirectional as upstream ships it, and kvtether; compare reuse, TTFT, recomputed "
        "tokens, retained KV, output identity. Other benchmarks: `kvtether bench idle`, "
        "`kvtether bench generate` (write a scenario file).",
    )
    parser.add_argument("--scenario", type=Path, default=None,
                        help="scenario file (kvtether JSON, or vLLM benchmarks/multi_turn "
                        "conversations); default: generate one")
    parser.add_argument("--strategies", nargs="+", choices=list(STRATEGIES),
                        default=list(STRATEGIES),
                        help="run in the order given; default: all, in this order ("
                        "colocated first: its outputs are the reference)")
    parser.add_argument("--profile", default="cpu-bench",
                        help="stack profile (default cpu-bench: SmolLM2 at 2-4K contexts; "
                        "cpu-tiny for a quick run, gpu on a GPU box)")
    parser.add_argument("--compress", type=float, default=16.0,
                        help="time compression: every duration and TTL divided by this "
                        "(default 16: the 480 s fixed TTL lasts 30 s)")
    parser.add_argument("--prefill-cache", action=argparse.BooleanOptionalAction,
                        default=False,
                        help="prefix cache on the P/D prefill instance (default off: a "
                        "prefill pool whose cache does not hold the conversation)")
    parser.add_argument("--baseline-connector", choices=("kvtether", "nixl"), default="kvtether",
                        help="connector the P/D baselines run on (default kvtether: the same "
                        "engine for every strategy, the router applies each baseline's reuse "
                        "rules; nixl: vLLM's own, which busy-polls on CPU hosts)")
    parser.add_argument("--max-retained-tokens", type=int, default=None,
                        help="kvtether budget per decode instance (default: none)")
    parser.add_argument("--think-s", type=float, default=60.0,
                        help="gap between turns of a vLLM multi-turn file (workload seconds)")
    parser.add_argument("--port", type=int, default=8800,
                        help="router port; instances above it (default 8800)")
    parser.add_argument("--turn-timeout-s", type=float, default=900.0)
    parser.add_argument("--state-dir", type=Path, default=Path(".kvtether/bench"))
    parser.add_argument("--out", type=Path, default=None,
                        help="results directory (default .kvtether/bench/results-<time>; "
                        "with --concurrency: sweep-<time>)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=None, metavar="N",
        help="concurrency sweep: replay the scenario once per level N, in the order given, "
        "on each strategy (started once), at most N sessions at a time, each starting as soon "
        "as a slot is free (arrival times ignored, tool and think gaps kept); writes "
        "sweep.json, sweep.md and sweep.png. A generated scenario then defaults to as many "
        "sessions as the highest level, --turns 4 6 and --long-tools 0 (far-tail tools would "
        "run back to back at level 1), sized for `--strategies colocated kvtether "
        "--concurrency 1 4 16` to finish in about half an hour on a 2-core CPU host")
    _scenario_args(parser)
    return parser


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    meta = result["run"]
    table = Table(title=f"kvtether bench — {meta['scenario']['name']}, profile "
                  f"{meta['profile']}, time compression {meta['compress']:g}x")
    for col in ("strategy", "reuse", "TTFT p50/p99 s", "TPOT p50/p99 ms", "core-s/turn",
                "recomputed", "KV token-s", "divergent", "failed"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for name, m in result["summary"].items():
        table.add_row(
            name, f"{m['fired_turns']}/{m['eligible_turns']}",
            f"{report.fmt(m['ttft_p50_s'], 2)}/{report.fmt(m['ttft_p99_s'], 2)}",
            f"{report.fmt_ms(m['tpot_p50_s'])}/{report.fmt_ms(m['tpot_p99_s'])}",
            report.fmt(m["core_s_per_turn"], 2),
            str(m["recomputed_tokens"]), f"{m['retained_kv_token_s_workload']:.0f}",
            "ref" if name == meta["reference"] else report.fmt(m["divergent_outputs"]),
            str(m["failed_turns"]),
        )
    console = Console()
    console.print(table)
    for row in result["targets"]:
        met = "-" if row["met"] is None else ("met" if row["met"] else "MISSED")
        console.print(f"  {row['target']}: {row['measured']} (goal {row['goal']}) {met}")


def main(argv: list[str] | None = None, *, start: StartStrategy = start_strategy) -> int:
    """``kvtether bench``; ``start`` starts each strategy's servers (tests pass fakes)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compress <= 0:
        parser.error("--compress must be > 0")
    levels = args.concurrency
    if levels is not None:
        check_levels(parser, levels)
    _scenario_defaults(args, levels)
    if args.sessions < 1:
        parser.error("--sessions must be at least 1")
    try:
        scenario = (load_scenario(args.scenario, think_s=args.think_s)
                    if args.scenario else _generate(args))
    except (ScenarioError, ValueError) as exc:
        parser.error(str(exc))
    command = "kvtether bench " + shlex.join(argv)
    if levels is not None:
        out = args.out or args.state_dir / f"sweep-{datetime.datetime.now():%Y%m%d-%H%M%S}"
        scenario.save(out / "scenario.json")
        paths = sweep.sweep_main(args, scenario, command, levels, out, start=start)
        print("results: " + ", ".join(str(p) for p in [out / "scenario.json", *paths]))
        return 0
    out = args.out or args.state_dir / f"results-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    result = run(args, scenario, command, start=start)
    scenario.save(out / "scenario.json")
    paths = report.write_results(result, out)
    if not args.no_plots:
        paths += report.write_plots(result, out)
    _print_table(result)
    print("results: " + ", ".join(str(p) for p in paths))
    return 0


def generate_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvtether bench generate",
        description="Write a seeded agent-session scenario file for `kvtether bench --scenario`.",
    )
    parser.add_argument("--out", type=Path, required=True, help="scenario file to write")
    _scenario_args(parser)
    args = parser.parse_args(argv)
    _scenario_defaults(args, None)
    try:
        scenario = _generate(args)
    except ValueError as exc:
        parser.error(str(exc))
    scenario.save(args.out)
    print(f"{args.out}: " + ", ".join(f"{k} {v}" for k, v in
                                      scenario.summary(FIXED_TTL_S).items()))
    return 0
