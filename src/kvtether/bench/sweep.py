"""`kvtether bench --concurrency N [N ...]`: one scenario at several concurrency levels.

Each strategy is started once, as in the plain bench, and the scenario is replayed on it once per
level, in the order given: at level N at most N sessions run at a time, each starting as soon as
a slot is free, in scenario order (arrival times ignored; tool and think gaps kept). Every level
has its own conversation ids, so no level reads KV that an earlier one left behind. Per level and
strategy the figures are :func:`~kvtether.bench.metrics.summarize_replay`'s, with outputs compared
to ``colocated``'s at the same level. With level 1 in the sweep, each streamed turn 2+'s TTFT is
also divided by the same turn's at level 1 on the same strategy (:func:`ttft_vs_alone`): what a
level adds to each turn, apart from the spread of turn sizes the scenario has alone. Writes
``sweep.json``, ``sweep.md`` and ``sweep.png`` (:mod:`kvtether.bench.report`) and prints the
table.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtether.bench import report
from kvtether.bench.compare import (
    StartStrategy,
    replay_scenario,
    run_meta,
    strategy_options,
)
from kvtether.bench.metrics import mark_divergence, same_turn_ratios, summarize_replay
from kvtether.bench.scenario import Scenario
from kvtether.bench.strategies import STRATEGIES, start_strategy

if TYPE_CHECKING:
    from kvtether.bench.replay import ReplayResult

__all__ = ["print_sweep_table", "run_sweep", "sweep_main", "ttft_ratios", "ttft_vs_alone"]

logger = logging.getLogger(__name__)

REFERENCE = "colocated"


def run_sweep(args: argparse.Namespace, scenario: Scenario, command: str,
              levels: Sequence[int], *, start: StartStrategy = start_strategy
              ) -> dict[str, Any]:
    """Replay ``scenario`` at every level on every strategy of ``args.strategies``.

    Returns ``run`` (how the sweep was made), ``rows`` (one summary per level and strategy,
    levels in the order given), ``ttft_p50_ratios`` (kvtether / colocated, per level),
    ``ttft_vs_alone`` (:func:`ttft_vs_alone`) and ``detail`` (per level, per strategy: every
    turn and the retained-KV samples).
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    opts = strategy_options(args)
    run_id = uuid.uuid4().hex[:8]
    replays: dict[int, dict[str, ReplayResult]] = {level: {} for level in levels}
    columns = (TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("turns"), TimeElapsedColumn())
    with Progress(*columns) as progress:
        tasks = {name: progress.add_task(f"{name}: waiting", total=scenario.turns * len(levels))
                 for name in args.strategies}
        for name in args.strategies:
            strategy = STRATEGIES[name]
            task = tasks[name]
            progress.update(task, description=f"{name}: starting")
            with start(strategy, opts) as endpoints:
                for level in levels:
                    progress.update(task, description=f"{name}: {level} at a time")
                    replays[level][name] = asyncio.run(replay_scenario(
                        at_level(scenario, level), endpoints, strategy, args,
                        f"{run_id}-c{level}",
                        functools.partial(progress.advance, task), concurrency=level))
            progress.update(task, description=f"{name}: done")

    reference = REFERENCE if REFERENCE in args.strategies else None
    rows: list[dict[str, Any]] = []
    detail: dict[str, dict[str, Any]] = {}
    for level in levels:
        by_name = replays[level]
        if reference:
            for name, replayed in by_name.items():
                if name != reference:
                    mark_divergence(by_name[reference].turns, replayed.turns)
        for name, replayed in by_name.items():
            kv = [(s.t_s, s.tokens) for s in replayed.kv]
            m = summarize_replay(name, replayed, compress=args.compress)
            rows.append({"concurrency": level, **m.as_dict()})
            detail.setdefault(str(level), {})[name] = {
                "kv_capacity_tokens": replayed.kv_capacity_tokens,
                "turns": [t.as_dict() for t in replayed.turns],
                "kv": kv,
            }
    return {
        "run": {**run_meta(args, scenario, command, reference), "levels": list(levels)},
        "rows": rows,
        "ttft_p50_ratios": ttft_ratios(rows),
        "ttft_vs_alone": ttft_vs_alone(detail),
        "detail": detail,
    }


