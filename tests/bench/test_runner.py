"""The bench's run core: each strategy started once, every replay on it, outputs compared with
the reference, the figures of a side-by-side run and of a sweep.

No vLLM: the replay talks over real HTTP to the fake vLLM of the router tests, started through
the ``start`` hook (:class:`~tests.bench.conftest.FakeStarts`).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtether.bench import compare
from kvtether.bench.metrics import TurnResult
from kvtether.bench.replay import ReplayResult
from kvtether.bench.runner import (
    Replay,
    at_level,
    mark_divergences,
    replay_each_strategy,
    run_compare,
    ttft_vs_alone,
)
from kvtether.bench.scenario import generate_scenario
from kvtether.bench.strategies import Endpoints, Strategy, StrategyOptions
from tests.bench.conftest import FakeStarts
from tests.support.replays import COMPRESS, small_scenario


def _args(tmp_path: Path, *strategies: str) -> argparse.Namespace:
    return compare.build_parser().parse_args([
        "--strategies", *strategies, "--compress", str(COMPRESS),
        "--state-dir", str(tmp_path / "state")])


def test_each_strategy_is_started_once_and_runs_every_replay(
        tmp_path: Path, fake_starts: FakeStarts) -> None:
    scenario = small_scenario(2)
    replays = {"a": Replay(at_level(scenario, 1), "run-a", 1, "one at a time"),
               "b": Replay(at_level(scenario, 2), "run-b", 2, "two at a time")}
    results, ran_on = replay_each_strategy(_args(tmp_path, "colocated", "pd-upstream"), replays,
                                           start=fake_starts.start)
    assert fake_starts.started == ["colocated", "pd-upstream"]
    assert list(results) == ["a", "b"]
    for by_name in results.values():
        assert list(by_name) == ["colocated", "pd-upstream"]
        assert all(len(r.turns) == scenario.turns and not any(t.error for t in r.turns)
                   for r in by_name.values())
    assert set(ran_on) == {"colocated", "pd-upstream"}


def test_a_strategy_that_fails_to_start_ends_the_run_with_the_earlier_ones_stopped(
        tmp_path: Path, fake_starts: FakeStarts) -> None:
    log: list[str] = []

    @contextlib.contextmanager
    def start(strategy: Strategy, opts: StrategyOptions) -> Iterator[Endpoints]:
        if strategy.name == "pd-upstream":
            raise RuntimeError("pd-upstream never became healthy")
        log.append(f"{strategy.name} up")
        try:
            with fake_starts.start(strategy, opts) as endpoints:
                yield endpoints
        finally:
            log.append(f"{strategy.name} down")

    with pytest.raises(RuntimeError, match="never became healthy"):
        replay_each_strategy(_args(tmp_path, "colocated", "pd-upstream", "kvtether"),
                             {0: Replay(small_scenario(1), "run")}, start=start)
    assert log == ["colocated up", "colocated down"]  # kvtether never started


def _turn(session: str, n: int, digest: str, error: str | None = None) -> TurnResult:
    return TurnResult(session=session, turn=n, stream=True, started_s=0.0,
                      output_digest=digest, error=error)


def test_outputs_are_compared_with_the_reference_where_both_ran() -> None:
    reference = ReplayResult(turns=[_turn("s", 1, "x"), _turn("s", 2, "y"),
                                    _turn("s", 3, "z", error="timeout")])
    other = ReplayResult(turns=[_turn("s", 1, "x"), _turn("s", 2, "other"),
                                _turn("s", 3, "z")])
    mark_divergences({"colocated": reference, "kvtether": other}, "colocated")
    assert [t.diverged for t in other.turns] == [False, True, None]
    assert [t.diverged for t in reference.turns] == [None, None, None]  # not against itself
    alone = ReplayResult(turns=[_turn("s", 1, "x")])
    mark_divergences({"kvtether": alone}, "colocated")  # the reference did not run
    mark_divergences({"colocated": reference, "kvtether": alone}, None)
    assert alone.turns[0].diverged is None


def test_a_side_by_side_run_summarizes_every_strategy_against_colocated(
        tmp_path: Path, fake_starts: FakeStarts) -> None:
    scenario = small_scenario(2, arrival_s=0.0)
    result = run_compare(_args(tmp_path, "colocated", "pd-upstream"), scenario, "kvtether bench",
                         start=fake_starts.start)
    assert result["run"]["reference"] == "colocated"
    assert result["run"]["command"] == "kvtether bench"
    assert list(result["summary"]) == ["colocated", "pd-upstream"]
    upstream = result["summary"]["pd-upstream"]
    assert upstream["turns"] == scenario.turns and upstream["failed_turns"] == 0
    # The fake answers greedily: the same prompt gives the same output on every strategy.
    assert (upstream["divergent_outputs"], upstream["compared_outputs"]) == (0, scenario.turns)
    assert result["summary"]["colocated"]["divergent_outputs"] is None
    detail = result["strategies"]["pd-upstream"]
    assert len(detail["turns"]) == scenario.turns and detail["instances"] == 1


def test_without_colocated_nothing_is_compared(tmp_path: Path, fake_starts: FakeStarts) -> None:
    result = run_compare(_args(tmp_path, "pd-upstream"), small_scenario(1), "x",
                         start=fake_starts.start)
    assert result["run"]["reference"] is None
    assert result["summary"]["pd-upstream"]["compared_outputs"] == 0


def test_each_level_has_prompts_of_its_own_so_no_prefix_cache_carries_over() -> None:
    # Found in a real sweep: colocated's prefix cache served levels 4 and 16 the whole prompts
    # level 1 had computed (fresh conversation ids do not stop a cache that matches prompts).
    scenario = generate_scenario(sessions=2, seed=1)
    one, four = at_level(scenario, 1), at_level(scenario, 4)
    assert one.system_prompt != four.system_prompt
    assert one.system_prompt.endswith(scenario.system_prompt)
    assert one.sessions == four.sessions == scenario.sessions


def test_a_sweep_divides_each_turn_by_the_same_turn_at_level_1() -> None:
    def turn(session: str, n: int, ttft: float | None, stream: bool = True) -> dict[str, Any]:
        return {"session": session, "turn": n, "stream": stream, "ttft_s": ttft}

    alone = [turn("s0", 1, 9.0), turn("s0", 2, 1.0), turn("s0", 3, 4.0), turn("s1", 2, 0.5),
             turn("s1", 3, 2.0, stream=False)]
    busy = [turn("s0", 1, 90.0), turn("s0", 2, 2.0), turn("s0", 3, 4.0), turn("s1", 2, 2.0),
            turn("s1", 3, 9.0, stream=False), turn("s2", 2, 5.0)]
    detail = {"1": {"kvtether": {"turns": alone}},
              "4": {"kvtether": {"turns": busy}, "colocated": {"turns": busy}}}
    # Turns 2+, streamed, at both levels: s0/2 2.0x, s0/3 1.0x, s1/2 4.0x. Colocated did not
    # run level 1 here, so none of its turns has a partner.
    assert ttft_vs_alone(detail) == [
        {"concurrency": 4, "strategy": "kvtether", "turns": 3, "p50": 2.0, "p99": 3.96},
        {"concurrency": 4, "strategy": "colocated", "turns": 0, "p50": None, "p99": None},
    ]
    assert ttft_vs_alone({"4": detail["4"]}) == []  # no level 1, nothing to divide by
