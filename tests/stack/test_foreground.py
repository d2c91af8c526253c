"""`kvtether stack up` in the foreground (fake instances): Ctrl-C, SIGTERM, `stack down` from
another shell, a crash of the `up` process itself, and an instance dying while up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvtether.stack._state import load_state, state_path
from kvtether.stack.launcher import stack_down
from kvtether.stack.settings import StackSettings
from tests.support.waiting import wait_for

from .stack_fakes import all_dead, pids_from

DRIVER = Path(__file__).with_name("fake_stack_up.py")


def _terminal_signals() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Foreground:
    def __init__(self, settings: StackSettings, tmp_path: Path, **behaviour: dict[str, str]):
        self.settings = settings
        self.pid_file = tmp_path / "pids"
        self.out = tmp_path / "up.out"
        env_all = {"FAKE_CHILD": "1", "FAKE_PID_FILE": str(self.pid_file)}
        behaviour = {**behaviour, "*": {**env_all, **behaviour.get("all", {})}}
        with open(self.out, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(DRIVER), settings.model_dump_json(), json.dumps(behaviour)],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=DRIVER.parent,
                # As from a terminal: a test run under nohup, or as a background job, would
                # pass SIGHUP or SIGINT on as ignored.
                preexec_fn=_terminal_signals,
            )

    def wait_running(self, timeout_s: float = 60) -> None:
        def running() -> bool:
            state = load_state(self.settings.state_dir)
            if state is not None and state.phase == "running":
                return True
            assert self.proc.poll() is None, self.output()
            return False

        wait_for(running, timeout_s, interval_s=0.1,
                 message=lambda: "the stack to come up:\n" + self.output())

    def exit_code(self, timeout_s: float = 60) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # and its stack: never leave fakes behind for the next test
            stack_down(self.settings.state_dir, stop_timeout_s=3)
            raise AssertionError(f"`stack up` did not exit in {timeout_s} s:\n{self.output()}")

    def output(self) -> str:
        return self.out.read_text()

    def pids(self) -> list[int]:
        return pids_from(self.pid_file)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_stops_everything(sig: int, fake_settings: StackSettings, tmp_path: Path) -> None:
    up = Foreground(fake_settings, tmp_path)
    up.wait_running()
    pids = up.pids()
    assert len(pids) == 6
    up.proc.send_signal(sig)
    assert up.exit_code() == 0, up.output()
    assert all_dead(pids)
    assert not state_path(fake_settings.state_dir).exists()
    assert "stopped" in up.output()


def test_stack_down_from_another_shell_stops_a_foreground_stack(
    fake_settings: StackSettings, tmp_path: Path
) -> None:
    up = Foreground(fake_settings, tmp_path)
    up.wait_running()
    stack_down(fake_settings.state_dir, stop_timeout_s=3)
    assert up.exit_code() == 0, up.output()
    assert all_dead(up.pids())


def test_killed_up_process_takes_its_instances_along(
    fake_settings: StackSettings, tmp_path: Path
) -> None:
    up = Foreground(fake_settings, tmp_path)
    up.wait_running()
    os.kill(up.proc.pid, signal.SIGKILL)
    up.exit_code()
    pids = up.pids()
    wait_for(lambda: all_dead(pids), timeout_s=10, interval_s=0.1, message=f"{pids} to exit")
    stack_down(fake_settings.state_dir)  # cleans the leftover state file
    assert not state_path(fake_settings.state_dir).exists()


def test_ctrl_c_while_starting(fake_settings: StackSettings, tmp_path: Path) -> None:
    up = Foreground(fake_settings, tmp_path, all={"FAKE_BOOT_S": "30"})
    wait_for(lambda: len(up.pids()) >= 4, timeout_s=20, interval_s=0.1,
             message="prefill and decode with their children to start")
    up.proc.send_signal(signal.SIGINT)
    assert up.exit_code() == 130, up.output()
    assert all_dead(up.pids())
    assert not state_path(fake_settings.state_dir).exists()


def test_failure_while_starting_prints_the_log_tail(
    fake_settings: StackSettings, tmp_path: Path
) -> None:
    up = Foreground(fake_settings, tmp_path, **{"prefill-0": {"FAKE_EXIT_CODE": "7"}})
    assert up.exit_code() == 1
    out = up.output()
    assert "prefill-0 exited with code 7 while starting" in out
    assert "CUDA out of cheese" in out
    assert all_dead(up.pids())


def _record(settings: StackSettings, name: str):  # noqa: ANN202
    state = load_state(settings.state_dir)
    assert state is not None
    return next(p for p in state.processes if p.name == name)


def test_instance_crash_stops_the_stack_without_restart(
    fake_settings: StackSettings, tmp_path: Path
) -> None:
    up = Foreground(fake_settings.model_copy(update={"restart": False}), tmp_path)
    up.wait_running()
    os.kill(_record(fake_settings, "decode-0").pid, signal.SIGKILL)
    assert up.exit_code() == 1, up.output()
    assert "decode-0 exited unexpectedly" in up.output()
    assert all_dead(up.pids()), up.output()


def test_a_killed_instance_is_restarted_and_serves_again(
    fake_settings: StackSettings, tmp_path: Path
) -> None:
    import httpx

    settings = fake_settings.model_copy(update={"restart_backoff_s": 0.2})
    up = Foreground(settings, tmp_path)
    up.wait_running()
    old = _record(settings, "decode-0")
    os.kill(old.pid, signal.SIGKILL)
    wait_for(lambda: "decode-0 is back" in up.output(), timeout_s=30, interval_s=0.1,
             message=up.output)
    new = _record(settings, "decode-0")
    assert new.pid != old.pid and new.port == old.port
    assert httpx.get(f"{new.url}/health", timeout=5).status_code == 200
    out = up.output()
    assert "decode-0 exited unexpectedly (code -9); restarting it" in out
    assert "restarting decode-0 in 0.2 s" in out
    assert up.proc.poll() is None  # the stack stays up
    # The dead instance's child (vLLM's engine core) is gone, not orphaned.
    pids = up.pids()
    up.proc.send_signal(signal.SIGINT)
    assert up.exit_code() == 0, up.output()
    assert all_dead(pids), up.output()
    assert new.log_path.read_text().count("decode-0: booting") == 2  # the crash's log is kept


def test_an_instance_that_cannot_come_back_is_given_up_with_back_off(
    fake_settings: StackSettings, tmp_path: Path
) -> None:
    settings = fake_settings.model_copy(update={
        "restart_backoff_s": 0.1, "restart_backoff_max_s": 0.3, "restart_max_failures": 4})
    up = Foreground(settings, tmp_path, **{"decode-0": {"FAKE_ONCE_FILE": str(tmp_path / "once")}})
    up.wait_running()
    os.kill(_record(settings, "decode-0").pid, signal.SIGKILL)
    assert up.exit_code() == 1, up.output()
    out = up.output()
    # Each failed restart doubles the wait, up to the cap.
    delays = [line.split(" in ")[1].split(" s")[0] for line in out.splitlines()
              if line.startswith("restarting decode-0 in")]
    assert delays == ["0.1", "0.2", "0.3"], out
    assert out.count("restart of decode-0 failed: exited with code 9 while starting") == 3
    assert "decode-0 failed 4 times within 600 s; giving up" in " ".join(out.split())
    assert "cannot come back" in out  # the log tail
    assert all_dead(up.pids()), out
    assert not state_path(settings.state_dir).exists()
