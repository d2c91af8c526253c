"""`stack up --routers N --store ...`: settings, plan, commands, and a stack of fakes behind the
real front with a real local redis-server."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import psutil
import pytest
from pydantic import ValidationError

from kvtether import protocol as p
from kvtether.cli import main
from kvtether.errors import ConfigError
from kvtether.stack import _store
from kvtether.stack._commands import VllmCommands
from kvtether.stack._control import stack_down
from kvtether.stack._plan import plan_processes
from kvtether.stack._state import load_state
from kvtether.stack.launcher import Stack
from kvtether.stack.settings import StackSettings
from tests.support.stacks import supervised
from tests.support.waiting import wait_for

from .stack_fakes import FakeCommands, all_dead, free_port_block, pids_from

needs_redis = pytest.mark.skipif(
    not any(shutil.which(s) for s in _store.STORE_SERVERS),
    reason="needs redis-server or valkey-server (apt install redis-server)",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("KVTETHER_") and key != "KVTETHER_WARM_UP":
            monkeypatch.delenv(key)


# --- settings ---------------------------------------------------------------------------------
def test_several_routers_without_a_store_are_refused() -> None:
    with pytest.raises(ValidationError, match=r"--routers 2 needs a shared conversation store.*"
                                          r"--store local"):
        StackSettings(routers=2)


@pytest.mark.parametrize("store", ["localhost", "http://h:6379", "redis:/x", ""])
def test_a_store_must_be_local_or_a_redis_url(store: str) -> None:
    with pytest.raises(ValidationError, match="neither 'local', 'memory' nor a Redis/Valkey URL"):
        StackSettings(store=store)


@pytest.mark.parametrize("store", ["local", "redis://10.0.0.5:6379/0", "rediss://:pw@h:1/2",
                                   "unix:///run/redis.sock"])
def test_accepted_stores(store: str) -> None:
    assert StackSettings(routers=3, store=store).store == store


def test_memory_is_the_routers_own_store() -> None:
    assert StackSettings(store="memory").store is None
    with pytest.raises(ValidationError, match="--routers 2 needs a shared conversation store"):
        StackSettings(routers=2, store="memory")


def test_one_router_keeps_the_public_port_several_sit_behind_the_front() -> None:
    one = StackSettings(port=9000, store="local")
    assert (one.router_ports(), one.local_store_port) == ([9000], 9001)
    three = StackSettings(port=9000, routers=3, store="local")
    assert (three.router_ports(), three.local_store_port) == ([9001, 9002, 9003], 9004)


def test_cli_refusal_is_one_clear_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["stack", "up", "--routers", "2", "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --routers 2 needs a shared conversation store")
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_store_settings_come_from_flags_env_and_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "s.toml"
    cfg.write_text('routers = 2\nstore = "redis://h:1/0"\n')
    assert (StackSettings(config=cfg).routers, StackSettings(config=cfg).store) == (2, "redis://h:1/0")
    monkeypatch.setenv("KVTETHER_STORE", "local")
    assert StackSettings(config=cfg).store == "local"


# --- plan and commands ------------------------------------------------------------------------
def _plans(tmp_path: Path, **kw: object):  # noqa: ANN202
    settings = StackSettings(state_dir=tmp_path, port=9000, base_port=9100, **kw)
    return settings, plan_processes(settings, tmp_path / "model", "tiny", "ctl")


@needs_redis
def test_plan_of_two_replicas_a_front_and_a_local_store(tmp_path: Path) -> None:
    settings, plans = _plans(tmp_path, routers=2, store="local", prefill=2, decode=2)
    assert [(x.name, x.port) for x in plans] == [
        ("prefill-0", 9100), ("prefill-1", 9101), ("decode-0", 9102), ("decode-1", 9103),
        ("store", 9003), ("router-0", 9001), ("router-1", 9002), ("front", 9000)]
    routers = [x for x in plans if x.role == "router"]
    assert {x.store_url for x in routers} == {"redis://127.0.0.1:9003/0"}
    assert all(len(x.decode_urls) == 2 and len(x.prefill_urls) == 2 for x in routers)
    front = plans[-1]
    assert front.upstream_urls == ("http://127.0.0.1:9001", "http://127.0.0.1:9002")

    commands = VllmCommands("py")
    router_argv = commands.command(routers[0], settings).argv
    assert router_argv[router_argv.index("--store") + 1] == "redis://127.0.0.1:9003/0"
    assert router_argv[router_argv.index("--port") + 1] == "9001"
    front_argv = commands.command(front, settings).argv
    assert front_argv[:4] == ["py", "-m", "kvtether", "front"]
    assert json.loads(front_argv[front_argv.index("--upstream-urls") + 1]) == list(
        front.upstream_urls)
    store_argv = commands.command(plans[4], settings).argv
    assert Path(store_argv[0]).name in _store.STORE_SERVERS
    assert store_argv[store_argv.index("--port") + 1] == "9003"
    assert store_argv[store_argv.index("--bind") + 1] == "127.0.0.1"
    assert store_argv[store_argv.index("--save") + 1] == ""  # nothing persisted
    assert store_argv[store_argv.index("--appendonly") + 1] == "no"


def test_a_store_url_with_a_password_goes_to_the_environment(tmp_path: Path) -> None:
    settings, plans = _plans(tmp_path, routers=2, store="redis://:s3cret@cache:6379/1")
    router = next(x for x in plans if x.role == "router")
    cmd = VllmCommands("py").command(router, settings)
    assert "s3cret" not in " ".join(cmd.argv)
    assert cmd.env["KVTETHER_ROUTER_STORE"] == "redis://:s3cret@cache:6379/1"
    assert "s3cret" not in repr(router)
    assert not [x for x in plans if x.role == "store"]  # a given URL: nothing to start


def test_one_router_with_a_store_has_no_front(tmp_path: Path) -> None:
    _, plans = _plans(tmp_path, store="redis://cache:6379/0")
    assert [x.name for x in plans] == ["prefill-0", "decode-0", "router"]
    assert plans[-1].port == 9000 and plans[-1].store_url == "redis://cache:6379/0"


def test_no_redis_binary_is_a_clear_error_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_store.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="apt install redis-server.*brew install redis"):
        _plans(tmp_path, routers=2, store="local")


# --- a stack of fakes behind the real front, with a real local store ---------------------------
@needs_redis
@pytest.mark.usefixtures("no_leaks")
def test_routers_front_and_store_start_answer_and_stop(
    fake_settings: StackSettings, tmp_path: Path
) -> None:
    pid_file = tmp_path / "pids"
    settings = StackSettings.model_validate({
        **fake_settings.model_dump(exclude_unset=True),
        "routers": 2, "store": "local", "port": free_port_block(4)})
    commands = FakeCommands({"*": {"FAKE_PID_FILE": str(pid_file)}})
    stack = Stack(settings, commands=commands).up(detach=True)
    state = load_state(settings.state_dir)
    assert state is not None
    assert [x.name for x in state.processes] == [
        "prefill-0", "decode-0", "store", "router-0", "router-1", "front"]
    assert stack.router_url == f"http://127.0.0.1:{settings.port}"
    assert stack.router_replica_urls == [f"http://127.0.0.1:{settings.port + i}" for i in (1, 2)]
    store_pid = next(x.pid for x in state.processes if x.name == "store")
    front_pid = next(x.pid for x in state.processes if x.name == "front")
    assert psutil.Process(store_pid).name() in _store.STORE_SERVERS

    # The front answers /health for both replicas and passes other paths to them in turn.
    health = httpx.get(f"{stack.router_url}/health", timeout=10, trust_env=False)
    assert health.json() == {"status": "ok", "replicas": {"router-0": True, "router-1": True}}
    with httpx.Client(base_url=stack.router_url, timeout=10, trust_env=False) as client:
        seen = [client.get("/metrics").headers[p.HEADER_ROUTER] for _ in range(4)]
    assert sorted(seen) == ["router-0", "router-0", "router-1", "router-1"]

    # `stack down` (another shell) stops the front, the replicas and the store.
    records = stack_down(settings.state_dir, stop_timeout_s=3)
    assert {r.role for r in records} == {"prefill", "decode", "store", "router", "front"}
    assert all_dead([*pids_from(pid_file), store_pid, front_pid])
    assert load_state(settings.state_dir) is None


@needs_redis
@pytest.mark.usefixtures("no_leaks")
def test_a_killed_front_replica_or_store_is_restarted(fake_settings: StackSettings) -> None:
    import os
    import signal

    settings = StackSettings.model_validate({
        **fake_settings.model_dump(exclude_unset=True),
        "routers": 2, "store": "local", "port": free_port_block(4), "restart_backoff_s": 0.1})
    with Stack(settings, commands=FakeCommands()) as stack, supervised(stack) as said:
        before = {r.name: r.pid for r in load_state(settings.state_dir).processes}
        for name in ("front", "router-1", "store"):
            os.kill(before[name], signal.SIGKILL)
            wait_for(lambda back=f"{name} is back": back in " ".join(said), timeout_s=30,
                     interval_s=0.05, message=lambda: said)
        after = {r.name: r.pid for r in load_state(settings.state_dir).processes}
        assert all(after[n] != before[n] for n in ("front", "router-1", "store"))
        assert all(r.alive and r.healthy for r in stack.status())
        health = httpx.get(f"{stack.router_url}/health", timeout=10, trust_env=False)
        assert health.json()["replicas"] == {"router-0": True, "router-1": True}
