"""`kvtether bench --concurrency`: the session limit, the sweep's files and its arguments.

No vLLM: the replay talks over real HTTP to the fake vLLM of the router tests (word-level
tokens, deterministic "greedy" answers), served by uvicorn in a thread, and the sweep starts
its strategies through ``compare.main``'s ``start`` hook.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import Response

from kvtether import protocol as p
from kvtether.bench import compare, report
from kvtether.bench.replay import replay
from kvtether.bench.scenario import Scenario, load_scenario
from kvtether.bench.strategies import STRATEGIES, Strategy, StrategyOptions
from kvtether.bench.sweep import ttft_ratios
from tests.bench.conftest import FakeStarts
from tests.support.fake_vllm import Cluster, FakeVLLM
from tests.support.replays import COMPRESS, endpoints, serving, small_scenario


class SessionsInFlight(FakeVLLM):
    """The fake vLLM, counting agent sessions from their first request to the answer to their
    last (a session is told by its task message). It sees a session end a moment before the
    agent does, so it never counts more than were running."""

    def __init__(self, scenario: Scenario, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.turns_of = {s.turns[0].append[0].content: len(s.turns) for s in scenario.sessions}
        self.active = 0
        self.max_active = 0

    async def completions(self, request: Request) -> Response:
        messages = (await request.json())["messages"]
        answered = sum(m["role"] == "assistant" for m in messages)
        if answered == 0:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            return await super().completions(request)
        finally:
            if answered == self.turns_of[messages[1]["content"]] - 1:
                self.active -= 1


# --- the session limit -----------------------------------------------------------------------
@pytest.mark.parametrize("concurrency", [1, 3])
async def test_at_most_n_sessions_run_at_once_in_scenario_order(concurrency: int) -> None:
    # Sessions arrive an hour of workload time apart (18 s of wall time at 200x): a
    # concurrency level ignores that and starts the next session as soon as a slot is free.
    scenario = small_scenario(6)
    assert scenario.sessions[-1].start_s / COMPRESS > 30
    with serving(lambda port: SessionsInFlight(scenario, Cluster(), "fake", "127.0.0.1", port,
                                               delay_s=0.02)) as fake:
        result = await replay(scenario, endpoints(fake), STRATEGIES["colocated"],
                              compress=COMPRESS, run_id="t", sample_every_s=0.05,
                              concurrency=concurrency)
    assert fake.max_active == concurrency
    assert [t.error for t in result.turns] == [None] * scenario.turns
    firsts = {t.session: t.started_s for t in result.turns if t.turn == 1}
    assert all(firsts[s.id] < s.start_s / COMPRESS for s in scenario.sessions[1:])  # no waiting
    order = [s.id for s in scenario.sessions]
    assert sorted(order, key=lambda sid: firsts[sid]) == order


async def test_without_a_level_sessions_start_on_arrival_all_at_once() -> None:
    arrive_together = small_scenario(6)
    arrive_together = arrive_together.model_copy(update={"sessions": [
        s.model_copy(update={"start_s": 0.0}) for s in arrive_together.sessions]})
    with serving(lambda port: SessionsInFlight(arrive_together, Cluster(), "fake", "127.0.0.1",
                                               port, delay_s=0.02)) as fake:
        result = await replay(arrive_together, endpoints(fake), STRATEGIES["colocated"],
                              compress=COMPRESS, run_id="t", sample_every_s=0.05)
    assert fake.max_active == 6 and len(result.turns) == arrive_together.turns
    with pytest.raises(ValueError, match="concurrency must be at least 1"):
        await replay(arrive_together, endpoints(fake), STRATEGIES["colocated"],
                     compress=COMPRESS, run_id="t", concurrency=0)


# --- the sweep, end to end ---------------------------------------------------------------------
def test_a_sweep_replays_each_level_on_each_strategy_started_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_starts: FakeStarts) -> None:
    out = tmp_path / "out"
    assert compare.main([
        "--strategies", "colocated", "pd-upstream", "--concurrency", "3", "1",
        "--compress", str(COMPRESS), "--context-tokens", "700", "--system-tokens", "200",
        "--max-output-tokens", "16", "--stream-fraction", "1", "--out", str(out),
        "--state-dir", str(tmp_path / "state"),
    ], start=fake_starts.start) == 0
    assert fake_starts.started == ["colocated", "pd-upstream"]
    # Without --sessions/--turns a sweep's scenario has one session per slot of the top level.
    scenario = load_scenario(out / "scenario.json")
    assert len(scenario.sessions) == 3 and all(4 <= len(s.turns) <= 6 for s in scenario.sessions)
    assert scenario.source["long_tools"] == 0

    data = json.loads((out / "sweep.json").read_text())
    assert data["run"]["levels"] == [3, 1] and data["run"]["reference"] == "colocated"
    assert [(r["concurrency"], r["strategy"]) for r in data["rows"]] == [
        (3, "colocated"), (3, "pd-upstream"), (1, "colocated"), (1, "pd-upstream")]
    for r in data["rows"]:
        assert (r["turns"], r["failed_turns"]) == (scenario.turns, 0)
        assert r["ttft_turns"] == scenario.turns - 3 and r["turns_per_s"] > 0
    upstream = [r for r in data["rows"] if r["strategy"] == "pd-upstream"]
    assert all((r["divergent_outputs"], r["compared_outputs"]) == (0, scenario.turns)
               for r in upstream)
    assert data["ttft_p50_ratios"] == []  # kvtether did not run
    # Level 3's turns against the same turns at level 1 (run after it), strategy by strategy.
    assert [(r["concurrency"], r["strategy"], r["turns"]) for r in data["ttft_vs_alone"]] == [
        (3, "colocated", scenario.turns - 3), (3, "pd-upstream", scenario.turns - 3)]
    assert all(r["p50"] > 0 for r in data["ttft_vs_alone"])
    # Each level talks in conversations of its own: no level can reuse another's KV.
    ids: dict[str, set[str]] = {}
    for received in fake_starts.fake.requests:
        if p.BODY_CONVERSATION_ID in received.body:
            cid = received.body[p.BODY_CONVERSATION_ID]
            ids.setdefault(cid.rsplit("-", 1)[0], set()).add(cid)
    assert len(ids) == 2 and all(len(v) == 3 for v in ids.values())
    assert not set.intersection(*ids.values())

    md = (out / "sweep.md").read_text()
    # The main table and the spread table: one row per level and strategy in each.
    assert len([line for line in md.splitlines() if line.startswith(("| 1 |", "| 3 |"))]) == 8
    assert "| 1 | colocated |" in md and "| - |" in md  # level 1 has nothing to divide by
    assert (out / "sweep.png").read_bytes().startswith(b"\x89PNG")
    assert not (out / "results.json").exists()
    printed = capsys.readouterr().out
    assert "concurrency sweep" in printed and "sweep.json" in printed


def test_sweep_report_shows_the_kvtether_over_colocated_ratio(tmp_path: Path) -> None:
    def row(level: int, name: str, p50: float | None) -> dict[str, Any]:
        return {"concurrency": level, "strategy": name, "ttft_p50_s": p50,
                "ttft_p99_s": None if p50 is None else 2 * p50, "turns_per_s": 0.5 * level,
                "fired_turns": 3, "eligible_turns": 4, "failed_turns": 0,
                "divergent_outputs": None if name == "colocated" else 0, "compared_outputs": 9}

    rows = [row(1, "colocated", 0.5), row(1, "kvtether", 1.0), row(4, "colocated", 2.0),
            row(4, "kvtether", None)]
    ratios = ttft_ratios(rows)
    assert ratios == [{"concurrency": 1, "kvtether_over_colocated_ttft_p50": 2.0},
                      {"concurrency": 4, "kvtether_over_colocated_ttft_p50": None}]
    result = {
        "run": {"command": "kvtether bench --concurrency 1 4", "scenario": {"name": "x"},
                "profile": "cpu-tiny", "compress": 16.0, "fixed_ttl_s": 480.0,
                "prefill_prefix_caching": False, "host": "h", "date": "d",
                "scenario_summary": {"sessions": 4}, "reference": "colocated",
                "levels": [1, 4]},
        "rows": rows, "ttft_p50_ratios": ratios, "detail": {},
    }
    md = report.render_sweep_markdown(result)
    assert "| 1 | kvtether | 1.000 / 2.000 | 0.500 | 3/4 | 0 | 0 / 9 |" in md
    assert "| 1 | 2.00x |" in md and "| 4 | - |" in md
    assert "| 4 | colocated | 2.00x | - |" in md and "| 4 | kvtether | - | - |" in md
    # A strategy without a TTFT at some level is still drawn (the gap is left open).
    assert [x.name for x in report.write_sweep_plot(result, tmp_path)] == ["sweep.png"]


# --- arguments -------------------------------------------------------------------------------
@pytest.mark.parametrize(("argv", "message"), [
    (["--concurrency", "0"], "--concurrency levels must be at least 1 (got 0)"),
    (["--concurrency", "4", "-2"], "--concurrency levels must be at least 1 (got -2)"),
    (["--concurrency"], "expected at least one argument"),
    (["--concurrency", "four"], "invalid int value: 'four'"),
    (["--concurrency", "4", "4"], "--concurrency levels must differ"),
    (["--concurrency", "4", "--sessions", "0"], "--sessions must be at least 1"),
])
def test_bad_levels_are_refused_before_anything_starts(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    def start(strategy: Strategy, opts: StrategyOptions) -> Any:
        raise AssertionError("nothing may start")

    with pytest.raises(SystemExit) as exc:
        compare.main(argv, start=start)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_without_a_sweep_the_scenario_defaults_are_unchanged(tmp_path: Path) -> None:
    assert compare.generate_main(["--out", str(tmp_path / "s.json")]) == 0
    s = load_scenario(tmp_path / "s.json")
    assert len(s.sessions) == 8 and s.source["long_tools"] == 2
    assert all(4 <= len(x.turns) <= 8 for x in s.sessions)
    assert "--concurrency" in compare.build_parser().format_help()


def test_where_turn_2_plus_time_went_is_summarized_per_strategy() -> None:
    from kvtether.bench.metrics import TurnResult, summarize
    from kvtether.bench.report import stage_table

    def turn(n: int, prefill_s: float) -> TurnResult:
        return TurnResult(session="s", turn=n, stream=True, started_s=0.0, ttft_s=1.0,
                          timings={"plan": 0.1, "prefill_leg": prefill_s})

    m = summarize("kvtether", [turn(1, 9.0), turn(2, 1.0), turn(3, 3.0)], [], wall_s=1.0,
                  drain_s=0.0, compress=1.0, not_run=0)
    assert m.stage_p50_s == {"plan": 0.1, "prefill_leg": 2.0}  # turns 2+ only
    colocated = summarize("colocated", [turn(2, 1.0)], [], wall_s=1.0, drain_s=0.0,
                          compress=1.0, not_run=0)
    colocated.stage_p50_s = None  # no router: nothing to break down
    lines = stage_table({"colocated": colocated.as_dict(), "kvtether": m.as_dict()})
    assert [line for line in lines if line.startswith("| kvtether |")] == [
        "| kvtether | - | 0.100 | - | - | - | 2.000 | - | - | - | - | - | - | - | - |"]
    assert not any(line.startswith("| colocated |") for line in lines)


def test_sweep_report_shows_each_level_against_the_same_turns_alone() -> None:
    rows = [{"concurrency": 4, "strategy": "kvtether", "turns": 3, "p50": 2.0, "p99": 3.96}]
    result = {"rows": [{"concurrency": 4, "strategy": "kvtether", "ttft_p50_s": 2.0,
                        "ttft_p99_s": 4.9}], "ttft_vs_alone": rows}
    assert "| 4 | kvtether | 2.45x | 2.00x / 3.96x (3) |" in report._spread_lines(result)
