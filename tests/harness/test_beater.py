"""The beater's rules, on a simulated clock: when it starts, how often it beats, what stops it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from kvtether.harness import HookSettings, _state
from kvtether.harness._beater import beat
from kvtether.harness._router import Reply

CID = "conv-1"


@dataclass
class Script:
    """A simulated clock and router: ``replies`` answer the heartbeats in turn (the last one
    repeats); ``at`` runs a callback once the clock passes its time."""

    replies: list[Reply]
    at: dict[float, Callable[[], None]] = field(default_factory=dict)
    now: float = 0.0
    beats: list[float] = field(default_factory=list)

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
        for t in sorted(self.at):
            if t <= self.now:
                self.at.pop(t)()

    def heartbeat(self, conversation_id: str, tool_name: str | None = None) -> Reply:
        assert (conversation_id, tool_name) == (CID, "Bash")
        self.beats.append(round(self.now, 2))
        return self.replies[min(len(self.beats), len(self.replies)) - 1]


def lease(remaining_s: float) -> Reply:
    return Reply(200, {"lease_remaining_s": remaining_s})


@pytest.fixture
def settings(tmp_path) -> HookSettings:
    return HookSettings(router_url="http://unused", state_dir=tmp_path / "state",
                        max_lease_s=900.0)


def run(settings: HookSettings, script: Script, marker: _state.ToolMarker | None = None,
        watch_pid: int | None = None) -> int:
    marker = marker or _state.started(settings, CID, "toolu_1")
    assert marker is not None
    return beat(settings, CID, marker, tool_name="Bash", watch_pid=watch_pid,
                client=script, clock=script.clock, sleep=script.sleep)  # type: ignore[arg-type]


def end_tool(settings: HookSettings) -> Callable[[], None]:
    return lambda: _state.ended(settings, CID, "toolu_1")


def test_a_short_tool_is_never_heartbeated(settings: HookSettings) -> None:
    script = Script([lease(60)], at={0.9: end_tool(settings)})
    assert run(settings, script) == 0
    assert script.beats == []


def test_beats_a_second_in_then_three_times_per_lease_at_most_every_20_s(
        settings: HookSettings) -> None:
    script = Script([lease(30), lease(30), lease(90)], at={70.0: end_tool(settings)})
    assert run(settings, script) == len(script.beats)
    assert script.beats == [1.0, 11.0, 21.0, 41.0, 61.0]


def test_the_marker_files_are_gone_when_it_stops(settings: HookSettings) -> None:
    marker = _state.started(settings, CID, "toolu_1")
    assert marker is not None
    run(settings, Script([lease(60)], at={5.0: end_tool(settings)}), marker)
    assert not marker.run.exists() and not marker.done.exists()


@pytest.mark.parametrize("status", [400, 401, 404, 409, 410])
def test_stops_when_the_router_says_no_for_good(settings: HookSettings, status: int) -> None:
    script = Script([Reply(status)])
    assert run(settings, script) == 0
    assert script.beats == [1.0]


def test_keeps_trying_a_router_that_does_not_answer_until_the_tool_ends(
        settings: HookSettings) -> None:
    script = Script([Reply(None), Reply(503), lease(60)], at={50.0: end_tool(settings)})
    assert run(settings, script) == 1
    assert script.beats == [1.0, 21.0, 41.0]


def test_never_beats_longer_than_max_lease(settings: HookSettings) -> None:
    short = HookSettings(router_url="x", state_dir=settings.state_dir, max_lease_s=100.0)
    script = Script([lease(60)])  # the tool never ends
    run(short, script)
    assert script.beats == [1.0, 21.0, 41.0, 61.0, 81.0]
    assert script.now < 101.0


def test_stops_when_the_conversation_is_forgotten(settings: HookSettings) -> None:
    script = Script([lease(60)], at={30.0: lambda: _state.forget(settings, CID)})
    run(settings, script)
    assert script.beats == [1.0, 21.0]


def test_stops_when_the_harness_is_gone(settings: HookSettings) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    script = Script([lease(60)])
    assert run(settings, script, watch_pid=gone.pid) == 0
    assert script.now == 0.0
