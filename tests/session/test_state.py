"""SessionState on a fake clock: tool durations and turn gaps are measured with the state's
clock, so these tests advance it instead of sleeping."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvtether.protocol import HEADER_REUSE, Phase
from kvtether.session import SessionSettings, ToolRun
from kvtether.session._exchange import Exchange
from kvtether.session._heartbeat import Beat, HeartbeatPlan
from kvtether.session._state import SessionState
from kvtether.session._tools import ToolCall

TOOLS = [{"type": "function", "function": {"name": "grep", "parameters": {}}}]
MESSAGES = [{"role": "user", "content": "go"}]
CALL = {"id": "c1", "type": "function", "function": {"name": "grep", "arguments": "{}"}}


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def no_heartbeat(plan: HeartbeatPlan, in_task: bool) -> Beat:
    raise AssertionError("no lease, no session API: nothing should start a heartbeat")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def state(clock: FakeClock) -> SessionState:
    return SessionState("kvt-test", SessionSettings(), clock=clock)


def model_turn(state: SessionState) -> Exchange:
    """One chat request as the transport reports it: a tool-calling reply, via a router."""
    body: dict[str, Any] = {"model": "m", "messages": MESSAGES, "tools": TOOLS}
    ex = state.begin("chat", body, len(json.dumps(body)), injected_usage=False, retry=0)
    ex.on_headers(200, {HEADER_REUSE: "miss:first_turn"})
    reply = {
        "choices": [
            {"message": {"role": "assistant", "tool_calls": [CALL]}, "finish_reason": "tool_calls"}
        ],
        "usage": {"prompt_tokens": 100, "completion_tokens": 10},
    }
    ex.feed(json.dumps(reply).encode())
    ex.end(completed=True)
    return ex


def tool(state: SessionState, clock: FakeClock, duration_s: float) -> ToolRun:
    with ToolCall(state, no_heartbeat, "grep") as run:
        clock.now_s += duration_s
    return run


def test_tool_time_on_the_clock_moves_the_expected_gap(
    state: SessionState, clock: FakeClock
) -> None:
    hints = []
    for _ in range(2):
        hints.append(model_turn(state).hints)
        tool(state, clock, 0.6)
    hints.append(model_turn(state).hints)
    assert all(h is not None and h.phase is Phase.TOOL_RUNNING for h in hints)
    # From the 0.3 s prior to the 0.6 s that tools took here.
    assert hints[0] is not None and hints[0].next_turn_gap_s == pytest.approx(0.3)
    assert hints[-1] is not None and hints[-1].next_turn_gap_s >= 0.5
    assert [run.duration_s for run in state.tool_runs()] == pytest.approx([0.6, 0.6])
    assert state.turns()[-1].predicted_prompt_tokens is not None


def test_tool_runs_and_gaps_are_measured_on_the_clock(
    state: SessionState, clock: FakeClock
) -> None:
    model_turn(state)
    run = tool(state, clock, 42.0)
    clock.now_s += 3.0  # the agent thinks before the next request
    model_turn(state)
    first, second = state.turns()
    assert run.duration_s == 42.0 and run.after_turn == 1 and run.ok
    assert first.tools == ["grep"] and first.tool_time_s == 42.0
    assert first.gap_before_s is None and second.gap_before_s == 45.0


def test_a_turn_through_a_router_opens_the_lease_and_release_closes_it(
    state: SessionState,
) -> None:
    assert not state.has_lease and state.release_url() is None
    model_turn(state)
    assert state.has_lease
    state.adopt_base_url("http://r:1")
    assert state.release_url() == "http://r:1/v1/sessions/kvt-test"
    state.release_answered(204, "HTTP 204")
    assert state.released and state.release_url() is None
