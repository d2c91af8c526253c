"""`kvtether bench`: scenarios, per-turn outcomes, metrics and reports (no vLLM), and one small
real run of every strategy (the CI smoke test: it completes and its metrics agree)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtether.bench import compare, report
from kvtether.bench.metrics import (
    TurnResult, classify, mark_divergence, same_turn_ratios, summarize,
)
from kvtether.bench.scenario import ScenarioError, generate_scenario, load_scenario


# --- scenarios -------------------------------------------------------------------------------
def test_generated_scenarios_are_seeded_and_shaped() -> None:
    a = generate_scenario(6, seed=3, turns=(3, 6), context_tokens=1500, system_tokens=300)
    b = generate_scenario(6, seed=3, turns=(3, 6), context_tokens=1500, system_tokens=300)
    assert a == b and a != generate_scenario(6, seed=4, turns=(3, 6), context_tokens=1500,
                                             system_tokens=300)
    assert len(a.sessions) == 6 and all(3 <= len(s.turns) <= 6 for s in a.sessions)
    for s in a.sessions:
        assert s.turns[-1].gap_kind == "end" and s.turns[-1].gap_s == 0
        assert all(t.gap_kind != "end" for t in s.turns[:-1])
        words = len(a.system_prompt.split()) + sum(
            len(m.content.split()) for t in s.turns for m in t.append)
        assert words + sum(t.max_tokens for t in s.turns) < 1500 * 1.1
    # The long-tool tail is in the file, and the summary counts gaps beyond a fixed TTL.
    assert a.summary(480.0)["gaps_longer_than_fixed_ttl"] >= 2
    assert a.source["long_tools"] == 2 and a.source["seed"] == 3


def test_scenario_files_round_trip_and_bad_files_say_why(tmp_path: Path) -> None:
    s = generate_scenario(2, seed=1, turns=(2, 3), context_tokens=800, system_tokens=200)
    path = tmp_path / "s.json"
    s.save(path)
    assert load_scenario(path) == s
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kvtether_scenario": 1, "name": "x", "system_prompt": "s",
                               "sessions": [{"id": "a", "turns": []}]}))
    with pytest.raises(ScenarioError, match=r"sessions\.0\.turns"):
        load_scenario(bad)
    bad.write_text("{not json")
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(bad)
    bad.write_text('{"other": 1}')
    with pytest.raises(ScenarioError, match="neither a kvtether scenario"):
        load_scenario(bad)
    with pytest.raises(ScenarioError, match="does not exist"):
        load_scenario(tmp_path / "missing.json")


def test_vllm_multi_turn_conversations_are_read(tmp_path: Path) -> None:
    path = tmp_path / "conv.json"
    path.write_text(json.dumps([
        {"id": "c1", "messages": [
            {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": "one two three four"},
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": "five six"},
        ]},
        {"id": "c2", "messages": [{"role": "user", "content": "only a question"}]},
    ]))
    s = load_scenario(path, think_s=30)
    assert [x.id for x in s.sessions] == ["c1", "c2"]
    c1 = s.sessions[0].turns
    assert [t.max_tokens for t in c1] == [4, 2]
    assert (c1[0].gap_kind, c1[0].gap_s, c1[1].gap_kind) == ("human", 30, "end")
    assert s.source["format"] == "vllm-multi-turn"
    path.write_text(json.dumps([{"id": "c", "messages": [{"role": "robot", "content": "x"}]}]))
    with pytest.raises(ScenarioError, match="role 'robot'"):
        load_scenario(path)


# --- outcomes and metrics -----------------------------------------------------------------------
def _turn(turn: int, reused: int, **kw: object) -> TurnResult:
    return TurnResult(session="s", turn=turn, stream=True, started_s=0.0,
                      reused_tokens=reused, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("built", "prompt", "reused", "eligible", "fired"),
    [
        (None, list(range(100)), 0, False, False),  # first turn
        (list(range(80)), list(range(100)), 64, True, True),  # a partial block recomputed
        (list(range(80)), list(range(100)), 70, True, True),  # local cache + below threshold
        (list(range(80)), list(range(100)), 0, True, False),  # lost: recomputed all 80
        (list(range(80)), list(range(100)), 32, True, False),  # lost 48 > a block
        ([1, 2, 3] + list(range(80)), list(range(100)), 0, False, False),  # rewritten history
        (list(range(60)) + [999] * 20, list(range(100)), 32, True, True),  # break, salvaged
        (list(range(10)), list(range(100)), 0, False, False),  # below the threshold
    ],
)
def test_turn_outcomes_mean_what_a_user_thinks(
    built: list[int] | None, prompt: list[int], reused: int, eligible: bool, fired: bool
) -> None:
    t = _turn(2, reused, prompt_tokens=len(prompt))
    classify(t, built, prompt, block_size=32, threshold=16)
    assert (t.eligible, t.fired) == (eligible, fired)


def test_summary_counts_what_the_table_shows() -> None:
    turns = [
        _turn(1, 0, prompt_tokens=100, ttft_s=1.0, latency_s=2.0, output_digest="a"),
        _turn(2, 96, prompt_tokens=150, ttft_s=0.2, latency_s=1.0, eligible=True, fired=True,
              reusable_tokens=110, router_outcome="fired", output_digest="b"),
        _turn(3, 0, prompt_tokens=200, ttft_s=1.5, latency_s=2.5, eligible=True,
              reusable_tokens=160, router_outcome="miss:lease_expired", output_digest="c"),
        _turn(4, 0, error="APIError: boom"),
    ]
    ref = [_turn(1, 0, output_digest="a"), _turn(2, 0, output_digest="b"),
           _turn(3, 0, output_digest="X")]
    mark_divergence(ref, turns)
    m = summarize("kvtether", turns, [(0.0, 0.0), (1.0, 100.0), (3.0, 100.0)], wall_s=10.0,
                  drain_s=1.0, compress=16.0, not_run=2)
    assert (m.turns, m.failed_turns, m.not_run_turns) == (4, 1, 2)
    assert (m.eligible_turns, m.fired_turns, m.reuse_rate) == (2, 1, 0.5)
    assert m.ttft_turns == 2 and m.ttft_p50_s == pytest.approx(0.85)
    assert m.recomputed_tokens == 100 + 54 + 200
    assert m.recomputed_reusable_tokens == 14 + 160
    assert (m.divergent_outputs, m.compared_outputs, m.router_fired_turns) == (1, 3, 1)
    assert m.retained_kv_token_s == 250.0 and m.retained_kv_token_s_workload == 4000.0
    assert m.turns_per_s == 0.3


def _result(summary: dict[str, dict[str, object]]) -> dict[str, object]:
    return {
        "run": {"command": "kvtether bench", "scenario": {"name": "x"}, "profile": "cpu-tiny",
                "compress": 16.0, "fixed_ttl_s": 480.0, "prefill_prefix_caching": False,
                "host": "h", "date": "d", "scenario_summary": {"sessions": 1},
                "reference": "colocated"},
        "summary": summary,
        "strategies": {name: {"turns": [], "kv": [[0, 0], [1, 5]]} for name in summary},
    }


def test_targets_and_markdown_report_what_was_measured(tmp_path: Path) -> None:
    base = summarize("x", [], [], wall_s=1, drain_s=0, compress=16, not_run=0).as_dict()
    summary = {
        "colocated": {**base, "strategy": "colocated", "ttft_p50_s": 1.0, "turns_per_s": 0.5},
        "pd-oneway": {**base, "strategy": "pd-oneway", "ttft_p50_s": 6.0},
        "pd-upstream": {**base, "strategy": "pd-upstream", "retained_kv_token_s": 1000.0},
        "kvtether": {**base, "strategy": "kvtether", "ttft_p50_s": 1.5, "eligible_turns": 10,
                     "fired_turns": 10, "reuse_rate": 1.0, "divergent_outputs": 0,
                     "retained_kv_token_s": 300.0, "ttft_p99_s": 3.0, "turns_per_s": 0.6},
    }
    summary["colocated-instance"] = {**base, "strategy": "colocated-instance",
                                     "ttft_p50_s": 1.25}
    rows = {r["target"]: r for r in report.targets(summary)}
    # Against the deployments on the same cores: reported, no target.
    assert rows["turn 2+ TTFT p50, kvtether / colocated"]["measured"] == "1.50x"
    assert rows["turn 2+ TTFT p50, kvtether / colocated"]["met"] is None
    assert rows["turns/s, kvtether / colocated"]["measured"] == "1.20x"
    # Against one P/D instance's share of the cores: at most 1.1x.
    assert rows["turn 2+ TTFT p50, kvtether / colocated-instance"]["measured"] == "1.20x"
    assert rows["turn 2+ TTFT p50, kvtether / colocated-instance"]["met"] is False
    assert rows["turn 2+ TTFT p99 / p50 (kvtether)"]["measured"] == "2.00x"
    assert rows["reuse on eligible turns"]["met"] is True
    assert rows["turn 2+ TTFT p50, pd-oneway / kvtether"]["measured"] == "4.00x"
    assert rows["turn 2+ TTFT p50, pd-oneway / kvtether"]["met"] is True
    assert rows["retained KV token-s vs fixed TTL (pd-upstream)"]["met"] is False
    result = _result(summary)
    md = report.render_markdown(result)  # type: ignore[arg-type]
    assert "| kvtether | 1.500 / 3.000 | - | 10/10 (100%) |" in md
    assert "**no**" in md and "16x" in md
    # kvtether over each other strategy: its TTFT p50 1.5 s over colocated's 1.0 s.
    assert "| colocated | 1.50x | - | - | - |" in md
    paths = report.write_results(result, tmp_path)  # type: ignore[arg-type]
    paths += report.write_plots(result, tmp_path)  # type: ignore[arg-type]
    assert {p.name for p in paths} == {"results.json", "results.md", "reuse_by_turn.png",
                                       "ttft_cdf.png", "retained_kv.png", "ttft_tpot.png"}


def test_each_turn_against_the_reference_s_same_turn_apart_from_the_spread() -> None:
    def turn(session: str, n: int, ttft: float | None, stream: bool = True) -> dict:
        return {"session": session, "turn": n, "stream": stream, "ttft_s": ttft}

    # s1 turn 3 is the long addition: slow on both, so its ratio is not the tail.
    base = [turn("s1", 1, 9.0), turn("s1", 2, 0.5), turn("s1", 3, 2.0), turn("s2", 2, 0.4),
            turn("s2", 3, 0.4, stream=False)]
    mine = [turn("s1", 1, 1.0), turn("s1", 2, 0.4), turn("s1", 3, 2.2), turn("s2", 2, 0.4),
            turn("s2", 3, None, stream=False), turn("s3", 2, 5.0)]
    same = same_turn_ratios(mine, base)
    assert same["turns"] == 3  # turn 1, unstreamed and unmatched turns are left out
    assert same["p50"] == 1.0 and same["p99"] == 1.098
    assert same_turn_ratios([], base) == {"turns": 0, "p50": None, "p99": None}

    base_m = summarize("x", [], [], wall_s=1, drain_s=0, compress=16, not_run=0).as_dict()
    summary = {"colocated": {**base_m, "ttft_p50_s": 0.45, "ttft_p99_s": 1.98},
               "kvtether": {**base_m, "ttft_p50_s": 0.4, "ttft_p99_s": 2.18}}
    result = _result(summary)
    result["strategies"] = {"colocated": {"turns": base, "kv": []},
                            "kvtether": {"turns": mine, "kv": []}}
    md = report.render_markdown(result)  # type: ignore[arg-type]
    assert "| colocated | 4.40x | - |" in md
    assert "| kvtether | 5.45x | 1.00x / 1.10x (3) |" in md


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for argv, message in (
        (["--compress", "0"], "--compress must be > 0"),
        (["--sessions", "0"], "--sessions must be at least 1"),
        (["--scenario", str(tmp_path / "none.json")], "does not exist"),
    ):
        with pytest.raises(SystemExit) as exc:
            compare.main(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


def test_generate_writes_a_scenario(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.json"
    assert compare.generate_main(["--out", str(out), "--sessions", "3", "--seed", "5"]) == 0
    assert len(load_scenario(out).sessions) == 3
    assert "sessions 3" in capsys.readouterr().out


# --- the real thing, small -------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.timeout(1800)
def test_a_small_real_run_of_every_strategy(tmp_path: Path) -> None:
    """The CI smoke test: every strategy replays the same small scenario on real vLLM."""
    out = tmp_path / "out"
    code = compare.main([
        "--profile", "cpu-tiny", "--sessions", "2", "--turns", "3", "3", "--seed", "1",
        "--context-tokens", "700", "--system-tokens", "200", "--max-output-tokens", "16",
        "--long-tools", "1", "--compress", "30", "--stream-fraction", "0.5",
        "--port", "8800", "--state-dir", str(tmp_path / "state"), "--out", str(out),
    ])
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    s = data["summary"]
    assert list(s) == ["colocated", "colocated-instance", "colocated-dp", "pd-oneway",
                       "pd-upstream", "kvtether"]
    # Every colocated deployment has the P/D stack's cores; colocated-dp one engine per core,
    # each conversation kept on one replica (its prefix cache serves the later turns).
    detail = data["strategies"]
    assert detail["colocated"]["cores"] == detail["kvtether"]["cores"] == "0-1"
    assert detail["colocated-instance"]["cores"] == "0"
    assert (detail["colocated-dp"]["cores"], detail["colocated-dp"]["instances"]) == ("0-1", 2)
    assert s["colocated-dp"]["reused_tokens"] > 0
    for name, m in s.items():
        assert m["turns"] == 6 and m["failed_turns"] == 0, name
        assert m["eligible_turns"] >= 1 and m["ttft_turns"] >= 1, name
        assert 0 <= m["fired_turns"] <= m["eligible_turns"] <= 4, name
        turns = data["strategies"][name]["turns"]
        assert m["recomputed_tokens"] == sum(t["prompt_tokens"] - t["reused_tokens"]
                                             for t in turns)
    # Reuse where the strategies say it should and should not happen.
    assert s["pd-oneway"]["fired_turns"] == 0
    assert s["kvtether"]["fired_turns"] == s["kvtether"]["eligible_turns"]
    assert s["kvtether"]["divergent_outputs"] == 0
    # The router's own label agrees with the bench's arithmetic for kvtether.
    assert s["kvtether"]["router_fired_turns"] == s["kvtether"]["fired_turns"]
    assert s["pd-upstream"]["retained_kv_token_s"] > 0
    assert {p.name for p in out.iterdir()} >= {"results.json", "results.md", "scenario.json",
                                               "reuse_by_turn.png", "ttft_cdf.png",
                                               "retained_kv.png", "ttft_tpot.png"}
    # The figures a user decides with, beside TTFT: every strategy streamed some turns 2+ and
    # its processes used CPU; the P/D strategies moved KV from prefill to decode.
    for name, m in s.items():
        assert m["tpot_turns"] >= 1 and m["tpot_p50_s"] > 0, name
        assert m["core_s_per_turn"] > 0, name
    for name in ("pd-oneway", "pd-upstream", "kvtether"):
        assert s[name]["kv_p2d_bytes"] > 0, name
    # Read times come from the kvtether router's turn records (pd-oneway runs on vllm-router).
    for name in ("pd-upstream", "kvtether"):
        assert s[name]["kv_p2d_read_p50_s"] is not None, name
    assert s["kvtether"]["kv_bytes_per_token"] > 0
    assert s["kvtether"]["kv_d2p_bytes"] is not None  # 0 where every reuse was local
    assert s["colocated"]["kv_p2d_bytes"] is None
    assert not list((tmp_path / "state").glob("*/stack.json"))  # every stack stopped


async def test_the_client_side_of_a_turn_is_timed_against_the_router_s_record() -> None:
    import httpx

    from kvtether import protocol as p
    from kvtether.bench.replay import _attach_timings

    record = p.TurnRecord(turn=1, outcome="fired", stream=True, ttft_s=0.5,
                          started_unix_s=1000.01,
                          timings=p.TurnTimings(router_wait_s=0.002, decode_first_token_s=0.49))
    status = p.SessionStatus(conversation_id="c", decode_instance="d0", retained_tokens=0,
                             lease_deadline_unix_s=None, lease_state="none",
                             turns=[record, record.model_copy(update={"turn": 2})])

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/sessions/c"
        return httpx.Response(200, json=status.model_dump(mode="json"))

    streamed = TurnResult(session="s", turn=1, stream=True, started_s=0.0, ttft_s=0.56)
    whole = TurnResult(session="s", turn=2, stream=False, started_s=1.0, latency_s=2.0)
    other = TurnResult(session="t", turn=1, stream=True, started_s=0.0, ttft_s=9.0)
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
        await _attach_timings(http, "http://router", "c", "s", [streamed, whole, other],
                              {1: 1000.0, 2: 1001.0})
    # Sent at 1000.0, read by the router at 1000.01, relayed its first token at 1000.51, which
    # the client parsed at 1000.56.
    assert streamed.timings == {"router_wait": 0.002, "decode_first_token": 0.49,
                                "client_to_router": 0.01, "router_to_client": 0.05}
    assert whole.timings == {"router_wait": 0.002, "decode_first_token": 0.49}  # no TTFT
    assert other.timings is None  # another session's turn
