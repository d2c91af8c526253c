"""The bench's run core: start each strategy once, replay scenarios on it, summarize.

What `kvtether bench` (:mod:`kvtether.bench.compare`), its concurrency sweep
(:mod:`kvtether.bench.sweep`) and the crossover (:mod:`kvtether.bench.crossover`) share; those
modules parse arguments, print tables and write files around it.

* :func:`run_compare` — one scenario on every strategy, side by side.
* :func:`run_sweep` — one scenario at several concurrency levels on every strategy.
* :func:`replay_each_strategy` — the loop under both (and the crossover): each strategy started
  once (and stopped, also on errors and Ctrl-C), every replay run on it, with a progress bar.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import logging
import os
import platform
import uuid
from collections.abc import Callable, Hashable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kvtether.bench import report
from kvtether.bench.metrics import mark_divergence, same_turn_ratios, summarize_replay
from kvtether.bench.scenario import Scenario
from kvtether.bench.strategies import (
    FIXED_TTL_S,
    STRATEGIES,
    Endpoints,
    Strategy,
    StrategyOptions,
    stack_settings,
    start_strategy,
)

if TYPE_CHECKING:
    from kvtether.bench.replay import ReplayResult, TurnGate

__all__ = ["REFERENCE", "Replay", "StartStrategy", "at_level", "check_levels",
           "mark_divergences", "replay_each_strategy", "replay_scenario", "run_compare",
           "run_meta", "run_sweep", "strategy_options", "ttft_ratios", "ttft_vs_alone"]

logger = logging.getLogger(__name__)

# How a strategy's servers are started: ``start_strategy``, or fakes in tests.
StartStrategy = Callable[[Strategy, StrategyOptions], AbstractContextManager[Endpoints]]

# The strategy whose greedy outputs every other strategy's are compared with.
REFERENCE = "colocated"

K = TypeVar("K", bound=Hashable)


def strategy_options(args: argparse.Namespace) -> StrategyOptions:
    return StrategyOptions(
        profile=args.profile, compress=args.compress, port=args.port, state_dir=args.state_dir,
        prefill_prefix_caching=args.prefill_cache, max_retained_tokens=args.max_retained_tokens,
        baseline_connector=args.baseline_connector,
    )


def run_meta(args: argparse.Namespace, scenario: Scenario, command: str,
             reference: str | None) -> dict[str, Any]:
    """What a results file says about how the run was made."""
    return {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": f"{platform.node()} ({platform.machine()}, {os.cpu_count() or 1} cores)",
        "profile": args.profile,
        "compress": args.compress,
        "fixed_ttl_s": FIXED_TTL_S,
        "prefill_prefix_caching": args.prefill_cache,
        "baseline_connector": args.baseline_connector,
        # The profile's, or KVTETHER_LOCAL_PREFILL_MAX_TOKENS: what kvtether's router ran with.
        "local_prefill_max_tokens": stack_settings(
            STRATEGIES["kvtether"], strategy_options(args)).local_prefill_max_tokens,
        "reference": reference,
        "scenario": {"name": scenario.name, "source": scenario.source},
        "scenario_summary": scenario.summary(FIXED_TTL_S),
    }


def check_levels(parser: argparse.ArgumentParser, levels: Sequence[int]) -> None:
    """Refuse ``--concurrency`` levels below 1 or given twice (exits through ``parser``)."""
    if any(n < 1 for n in levels):
        parser.error(f"--concurrency levels must be at least 1 (got {min(levels)}): a "
                     "level is how many sessions may run at the same time")
    if len(set(levels)) != len(levels):
        parser.error("--concurrency levels must differ (each level is replayed once)")


async def replay_scenario(scenario: Scenario, endpoints: Endpoints, strategy: Strategy,
                          args: argparse.Namespace, run_id: str,
                          advance: Callable[[int], None],
                          concurrency: int | None = None,
                          gate: TurnGate | None = None) -> ReplayResult:
    """One replay of ``scenario`` with the bench's options and drain cap."""
    from kvtether.bench.replay import replay

    return await replay(
        scenario, endpoints, strategy, compress=args.compress, run_id=run_id,
        drain_cap_s=FIXED_TTL_S / args.compress + 15.0, timeout_s=args.turn_timeout_s,
        advance=advance, concurrency=concurrency, gate=gate,
    )


@dataclass(frozen=True)
class Replay:
    """One replay each strategy runs: ``scenario`` under conversation ids made from
    ``run_id``, at most ``concurrency`` sessions at a time (None: on arrival)."""

    scenario: Scenario
    run_id: str
    concurrency: int | None = None
    label: str = "replaying"  # what the progress bar says while it runs


