"""Recorded agent traces (kv-cache-tester format): detection, scaling, source, prediction scores."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from kvtether.bench import traces
from kvtether.bench.scenario import Scenario, ScenarioError, load_scenario
from kvtether.bench.workload import generate_sessions, score_predictions, score_predictions_by_turn

FIXTURE = Path(__file__).parents[1] / "fixtures" / "traces" / "kv-cache-tester-12.json"


def _trace(n: int = 8, *, start: int = 20000, grow: int = 3000, out: int = 200,
           reset_at: int | None = None, trace_id: str = "tr") -> dict[str, Any]:
    """A kv-cache-tester trace: prompts growing by ``grow`` tokens, a person's message every
    fourth request, a subagent entry after the first request."""
    requests: list[dict[str, Any]] = []
    ids: list[int] = []
    t = 0.0
    for k in range(n):
        size = start + k * grow
        blocks = math.ceil(size / 64)
        if k == reset_at:
            ids = ids[:10]  # only the first blocks kept: an edited history
        ids = ids + list(range(100_000 * (k + 1), 100_000 * (k + 1) + blocks - len(ids)))
        person = k % 4 == 0
        requests.append({
            "t": t, "type": "s" if k % 2 else "n", "model": "m", "in": size, "out": out,
            "hash_ids": list(ids), "input_types": ["text"] if person else ["tool_result"],
            "output_types": ["tool_use"], "stop": "tool_use", "api_time": 2.0,
            "think_time": 0.0 if k == 0 else (120.0 if person else 5.0),
        })
        t += 10.0
        if k == 0:
            requests.append({"t": 1.0, "type": "subagent", "requests": []})
    return {"id": trace_id, "models": ["m"], "block_size": 64, "hash_id_scope": "local",
            "tool_tokens": 12000, "system_tokens": 3000, "requests": requests}


def _final_words(scenario: Scenario) -> list[int]:
    """Each session's last prompt plus reply, in words (about tokens with the scenario text)."""
    system = len(scenario.system_prompt.split())
    return [system + sum(len(m.content.split()) for t in s.turns for m in t.append)
            + sum(t.max_tokens for t in s.turns) for s in scenario.sessions]


def test_a_trace_file_is_detected_and_scaled_with_its_source(tmp_path: Path) -> None:
    path = tmp_path / "trace_0001.json"
    path.write_text(json.dumps(_trace(12, start=40000, grow=6000)))
    scenario = load_scenario(path)
    assert scenario.source["format"] == "kv-cache-tester"
    assert scenario.source["license"] == "Apache-2.0"
    assert "kv-cache-tester" in scenario.source["repo"]
    assert scenario.source["file"] == "trace_0001.json"
    scaling = scenario.source["scaling"]
    assert scaling["recorded_end_tokens"] == [40000 + 11 * 6000 + 200]
    assert scaling["token_factor"][0] == pytest.approx(106200 / 32768, rel=1e-3)
    assert scaling["subagents_left_out"] == 1
    (session,) = scenario.sessions
    assert len(session.turns) == 12 and session.stream
    # Recorded gaps and their kinds: a tool result follows a tool gap, a person's message a
    # human one; the last turn ends the session.
    assert [t.gap_kind for t in session.turns[:5]] == ["tool", "tool", "tool", "human", "tool"]
    assert session.turns[3].gap_s == 120.0 and session.turns[0].gap_s == 5.0
    assert session.turns[-1].gap_kind == "end"
    # The session ends at the cap, its growth per turn kept: equal steps stay equal.
    assert _final_words(scenario)[0] == pytest.approx(32768, rel=0.02)
    grown = [len(t.append[0].content.split()) + prev.max_tokens
             for prev, t in zip(session.turns[1:-1], session.turns[2:], strict=True)]
    assert max(grown) - min(grown) <= 4


def test_small_sessions_are_stretched_and_resets_cut(tmp_path: Path) -> None:
    small = _trace(6, start=9000, grow=500, trace_id="small")
    reset = _trace(10, start=20000, grow=1000, reset_at=5, trace_id="reset")
    short = _trace(3, trace_id="short")  # under min_turns: left out
    for n, data in enumerate((small, reset, short)):
        (tmp_path / f"trace_{n:04d}.json").write_text(json.dumps(data))
    conversations, _ = traces.read_traces([tmp_path])
    assert [c.id for c in conversations] == ["small", "reset", "short"]
    assert conversations[1].reset_at() == 5 and conversations[0].reset_at() is None
    scenario = traces.to_scenario(conversations, min_turns=4)
    assert [len(s.turns) for s in scenario.sessions] == [6, 5]
    scaling = scenario.source["scaling"]
    assert scaling["cut_at_prefix_reset"] == 1
    assert scaling["token_factor"][0] < 1  # 11.7 K recorded, stretched to 16 K
    assert scaling["end_tokens"] == [16384, 24200]
    assert _final_words(scenario) == [pytest.approx(16384, rel=0.03),
                                      pytest.approx(24200, rel=0.03)]
    # The directory loads the same way through `kvtether bench --scenario DIR`.
    assert load_scenario(tmp_path).turns == scenario.turns