def at_level(scenario: Scenario, level: int) -> Scenario:
    """``scenario`` with a system prompt of its own per level (see
    :meth:`Scenario.under_own_prompt`)."""
    return scenario.under_own_prompt(f"Batch {level}")


def ttft_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kvtether's TTFT p50 over colocated's, per level where both ran (None: no TTFT)."""
    by_level: dict[int, dict[str, Any]] = {}
    for row in rows:
        by_level.setdefault(row["concurrency"], {})[row["strategy"]] = row
    out: list[dict[str, Any]] = []
    for level, by_name in by_level.items():
        k, c = by_name.get("kvtether"), by_name.get(REFERENCE)
        if k is None or c is None:
            continue
        ratio = (round(k["ttft_p50_s"] / c["ttft_p50_s"], 3)
                 if k["ttft_p50_s"] is not None and c["ttft_p50_s"] else None)
        out.append({"concurrency": level, "kvtether_over_colocated_ttft_p50": ratio})
    return out


def ttft_vs_alone(detail: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per level above 1 and strategy: :func:`~kvtether.bench.metrics.same_turn_ratios`
    against the same strategy at level 1 (the waiting the level adds, apart from the spread
    of turn sizes). ``[]`` when level 1 was not run."""
    alone_by_name = detail.get("1")
    if not alone_by_name:
        return []
    out: list[dict[str, Any]] = []
    for level, by_name in detail.items():
        if level == "1":
            continue
        for name, at_level in by_name.items():
            alone = alone_by_name.get(name, {}).get("turns", [])
            out.append({"concurrency": int(level), "strategy": name,
                        **same_turn_ratios(at_level["turns"], alone)})
    return out


def print_sweep_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    meta = result["run"]
    table = Table(title=f"kvtether bench concurrency sweep — {meta['scenario']['name']}, "
                  f"profile {meta['profile']}, time compression {meta['compress']:g}x")
    for col in ("level", "strategy", "TTFT p50/p99 s", "turns/s", "reuse", "divergent",
                "failed"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for row in result["rows"]:
        table.add_row(
            str(row["concurrency"]), row["strategy"],
            f"{report._fmt(row['ttft_p50_s'], 2)}/{report._fmt(row['ttft_p99_s'], 2)}",
            report._fmt(row["turns_per_s"], 2),
            f"{row['fired_turns']}/{row['eligible_turns']}",
            "ref" if row["strategy"] == meta["reference"] else
            report._fmt(row["divergent_outputs"]),
            str(row["failed_turns"]),
        )
    console = Console()
    console.print(table)
    for r in result["ttft_p50_ratios"]:
        ratio = r["kvtether_over_colocated_ttft_p50"]
        console.print(f"  {r['concurrency']} at a time: kvtether / colocated TTFT p50 "
                      + ("-" if ratio is None else f"{ratio:.2f}x"))
    for r in result.get("ttft_vs_alone") or []:
        console.print(f"  {r['concurrency']} at a time, {r['strategy']}: TTFT / same turn at "
                      f"level 1, p50 {report._fmt(r['p50'], 2)}x, p99 {report._fmt(r['p99'], 2)}x "
                      f"({r['turns']} turns)")


def sweep_main(args: argparse.Namespace, scenario: Scenario, command: str,
               levels: Sequence[int], out: Path, *, start: StartStrategy = start_strategy
               ) -> list[Path]:
    """Run the sweep, write its files to ``out``, print the table; returns the files."""
    if max(levels) > len(scenario.sessions):
        logger.warning("the scenario has %d sessions: levels above that run them all at once",
                       len(scenario.sessions))
    result = run_sweep(args, scenario, command, levels, start=start)
    paths = report.write_sweep(result, out)
    if not args.no_plots:
        paths += report.write_sweep_plot(result, out)
    print_sweep_table(result)
    return paths