def replay_each_strategy(
    args: argparse.Namespace, replays: Mapping[K, Replay], *,
    start: StartStrategy = start_strategy, label_width: int = 24,
) -> tuple[dict[K, dict[str, ReplayResult]], dict[str, Endpoints]]:
    """Start each strategy of ``args.strategies`` once, in order, and run every replay on it.

    Returns the results per replay key and strategy, and where each strategy ran.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    opts = strategy_options(args)
    results: dict[K, dict[str, ReplayResult]] = {key: {} for key in replays}
    ran_on: dict[str, Endpoints] = {}
    total = sum(r.scenario.turns for r in replays.values())
    columns = (TextColumn(f"{{task.description:<{label_width}}}"), BarColumn(),
               MofNCompleteColumn(), TextColumn("turns"), TimeElapsedColumn())
    with Progress(*columns) as progress:
        tasks = {name: progress.add_task(f"{name}: waiting", total=total)
                 for name in args.strategies}
        for name in args.strategies:
            strategy, task = STRATEGIES[name], tasks[name]
            progress.update(task, description=f"{name}: starting")
            with start(strategy, opts) as endpoints:
                ran_on[name] = endpoints
                for key, r in replays.items():
                    progress.update(task, description=f"{name}: {r.label}")
                    results[key][name] = asyncio.run(replay_scenario(
                        r.scenario, endpoints, strategy, args, r.run_id,
                        functools.partial(progress.advance, task), concurrency=r.concurrency))
            progress.update(task, description=f"{name}: done")
    return results, ran_on


def mark_divergences(by_name: Mapping[str, ReplayResult], reference: str | None) -> None:
    """Mark every strategy's outputs that differ from ``reference``'s (when it ran)."""
    if not reference or reference not in by_name:
        return
    for name, replayed in by_name.items():
        if name != reference:
            mark_divergence(by_name[reference].turns, replayed.turns)


def run_compare(args: argparse.Namespace, scenario: Scenario, command: str, *,
                start: StartStrategy = start_strategy) -> dict[str, Any]:
    """Replay ``scenario`` once on every strategy of ``args.strategies``.

    Returns ``run`` (how it was made), ``summary`` (per strategy), ``targets``
    (:func:`~kvtether.bench.report.targets`) and ``strategies`` (per strategy: where it ran,
    every turn and the retained-KV samples).
    """
    run_id = uuid.uuid4().hex[:8]
    results, ran_on = replay_each_strategy(args, {0: Replay(scenario, run_id)}, start=start)
    by_name = results[0]
    reference = REFERENCE if REFERENCE in by_name else None
    mark_divergences(by_name, reference)
    summary: dict[str, Any] = {}
    detail: dict[str, Any] = {}
    for name, r in by_name.items():
        summary[name] = summarize_replay(name, r, compress=args.compress).as_dict()
        detail[name] = {
            "description": STRATEGIES[name].description,
            # The hardware it ran on: CPU cores ("0-1"; None on GPU hosts) and engines.
            "cores": ran_on[name].cores,
            "instances": ran_on[name].instances,
            "kv_capacity_tokens": r.kv_capacity_tokens,
            "turns": [t.as_dict() for t in r.turns],
            "kv": [(s.t_s, s.tokens) for s in r.kv],
        }
    return {
        "run": run_meta(args, scenario, command, reference),
        "summary": summary,
        "targets": report.targets(summary),
        "strategies": detail,
    }


def at_level(scenario: Scenario, level: int) -> Scenario:
    """``scenario`` with a system prompt of its own per level (see
    :meth:`Scenario.under_own_prompt`)."""
    return scenario.under_own_prompt(f"Batch {level}")


def run_sweep(args: argparse.Namespace, scenario: Scenario, command: str,
              levels: Sequence[int], *, start: StartStrategy = start_strategy
              ) -> dict[str, Any]:
    """Replay ``scenario`` at every level on every strategy of ``args.strategies``.

    Returns ``run`` (how the sweep was made), ``rows`` (one summary per level and strategy,
    levels in the order given), ``ttft_p50_ratios`` (kvtether / colocated, per level),
    ``ttft_vs_alone`` (:func:`ttft_vs_alone`) and ``detail`` (per level, per strategy: every
    turn and the retained-KV samples).
    """
    run_id = uuid.uuid4().hex[:8]
    replays = {level: Replay(at_level(scenario, level), f"{run_id}-c{level}", level,
                             f"{level} at a time") for level in levels}
    results, _ = replay_each_strategy(args, replays, start=start, label_width=28)
    reference = REFERENCE if REFERENCE in args.strategies else None
    rows: list[dict[str, Any]] = []
    detail: dict[str, dict[str, Any]] = {}
    for level in levels:
        by_name = results[level]
        mark_divergences(by_name, reference)
        for name, replayed in by_name.items():
            m = summarize_replay(name, replayed, compress=args.compress)
            rows.append({"concurrency": level, **m.as_dict()})
            detail.setdefault(str(level), {})[name] = {
                "kv_capacity_tokens": replayed.kv_capacity_tokens,
                "turns": [t.as_dict() for t in replayed.turns],
                "kv": [(s.t_s, s.tokens) for s in replayed.kv],
            }
    return {
        "run": {**run_meta(args, scenario, command, reference), "levels": list(levels)},
        "rows": rows,
        "ttft_p50_ratios": ttft_ratios(rows),
        "ttft_vs_alone": ttft_vs_alone(detail),
        "detail": detail,
    }


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
        for name, busy in by_name.items():
            alone = alone_by_name.get(name, {}).get("turns", [])
            out.append({"concurrency": int(level), "strategy": name,
                        **same_turn_ratios(busy["turns"], alone)})
    return out
