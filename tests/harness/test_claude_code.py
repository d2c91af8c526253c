"""The Claude Code hook, fed the hook input Claude Code 2.1.332 really sent.

``claude_code_hooks.jsonl`` holds the stdin of every hook of two ``claude -p`` runs against a
scripted Messages server (paths shortened): one whose main agent launched a subagent that ran
Bash twice, one whose Bash call failed. Their model requests carried
``X-Claude-Code-Session-Id: <session_id>`` and, from the subagent, ``X-Claude-Code-Agent-Id:
<agent_id>``.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from starlette.datastructures import Headers

from kvtether import protocol as p
from kvtether.harness import HookSettings, _beater, _router, _state
from kvtether.harness.claude_code import conversation_id, main
from kvtether.router.identity import identify
from tests.support.fake_router import FakeRouter
from tests.support.waiting import wait_for

from .conftest import hold

OBSERVED = [json.loads(line) for line in
            (Path(__file__).with_name("claude_code_hooks.jsonl")).read_text().splitlines()]
MAIN = "108db399-25fd-4973-b62d-28b7f30a358f"
SUBAGENT = f"{MAIN}:agent:af6e6835cd648b931"
FAILED = "c819f83d-a50a-4ef1-84fa-59dbf1f56281"  # the run whose Bash call failed


def hook(event: Any) -> int:
    return main(io.StringIO(event if isinstance(event, str) else json.dumps(event)))


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str | None, Any]]:
    """Beaters the hook started, recorded instead of run: (conversation, tool, marker)."""
    calls: list[tuple[str, str | None, Any]] = []
    monkeypatch.setattr(_beater, "spawn", lambda settings, cid, marker, tool=None, pid=None:
                        calls.append((cid, tool, marker)))
    return calls


def observed(name: str, session: str = MAIN, agent: bool | None = None) -> dict[str, Any]:
    return next(e for e in OBSERVED if e["hook_event_name"] == name and e["session_id"] == session
                and (agent is None or ("agent_id" in e) == agent))


def test_the_hook_names_the_conversation_the_router_names_from_the_headers() -> None:
    for event in OBSERVED:
        headers = {"X-Claude-Code-Session-Id": event["session_id"]}
        if "agent_id" in event:
            headers["X-Claude-Code-Agent-Id"] = event["agent_id"]
        assert conversation_id(event) == identify(Headers(headers), {}).conversation_id


def test_the_observed_sessions_heartbeat_their_tools_and_release_at_the_end(
        router: FakeRouter, hook_env: dict[str, str], spawned: list[Any],
        capsys: pytest.CaptureFixture[str]) -> None:
    hold(router, MAIN, SUBAGENT, FAILED)
    assert [hook(event) for event in OBSERVED] == [0] * len(OBSERVED)

    assert [(cid, tool) for cid, tool, _ in spawned] == [
        (MAIN, "Agent"), (SUBAGENT, "Bash"), (SUBAGENT, "Bash"), (FAILED, "Bash")]
    assert not any(marker.running() for _, _, marker in spawned)  # every tool ended
    # The subagent is released when it stops, the failed run's session when it ends; the main
    # session's run ended without a SessionEnd (the recording stopped first).
    assert [(r.method, r.path) for r in router.received] == [
        ("DELETE", f"/v1/sessions/{SUBAGENT}"), ("DELETE", f"/v1/sessions/{FAILED}")]
    assert router.conversations[SUBAGENT].state == "released"
    assert router.conversations[MAIN].state == "active"
    assert capsys.readouterr() == ("", "")


def test_a_real_beater_heartbeats_while_the_tool_runs_and_stops_when_it_ends(
        router: FakeRouter, hook_env: dict[str, str], state_dir: Path) -> None:
    hold(router, FAILED)
    router.lease_remaining_s = 1.5  # a heartbeat every 0.5 s
    start, end = observed("PreToolUse", FAILED), observed("PostToolUseFailure", FAILED)

    def run_hook(event: dict[str, Any]) -> None:
        # It returns while the beater runs on (one that waited for the tool would time out).
        done = subprocess.run([sys.executable, "-m", "kvtether.harness", "claude-code"],
                              input=json.dumps(event), capture_output=True, text=True,
                              timeout=60)
        assert (done.returncode, done.stdout, done.stderr) == (0, "", "")

    def beats() -> list[Any]:
        return router.requests_to("/heartbeat")

    run_hook(start)
    wait_for(lambda: len(beats()) >= 3, timeout_s=30, message="three heartbeats")
    assert {json.dumps(b.body) for b in beats()} == {
        json.dumps({"phase": "tool_running", "tool_name": "Bash"})}
    assert all(b.path == f"/v1/sessions/{FAILED}/heartbeat" for b in beats())
    run_hook(end)
    wait_for(lambda: not any(state_dir.rglob("*.*")), timeout_s=10,
             message="the beater to clear its markers and exit")
    count = len(beats())
    time.sleep(1.5)
    assert len(beats()) == count


def test_a_tool_that_ended_before_its_start_hook_ran_gets_no_beater(
        hook_env: dict[str, str], spawned: list[Any]) -> None:
    # Claude Code runs the (async) start hook in the background: it may come last.
    assert hook(observed("PostToolUseFailure", FAILED)) == 0
    assert hook(observed("PreToolUse", FAILED)) == 0
    assert spawned == []
    assert hook(observed("PreToolUse", FAILED)) == 0  # a later call with the same id: runs
    assert len(spawned) == 1


def test_session_end_stops_its_subagents_beaters_and_releases_them_too(
        router: FakeRouter, settings: HookSettings, spawned: list[Any]) -> None:
    hold(router, MAIN, SUBAGENT)
    assert hook(observed("PreToolUse", MAIN, agent=True)) == 0  # the subagent's Bash call
    [(_, _, marker)] = spawned
    assert marker.running()
    assert hook({**observed("SessionEnd", FAILED), "session_id": MAIN}) == 0
    assert not marker.running()
    assert _state.session_conversations(settings, MAIN) == []
    assert [(r.method, r.path) for r in router.received] == [
        ("DELETE", f"/v1/sessions/{SUBAGENT}"), ("DELETE", f"/v1/sessions/{MAIN}")]


def test_release_sends_the_api_key(router: FakeRouter, hook_env: dict[str, str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    hold(router, FAILED)
    monkeypatch.setenv("KVTETHER_API_KEY", "sk-hook")
    assert hook(observed("SessionEnd", FAILED)) == 0
    [delete] = router.received
    assert delete.headers["authorization"] == "Bearer sk-hook"


@pytest.mark.parametrize("status", [404, 410, 500])
def test_a_router_without_the_kv_is_no_error(router: FakeRouter, hook_env: dict[str, str],
                                             status: int, capsys: pytest.CaptureFixture[str]
                                             ) -> None:
    hold(router, FAILED)
    router.delete_status = status
    assert hook(observed("SessionEnd", FAILED)) == 0
    assert len(router.received) == 1
    assert capsys.readouterr() == ("", "")


def test_a_router_that_is_down_is_no_error(dead_url: str, hook_env: dict[str, str],
                                           monkeypatch: pytest.MonkeyPatch, spawned: list[Any],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVTETHER_URL", dead_url)
    assert [hook(event) for event in OBSERVED] == [0] * len(OBSERVED)
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("stdin", [
    "", "not json", "[1, 2]", "null", json.dumps({"hook_event_name": 5}),
    json.dumps({"hook_event_name": "PreToolUse", "tool_use_id": "t"}),  # no session
    json.dumps({"hook_event_name": "PreToolUse", "session_id": "s", "tool_use_id": 7}),
    json.dumps({"hook_event_name": "SessionEnd", "session_id": ["s"]}),
])
def test_input_that_is_no_hook_event_is_ignored(stdin: str, router: FakeRouter,
                                                hook_env: dict[str, str], spawned: list[Any],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert hook(stdin) == 0
    assert (spawned, router.received) == ([], [])
    assert len(capsys.readouterr().err.splitlines()) <= 1


def test_a_state_folder_it_cannot_use_costs_the_heartbeats_not_the_tool(
        hook_env: dict[str, str], state_dir: Path, spawned: list[Any],
        capsys: pytest.CaptureFixture[str]) -> None:
    state_dir.write_text("a file where the folder should be")
    assert hook(observed("PreToolUse", FAILED)) == 0
    assert spawned == []
    assert "kvtether hook:" in capsys.readouterr().err


def test_the_heartbeat_body_is_the_protocols() -> None:
    assert _router.TOOL_RUNNING == p.Phase.TOOL_RUNNING.value
    limit = p.HeartbeatRequest.model_fields["tool_name"].metadata
    assert any(getattr(m, "max_length", None) == _router._MAX_TOOL_NAME for m in limit)
    p.HeartbeatRequest.model_validate({"phase": _router.TOOL_RUNNING, "tool_name": "x" * 200})


def test_the_module_entry_point_never_blocks_a_tool(router: FakeRouter,
                                                    hook_env: dict[str, str]) -> None:
    # Exit code 2 from a PreToolUse hook would block the tool call in Claude Code.
    for argv in (["claude-code"], [], ["nonsense"]):
        done = subprocess.run([sys.executable, "-m", "kvtether.harness", *argv],
                              input="garbage", capture_output=True, text=True, timeout=60)
        assert done.returncode in (0, 1), done
