"""Bounded records: a conversation that never ends lists only its last turns, tool runs and
events (``max_turn_records``), while its totals and report still count every turn.

The long conversation is driven at the state level, as the transport reports it, on a fake
clock: thousands of turns in well under a second.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai import AsyncOpenAI, OpenAI

from kvtether.errors import ConfigError
from kvtether.protocol import HEADER_REUSABLE_TOKENS, HEADER_REUSE, HEADER_REUSED_TOKENS
from kvtether.session import (
    AsyncSession,
    EventKind,
    Session,
    SessionPool,
    SessionSettings,
    SessionTotals,
)
from kvtether.session._heartbeat import Beat, HeartbeatPlan
from kvtether.session._report import format_report
from kvtether.session._state import SessionState
from kvtether.session._tools import ToolCall
from tests.support.fake_router import FAST, FakeRouter

TURNS = 3000
KEPT = 200
TOOLS = [{"type": "function", "function": {"name": "grep", "parameters": {}}}]
BODY: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "go"}],
                        "tools": TOOLS}
CALL = {"id": "c1", "type": "function", "function": {"name": "grep", "arguments": "{}"}}
REPLY = json.dumps({
    "choices": [{"message": {"role": "assistant", "tool_calls": [CALL]},
                 "finish_reason": "tool_calls"}],
    "usage": {"prompt_tokens": 100, "completion_tokens": 10},
}).encode()


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def no_heartbeat(plan: HeartbeatPlan, in_task: bool) -> Beat:
    raise AssertionError("no base_url, no session API: nothing should start a heartbeat")


def converse(max_turn_records: int) -> SessionState:
    """``TURNS`` turns: every 10th fails with no answer (an event), every 7th misses with its KV
    evicted, the rest fire; every 3rd runs a 0.5 s tool, and one tool runs from turn 5 to turn
    2001, long after its turn stopped being listed."""
    clock = FakeClock()
    settings = SessionSettings(max_turn_records=max_turn_records)
    state = SessionState("kvt-long", settings, clock=clock)
    size = len(json.dumps(BODY))
    long_build: ToolCall | None = None
    for i in range(1, TURNS + 1):
        ex = state.begin("chat", BODY, size, injected_usage=False, retry=0)
        if i % 10 == 0:
            ex.end(completed=False, error=ConnectionError("router down"))
            continue
        reuse = "miss:first_turn" if i == 1 else "miss:evicted" if i % 7 == 0 else "fired"
        ex.on_headers(200, {
            HEADER_REUSE: reuse,
            HEADER_REUSED_TOKENS: "90" if reuse == "fired" else "0",
            HEADER_REUSABLE_TOKENS: "0" if i == 1 else "90",
        })
        ex.feed(REPLY)
        ex.end(completed=True)
        if i == 5:
            long_build = ToolCall(state, no_heartbeat, "build")
            long_build.begin()
        if i == 2001 and long_build is not None:
            long_build.end()
        if i % 3 == 0:
            with ToolCall(state, no_heartbeat, "grep"):
                clock.now_s += 0.5
    return state


@pytest.fixture(scope="module")
def bounded() -> SessionState:
    return converse(KEPT)


@pytest.fixture(scope="module")
def unbounded() -> SessionState:
    return converse(TURNS)  # room for every record: nothing is ever dropped


def test_a_long_conversation_lists_only_its_last_records(
    bounded: SessionState, unbounded: SessionState
) -> None:
    assert [t.turn for t in bounded.turns()] == list(range(TURNS - KEPT + 1, TURNS + 1))
    assert len(unbounded.turns()) == TURNS
    runs, all_runs = bounded.tool_runs(), unbounded.tool_runs()
    assert len(runs) == KEPT and len(all_runs) > KEPT
    assert [(r.name, r.after_turn) for r in runs] == [
        (r.name, r.after_turn) for r in all_runs[-KEPT:]
    ]
    events = bounded.events()
    assert len(events) == KEPT and all(e.kind is EventKind.REQUEST_FAILED for e in events)
    assert events[-1].turn == TURNS


def test_totals_count_every_turn_as_an_unbounded_session_would(
    bounded: SessionState, unbounded: SessionState
) -> None:
    totals = bounded.totals()
    failed = TURNS // 10
    assert totals == SessionTotals(
        turns=TURNS,
        unlisted_turns=TURNS - KEPT,
        fired=unbounded.totals().fired,
        eligible=TURNS - failed - 1,  # all answered turns but the first
        errors=failed,
        reused_tokens=90 * unbounded.totals().fired,
        prompt_tokens=100 * (TURNS - failed),
        output_tokens=10 * (TURNS - failed),
        tool_time_s=pytest.approx(unbounded.totals().tool_time_s),  # type: ignore[arg-type]
        tool_runs=len(unbounded.tool_runs()),
        unlisted_tool_runs=len(unbounded.tool_runs()) - KEPT,
        events={EventKind.REQUEST_FAILED: failed},
        unlisted_events=failed - KEPT,
    )
    unbounded_totals = unbounded.totals()
    assert unbounded_totals.unlisted_turns == unbounded_totals.unlisted_events == 0
    assert totals.fired == sum(t.fired for t in unbounded.turns())
    # 0.5 s after every 3rd answered turn, plus the build that ran from turn 5 to turn 2001.
    grep_s = 0.5 * sum(1 for i in range(3, TURNS + 1, 3) if i % 10)
    build_s = 0.5 * sum(1 for i in range(6, 2001, 3) if i % 10)
    assert totals.tool_time_s == pytest.approx(grep_s + build_s)


def test_the_report_summarizes_every_turn_and_lists_the_last(bounded: SessionState) -> None:
    turns, totals = bounded.report_records()
    lines = format_report(bounded.conversation_id, None, turns, totals).splitlines()
    rows = lines[2:2 + KEPT]
    assert rows[0].split()[0] == str(TURNS - KEPT + 1) and rows[-1].split()[0] == str(TURNS)
    summary = lines[2 + KEPT]
    assert summary.startswith(f"fired {totals.fired:,}/2,699 eligible turns (")
    assert "3,000 in all, 300 failed, the first 2,800 not listed · " in summary
    assert f"reused {totals.reused_tokens:,} of 270,000 prompt tokens" in summary
    assert summary.endswith(f"tool time {totals.tool_time_s:.1f} s")
    assert lines[-1] == "events: request_failed x300"


def test_a_session_through_the_router_keeps_its_last_turns(
    router: FakeRouter, base_client: OpenAI
) -> None:
    settings = FAST.model_copy(update={"max_turn_records": 3})
    with Session(router.url, settings=settings) as session:
        client = session.wrap(base_client)
        for _ in range(8):
            client.chat.completions.create(model="fake", messages=[{"role": "user",
                                                                     "content": "hi"}])
            with session.tool_call("grep"):
                pass
        assert [t.turn for t in session.turns] == [6, 7, 8]
        assert len(session.tool_runs) == 3
        totals = session.totals
        assert (totals.turns, totals.unlisted_turns, totals.fired, totals.tool_runs) == (8, 5, 7, 8)
        summary = session.report().splitlines()[5]
        assert summary.startswith("fired 7/7 eligible turns (100%), 8 in all, the first 5 not "
                                  f"listed · reused {totals.reused_tokens:,} of ")


def test_a_pooled_conversation_keeps_its_last_records_and_counts_every_turn(
    router: FakeRouter, base_client: OpenAI
) -> None:
    # A pooled conversation is the one that may never end: an agent's thread, turn after turn.
    settings = FAST.model_copy(update={"max_turn_records": 3})
    with SessionPool(router.url, settings=settings) as pool:
        client = pool.wrap(base_client, lambda: "agent-thread")
        for i in range(1, 9):
            call = {**CALL, "id": f"call-{i}"}
            router.replies.append({"content": None, "tool_calls": [call]})
            client.chat.completions.create(model="fake", messages=[{"role": "user",
                                                                     "content": "hi"}])
            assert pool.begin_tool(f"run-{i}", "grep", tool_call_id=f"call-{i}") is not None
            pool.end_tool(f"run-{i}")
        session = pool.get("agent-thread")
        assert [t.turn for t in session.turns] == [6, 7, 8]
        assert [r.after_turn for r in session.tool_runs] == [6, 7, 8]
        assert len(session.events) <= 3
        totals = session.totals
        assert (totals.turns, totals.unlisted_turns, totals.fired, totals.eligible) == (8, 5, 7, 7)
        assert (totals.tool_runs, totals.unlisted_tool_runs) == (8, 5)
        assert "8 in all, the first 5 not listed" in session.report()


async def test_the_async_twin_takes_the_bound_from_the_environment(
    router: FakeRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTETHER_SESSION_MAX_TURN_RECORDS", "2")
    base = AsyncOpenAI(base_url=router.url + "/v1", api_key="t", max_retries=0)
    async with AsyncSession(router.url) as session:
        client = session.wrap(base)
        for _ in range(4):
            await client.chat.completions.create(model="fake", messages=[{"role": "user",
                                                                           "content": "hi"}])
        assert [t.turn for t in session.turns] == [3, 4]
        assert session.totals.turns == 4 and "4 in all, the first 2 not listed" in (
            session.report()
        )
    await base.close()


def test_a_bound_below_one_record_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTETHER_SESSION_MAX_TURN_RECORDS", "0")
    with pytest.raises(ConfigError, match="max_turn_records"):
        Session()
