"""Growth prediction, scored on synthetic agent sessions shaped by published measurements."""

from __future__ import annotations

import pytest
from openai import OpenAI

from kvtether.bench.workload import generate_sessions, score_predictions, workload_stats
from kvtether.protocol import Phase, parse_hints_header
from kvtether.session import GrowthPredictor, Session, tool_key
from tests.support.fake_router import FakeRouter


def test_workload_is_deterministic_and_scalable() -> None:
    assert generate_sessions(3, seed=5) == generate_sessions(3, seed=5)
    assert generate_sessions(3, seed=5) != generate_sessions(3, seed=6)
    full, fast = (
        generate_sessions(2, seed=1)[1],
        generate_sessions(2, seed=1, time_scale=0.01, token_scale=0.1)[1],
    )
    assert [s.action for s in full.steps] == [s.action for s in fast.steps]
    assert fast.steps[3].gap_s == pytest.approx(full.steps[3].gap_s * 0.01)
    assert all(12 <= len(s.steps) <= 60 for s in generate_sessions(50))


def test_workload_matches_the_published_shapes() -> None:
    stats = workload_stats(generate_sessions(300, seed=3))
    assert 0.2 <= stats["tool_p50_s"] <= 0.4  # TraceLab: 0.3 s
    assert 9 <= stats["tool_p90_s"] <= 18  # 13.6 s
    assert 150 <= stats["tool_p99_s"] <= 300  # 3.6 min
    assert 650 <= stats["growth_p50_tokens"] <= 1000  # ~700-950 tokens
    assert 2500 <= stats["growth_p90_tokens"] <= 8000  # 3-8K


def test_predictions_beat_the_naive_baseline() -> None:
    scores = score_predictions(generate_sessions(60, seed=11))
    tool, request = scores["tool"], scores["request"]
    # While a tool runs (tool known): half the naive token error, a third of its gap error.
    assert tool.tokens_mape < 0.6 * tool.tokens_mape_naive
    assert tool.gap_median_abs_log_ratio < 0.6 * tool.gap_median_abs_log_ratio_naive
    assert tool.gap_median_abs_error_s < 0.5 * tool.gap_median_abs_error_naive_s
    # At request time (next tool unknown) still better than "next = current".
    assert request.tokens_mape < request.tokens_mape_naive
    assert request.gap_median_abs_log_ratio < request.gap_median_abs_log_ratio_naive


def test_commands_of_one_tool_are_told_apart() -> None:
    predictor = GrowthPredictor()
    for _ in range(3):
        predictor.observe_tool(tool_key("bash", {"command": "pytest -x"}), 40.0)
        predictor.observe_tool(tool_key("bash", ["ls -la"]), 0.1)
    assert predictor.tool_duration_s("bash:pytest") > 20
    assert predictor.tool_duration_s("bash:ls") < 0.5
    # An unseen command starts from what the tool did in general.
    assert 0.5 < predictor.tool_duration_s("bash:make") < 20


def test_unseen_tools_start_from_a_prior_and_learn() -> None:
    predictor = GrowthPredictor()
    assert predictor.tool_duration_s("run_tests") > predictor.tool_duration_s("read_file")
    for _ in range(10):
        predictor.observe_tool("deploy", 120.0)
    assert predictor.tool_duration_s("deploy") == pytest.approx(120, rel=0.3)


def test_a_conversation_of_ever_new_tools_stays_bounded() -> None:
    predictor = GrowthPredictor()
    for i in range(5000):
        predictor.observe_tool(f"mcp_tool_{i}", 5.0)
        predictor.observe_tool("deploy", 120.0)
        predictor.observe_turn(1000 + 20 * i, 10, called_tools=True)
    assert max(len(predictor._duration), len(predictor._appended)) <= 512
    # Tools used lately keep what they learned; the long-unused fall back to their prior.
    assert predictor.tool_duration_s("deploy") == pytest.approx(120, rel=0.3)
    prior_s = GrowthPredictor().tool_duration_s("mcp_tool")
    assert predictor.tool_duration_s("mcp_tool_4999") > 5 * prior_s  # one 5 s run, shrunk
    assert predictor.tool_duration_s("mcp_tool_0") == pytest.approx(prior_s)
    for _ in range(5000):  # tools, and no reply to learn their growth from
        predictor.observe_tool("grep", 0.1)
    assert len(predictor._pending_tools) <= 64


def test_a_tool_past_its_estimate_is_expected_to_run_on() -> None:
    predictor = GrowthPredictor()
    assert predictor.at_tool("grep", elapsed_s=60).next_turn_gap_s >= 30
    assert predictor.at_tool("grep", eta_s=10, elapsed_s=4).next_turn_gap_s == pytest.approx(6)


def test_next_prompt_includes_the_reply_and_the_typical_tool_result() -> None:
    predictor = GrowthPredictor()
    predictor.observe_turn(1000, 100, called_tools=True)
    predictor.observe_tool("read_file", 0.1)
    predictor.observe_turn(2100, 50, called_tools=True)  # read_file appended 1000 tokens
    guess = predictor.at_tool("read_file")
    assert guess.next_prompt_tokens == pytest.approx(2100 + 50 + 1000, rel=0.1)
    assert guess.phase is Phase.TOOL_RUNNING


def test_hints_on_requests_learn_from_the_conversation(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    tools = [{"type": "function", "function": {"name": "grep", "parameters": {}}}]
    messages = [{"role": "user", "content": "go"}]
    call = {"id": "c1", "type": "function", "function": {"name": "grep", "arguments": "{}"}}
    router.replies.extend({"content": None, "tool_calls": [call]} for _ in range(3))
    for _ in range(2):
        client.chat.completions.create(model="fake", messages=messages, tools=tools)  # type: ignore
        with session.tool_call("grep"):
            pass
    client.chat.completions.create(model="fake", messages=messages, tools=tools)  # type: ignore
    hints = [
        parse_hints_header(r.headers["x-kvtether-hints"])
        for r in router.requests_to("/chat/completions")
    ]
    assert all(h.phase is Phase.TOOL_RUNNING for h in hints)  # the model keeps calling tools
    # The expected gap starts at the 0.3 s prior and then follows the tools' measured time
    # (~0 s here); test_state.py shows it moving to what tools take, on a fake clock.
    assert hints[0].next_turn_gap_s == pytest.approx(0.3)
    assert hints[-1].next_turn_gap_s is not None and hints[-1].next_turn_gap_s < 0.3
    assert session.turns[-1].predicted_prompt_tokens is not None
