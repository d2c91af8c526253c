"""Process management against a fake vLLM: start, health, state, stop, no orphans."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import psutil
import pytest

from kvtether.stack import _procs
from kvtether.errors import (
    InstanceFailedError,
    PortInUseError,
    StackAlreadyRunningError,
    StackNotRunningError,
)
from kvtether.stack._state import load_state, state_path
from kvtether.stack.launcher import Stack, stack_down, stack_status, warn_if_cores_shared
from kvtether.stack.settings import StackSettings
from tests.support.waiting import wait_for

from .stack_fakes import FakeCommands, all_dead, pids_from

pytestmark = pytest.mark.usefixtures("no_leaks")


def _with(settings: StackSettings, **update: object) -> StackSettings:
    return StackSettings.model_validate({**settings.model_dump(exclude_unset=True), **update})


def test_up_starts_every_process_records_it_and_down_leaves_nothing(
    fake_settings: StackSettings, tmp_path: Path
) -> None:
    pid_file = tmp_path / "pids"
    settings = _with(fake_settings, prefill=2, decode=2)
    commands = FakeCommands({"*": {"FAKE_CHILD": "1", "FAKE_PID_FILE": str(pid_file)}})
    with Stack(settings, commands=commands) as stack:
        state = load_state(settings.state_dir)
        assert state is not None and state.phase == "running"
        names = [p.name for p in state.processes]
        assert names == ["prefill-0", "prefill-1", "decode-0", "decode-1", "router"]
        assert stack.router_url == f"http://127.0.0.1:{settings.port}"
        assert len(set(p.side_channel_port for p in state.processes[:4])) == 4
        rows = stack_status(settings.state_dir)
        assert all(r.alive and r.healthy for r in rows)
        pids = pids_from(pid_file)
        assert len(pids) == 10  # 5 servers, each with an EngineCore-like child
        assert all((settings.state_dir / "logs" / f"{n}.log").exists() for n in names)
    assert all_dead(pids)
    assert not state_path(settings.state_dir).exists()


def test_router_gets_the_instance_urls(fake_settings: StackSettings) -> None:
    commands = FakeCommands()
    with Stack(_with(fake_settings, prefill=1, decode=2), commands=commands) as stack:
        router = next(p for p in commands.plans if p.role == "router")
        assert list(router.prefill_urls) == stack.prefill_urls
        assert list(router.decode_urls) == stack.decode_urls
        assert len(stack.decode_urls) == 2


def test_child_that_ignores_sigterm_is_killed(fake_settings: StackSettings, tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    behaviour = {"*": {"FAKE_CHILD": "stubborn", "FAKE_PID_FILE": str(pid_file)}}
    settings = _with(fake_settings, start_router=False, stop_timeout_s=0.5)
    stack = Stack(settings, commands=FakeCommands(behaviour)).up()
    pids = pids_from(pid_file)
    assert stack.down() == []
    assert all_dead(pids)


def test_instance_that_fails_while_starting_stops_the_others(
    fake_settings: StackSettings, tmp_path: Path
) -> None:
    pid_file = tmp_path / "pids"
    behaviour = {
        "*": {"FAKE_CHILD": "1", "FAKE_PID_FILE": str(pid_file), "FAKE_BOOT_S": "0.5"},
        "decode-0": {"FAKE_EXIT_CODE": "3", "FAKE_BOOT_S": "0.1"},
    }
    stack = Stack(_with(fake_settings, prefill=2), commands=FakeCommands(behaviour))
    with pytest.raises(InstanceFailedError) as info:
        stack.up()
    assert info.value.name == "decode-0"
    assert "exited with code 3" in str(info.value)
    assert "CUDA out of cheese" in info.value.log_tail
    assert all_dead(pids_from(pid_file))
    assert not state_path(fake_settings.state_dir).exists()


def test_instance_that_never_gets_healthy_times_out(fake_settings: StackSettings) -> None:
    behaviour = {"prefill-0": {"FAKE_BOOT_S": "60"}}
    stack = Stack(_with(fake_settings, health_timeout_s=1.5), commands=FakeCommands(behaviour))
    with pytest.raises(InstanceFailedError, match="prefill-0 was not healthy after 2 s"):
        stack.up()


def test_port_in_use_fails_before_starting_anything(fake_settings: StackSettings) -> None:
    commands = FakeCommands()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", fake_settings.vllm_port(1)))
        busy.listen()
        with pytest.raises(PortInUseError, match=f"port {fake_settings.vllm_port(1)}.*decode-0"):
            Stack(fake_settings, commands=commands).up()
    assert commands.plans == []


def test_second_stack_on_same_state_dir_is_refused(fake_settings: StackSettings) -> None:
    with Stack(_with(fake_settings, start_router=False), commands=FakeCommands()):
        with pytest.raises(StackAlreadyRunningError, match="stack down"):
            Stack(fake_settings, commands=FakeCommands()).up()


def test_stale_state_file_is_replaced(fake_settings: StackSettings) -> None:
    stack = Stack(_with(fake_settings, start_router=False), commands=FakeCommands()).up()
    stale = state_path(fake_settings.state_dir).read_text()
    stack.down()
    state_path(fake_settings.state_dir).write_text(stale)  # as if `up` had been SIGKILLed
    with Stack(_with(fake_settings, start_router=False), commands=FakeCommands()):
        assert stack_status(fake_settings.state_dir)[0].alive


def test_stack_down_by_state_dir_stops_a_detached_stack(
    fake_settings: StackSettings, tmp_path: Path
) -> None:
    pid_file = tmp_path / "pids"
    commands = FakeCommands({"*": {"FAKE_CHILD": "1", "FAKE_PID_FILE": str(pid_file)}})
    Stack(fake_settings, commands=commands).up(detach=True)
    records = stack_down(fake_settings.state_dir, stop_timeout_s=3)
    assert [r.name for r in records] == ["prefill-0", "decode-0", "router"]
    assert all_dead(pids_from(pid_file))
    with pytest.raises(StackNotRunningError):
        stack_status(fake_settings.state_dir)


def test_status_reports_a_dead_instance(fake_settings: StackSettings) -> None:
    with Stack(_with(fake_settings, start_router=False), commands=FakeCommands()) as stack:
        victim = stack.state.processes[1]  # type: ignore[union-attr]
        psutil.Process(victim.pid).kill()
        psutil.Process(victim.pid).wait(5)
        rows = {r.name: r for r in stack.status()}
        assert not rows["decode-0"].alive and not rows["decode-0"].healthy
        assert rows["prefill-0"].alive and rows["prefill-0"].healthy
        assert stack.wait(poll_s=0.05).name == "decode-0"


def test_stop_group_kills_children_left_behind_by_a_dead_leader(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    port = _procs.free_port()
    cmd = FakeCommands({"*": {"FAKE_CHILD": "1", "FAKE_PID_FILE": str(pid_file)}})
    from kvtether.stack._commands import InstancePlan

    plan = InstancePlan("x", "prefill", "127.0.0.1", port, tmp_path / "x.log")
    c = cmd.command(plan, StackSettings())
    popen = _procs.spawn(c.argv, c.env, plan.log_path)
    started = _procs.create_time(popen.pid)
    wait_for(lambda: len(pids_from(pid_file)) >= 2, timeout_s=10, interval_s=0.05,
             message="the server and its child to write their pids")
    leader, child = pids_from(pid_file)
    psutil.Process(leader).kill()  # the API server crashes; its EngineCore lingers
    popen.wait(5)
    assert psutil.pid_exists(child)
    assert _procs.stop_group(leader, started, timeout_s=2) == []
    assert all_dead([child])


@pytest.mark.parametrize(("gpu_ids", "expected"), [([], [0.212] * 4), ([0, 1], [0.425] * 4)])
def test_instances_sharing_a_gpu_split_its_memory(
    fake_settings: StackSettings, gpu_ids: list[int], expected: list[float]
) -> None:
    settings = _with(fake_settings, profile="gpu", prefill=2, decode=2, gpu_ids=gpu_ids)
    commands = FakeCommands()
    with Stack(settings, commands=commands):
        engines = [p for p in commands.plans if p.role != "router"]
        assert [p.gpu_memory_utilization for p in engines] == expected
        assert [p.gpu_id for p in engines] == ([0, 1, 0, 1] if gpu_ids else [None] * 4)


def test_stop_group_leaves_a_reused_pid_alone() -> None:
    import subprocess
    import sys

    other = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True
    )
    try:
        stale_start = _procs.create_time(other.pid) - 1000  # "our" leader, long ago
        assert _procs.stop_group(other.pid, stale_start, timeout_s=1) == []
        assert other.poll() is None  # not ours: untouched
    finally:
        other.kill()
        other.wait()


def test_signals_deferred_holds_ctrl_c_until_the_block_ends() -> None:
    import signal

    from kvtether.stack._procs import signals_deferred

    steps: list[str] = []
    # What an interactive run has; a background job may start with SIGINT ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    with pytest.raises(KeyboardInterrupt):
        with signals_deferred():
            signal.raise_signal(signal.SIGINT)  # blocked: pending until the block ends
            steps.append("still stopping")
            # Tripped in the interpreter before the mask took effect: the handler runs inside.
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
            steps.append("stopped")
    assert steps == ["still stopping", "stopped"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    signal.signal(signal.SIGINT, previous)


def test_each_stack_gets_a_fresh_control_secret_for_its_instances_and_router(
    fake_settings: StackSettings,
) -> None:
    secrets = []
    for _ in range(2):
        commands = FakeCommands()
        with Stack(_with(fake_settings, connector="kvtether"), commands=commands) as stack:
            assert stack.control_secret and len(stack.control_secret) >= 32
            assert {p.control_secret for p in commands.plans} == {stack.control_secret}
            router = next(p for p in commands.plans if p.role == "router")
            assert all(u.startswith("http://127.0.0.1:") for u in router.decode_control_urls)
            secrets.append(stack.control_secret)
    assert secrets[0] != secrets[1]
    chosen = _with(fake_settings, connector="kvtether", control_secret="mine")
    with Stack(chosen, commands=FakeCommands()) as stack:
        assert stack.control_secret == "mine"


@pytest.mark.parametrize(("prefill", "decode", "cores", "warned"),
                         [(2, 2, 2, True), (1, 1, 2, False), (2, 2, 4, False)])
def test_a_cpu_stack_with_more_instances_than_cores_is_warned_about(
    fake_settings: StackSettings, caplog: pytest.LogCaptureFixture,
    prefill: int, decode: int, cores: int, warned: bool,
) -> None:
    settings = _with(fake_settings, prefill=prefill, decode=decode)
    assert settings.device == "cpu"
    with caplog.at_level("WARNING", logger="kvtether.stack.launcher"):
        assert warn_if_cores_shared(settings, cores=cores) is warned
    assert any("share cores" in r.getMessage() for r in caplog.records) is warned
    gpu = _with(fake_settings, profile="gpu", prefill=prefill, decode=decode)
    assert warn_if_cores_shared(gpu, cores=1) is False  # one GPU each, not a core


def test_spawned_processes_lead_a_group_in_the_launcher_s_session(tmp_path: Path) -> None:
    """Not a session of their own: Linux's scheduler autogroups give each session one share of
    each core, which starved a worker that shared its core with another instance's."""
    popen = _procs.spawn([sys.executable, "-c", "import time; time.sleep(30)"], {},
                         tmp_path / "x.log", die_with_parent=True)
    try:
        assert os.getpgid(popen.pid) == popen.pid  # stop_group signals it whole
        assert os.getsid(popen.pid) == os.getsid(0)
        mine = Path("/proc/self/autogroup")
        if mine.exists():
            assert Path(f"/proc/{popen.pid}/autogroup").read_text() == mine.read_text()
    finally:
        assert _procs.stop_group(popen.pid, _procs.create_time(popen.pid), timeout_s=5) == []
        popen.wait(5)
