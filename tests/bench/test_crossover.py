"""`kvtether bench crossover`: the grid, its verdicts and its files.

No vLLM: the replay talks over real HTTP to the fake vLLM of the router tests, and the crossover
starts its strategies through ``main``'s ``start`` hook.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtether.bench import crossover
from kvtether.bench.strategies import Strategy, StrategyOptions
from tests.bench.conftest import FakeStarts
from tests.support.replays import COMPRESS


def test_every_cell_runs_on_each_strategy_started_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_starts: FakeStarts) -> None:
    out = tmp_path / "out"
    assert crossover.main([
        "--strategies", "colocated", "kvtether", "--context-tokens", "700", "1400",
        "--concurrency", "1", "2", "--turns", "2", "3", "--max-output-tokens", "8",
        "--compress", str(COMPRESS), "--out", str(out),
        "--state-dir", str(tmp_path / "state"),
    ], start=fake_starts.start) == 0
    assert fake_starts.started == ["colocated", "kvtether"]
    data = json.loads((out / "crossover.json").read_text())
    cells = [(r["context_tokens"], r["concurrency"], r["strategy"]) for r in data["rows"]]
    assert sorted(cells) == sorted((length, level, name) for length in (700, 1400)
                                   for level in (1, 2) for name in ("colocated", "kvtether"))
    assert all(r["failed_turns"] == 0 and r["ttft_turns"] > 0 for r in data["rows"])
    # Every turn streams, and kvtether's outputs are compared with colocated's in each cell.
    assert all(r["compared_outputs"] == r["turns"] for r in data["rows"]
               if r["strategy"] == "kvtether")
    assert [(v["context_tokens"], v["concurrency"]) for v in data["verdicts"]] == [
        (700, 1), (700, 2), (1400, 1), (1400, 2)]
    assert all(v["against"] == "colocated" and v["ttft_ratio"] > 0 for v in data["verdicts"])
    # Each cell talks under its own system prompt: no prefix cache carries from one to the next.
    systems = {r.body["messages"][0]["content"].split(".", 1)[0]
               for r in fake_starts.fake.requests if "messages" in r.body}
    assert len(systems) == 4
    md = (out / "crossover.md").read_text()
    assert md.count("| 700 |") == 2 and md.count("| 1400 |") == 2
    assert (out / "crossover.png").read_bytes().startswith(b"\x89PNG")
    assert "crossover.json" in capsys.readouterr().out


def _row(length: int, level: int, name: str, ttft: float, rate: float) -> dict[str, Any]:
    return {"context_tokens": length, "concurrency": level, "strategy": name,
            "ttft_p50_s": ttft, "turns_per_s": rate, "tpot_p50_s": 0.05}


def test_the_verdict_is_against_the_better_colocated_baseline() -> None:
    rows = [
        _row(4096, 1, "colocated", 0.4, 1.0), _row(4096, 1, "colocated-dp", 0.5, 1.2),
        _row(4096, 1, "kvtether", 0.6, 0.9),
        _row(32768, 4, "colocated", 3.0, 0.2), _row(32768, 4, "colocated-dp", 2.0, 0.3),
        _row(32768, 4, "kvtether", 1.0, 0.4),
        _row(16384, 4, "colocated", 1.0, 0.5), _row(16384, 4, "kvtether", 0.9, 0.4),
    ]
    v = {(x["context_tokens"], x["concurrency"]): x for x in crossover.verdicts(rows)}
    assert v[(4096, 1)]["against"] == "colocated" and v[(4096, 1)]["wins"] is False
    assert v[(4096, 1)]["ttft_ratio"] == 1.5
    assert v[(32768, 4)]["against"] == "colocated-dp" and v[(32768, 4)]["wins"] is True
    assert v[(32768, 4)]["ttft_ratio"] == 0.5 and v[(32768, 4)]["throughput_ratio"] == 1.333
    assert v[(16384, 4)]["wins"] is None  # faster first tokens, fewer turns: mixed


@pytest.mark.parametrize("argv", [
    ["--concurrency", "0"], ["--concurrency", "2", "2"], ["--context-tokens", "100"],
    ["--strategies", "colocated"], ["--system-share", "1"],
])
def test_bad_grids_are_refused_before_anything_starts(argv: list[str]) -> None:
    def start(strategy: Strategy, opts: StrategyOptions) -> Any:
        raise AssertionError("nothing may start")

    with pytest.raises(SystemExit) as exc:
        crossover.main(argv, start=start)
    assert exc.value.code == 2