def test_the_committed_subset_replays_within_the_context(tmp_path: Path) -> None:
    assert FIXTURE.stat().st_size < 200_000
    scenario = load_scenario(FIXTURE)
    source = scenario.source
    assert source["commit"] == "94f6046dfd9c0c8bc0cdb24a5aa6579bac8669bf"
    assert source["license"] == "Apache-2.0" and source["file"] == FIXTURE.name
    assert len(scenario.sessions) == 8 and all(s.stream for s in scenario.sessions)
    assert all(len(s.turns) <= 32 for s in scenario.sessions)
    # cpu-agents holds 64 K tokens; sessions end at 16-32 K (a little over for minimum sizes).
    assert all(16384 * 0.97 <= w <= 32768 * 1.03 for w in _final_words(scenario))
    assert all(t.max_tokens <= 256 for s in scenario.sessions for t in s.turns)
    # Written out, it is an ordinary scenario file.
    out = tmp_path / "scenario.json"
    assert traces.main([str(FIXTURE), "--out", str(out), "--sessions", "3"]) == 0
    again = load_scenario(out)
    assert len(again.sessions) == 3 and again.source["commit"] == source["commit"]


def test_a_bundle_keeps_what_a_replay_needs(tmp_path: Path) -> None:
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps(_trace(10, reset_at=6)))
    conversations, _ = traces.read_traces([raw])
    data = traces.bundle(conversations, {"commit": "abc"}, max_requests=8)
    assert "hash_ids" not in json.dumps(data)
    back, source = traces.read_traces([raw], data)
    assert source == {"commit": "abc"}
    assert back[0].requests == conversations[0].requests[:8]
    assert back[0].reset_at() == 6


def test_other_json_is_not_taken_for_traces(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"requests": []}))
    with pytest.raises(ScenarioError, match="kv-cache-tester"):
        load_scenario(path)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"block_size": 64, "requests": [{"t": 0}]}))
    with pytest.raises(ScenarioError, match="request 0"):
        load_scenario(bad)


def test_prediction_is_scored_on_the_recorded_sessions(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    conversations, _ = traces.read_traces([FIXTURE])
    result = traces.score_prediction(conversations)
    facts = result["traces"]
    assert facts["conversations"] == 12
    assert facts["tool_steps"] + facts["user_steps"] == facts["requests"] - 12
    request = result["request"]
    assert request["all"]["samples"] == facts["requests"] - 12
    assert sum(s["samples"] for k, s in request.items() if k != "all") == request["all"]["samples"]
    assert set(request) == {"all", "1-4", "5-19", "20+"}
    assert result["tool"]["all"]["samples"] == facts["tool_steps"]
    for s in request.values():
        assert 0 <= s["tokens_median_rel_error"] <= s["tokens_p90_rel_error"]
        assert 0 <= s["gap_median_rel_error"] <= s["gap_p90_rel_error"]
    assert traces.main([str(FIXTURE), "--predict"]) == 0
    table = capsys.readouterr().out
    assert "| request | all |" in table and "| tool | 20+ |" in table


def test_a_steady_trace_is_predicted_once_learned() -> None:
    conversations, _ = traces.read_traces([Path("x")], _trace(30, grow=1500, out=300))
    result = traces.score_prediction(conversations, turn_edges=(1, 10))
    late = result["tool"]["10+"]
    # Growth is 1500 per turn, all of it known after a few turns; gaps are 5 s between tools.
    assert late["growth_median_rel_error"] < 0.1
    assert late["gap_median_rel_error"] < 0.2


def test_turn_buckets_partition_the_generated_scores() -> None:
    sessions = generate_sessions(20, seed=4, steps=(6, 30))
    overall = score_predictions(sessions)
    buckets = score_predictions_by_turn(sessions, (1, 5, 20))
    for point in ("request", "tool"):
        assert sum(s.samples for s in buckets[point].values()) == overall[point].samples
    assert overall["request"].growth_median_rel_error > 0
    with pytest.raises(ValueError):
        score_predictions_by_turn(sessions, (0, 5))
