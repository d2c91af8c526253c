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
table. The sweep itself is :func:`kvtether.bench.runner.run_sweep`.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtether.bench import report
from kvtether.bench.runner import (
    StartStrategy,
    run_sweep,
    ttft_ratios,
    ttft_vs_alone,
)
from kvtether.bench.scenario import Scenario
from kvtether.bench.strategies import start_strategy

# The run core's sweep names stay importable from here.
__all__ = ["print_sweep_table", "run_sweep", "sweep_main", "ttft_ratios", "ttft_vs_alone"]

logger = logging.getLogger(__name__)


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
            f"{report.fmt(row['ttft_p50_s'], 2)}/{report.fmt(row['ttft_p99_s'], 2)}",
            report.fmt(row["turns_per_s"], 2),
            f"{row['fired_turns']}/{row['eligible_turns']}",
            "ref" if row["strategy"] == meta["reference"] else
            report.fmt(row["divergent_outputs"]),
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
                      f"level 1, p50 {report.fmt(r['p50'], 2)}x, p99 {report.fmt(r['p99'], 2)}x "
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
