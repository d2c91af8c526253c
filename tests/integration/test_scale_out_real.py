"""`stack up --routers 2 --store local` on real vLLM (cpu-tiny): the front spreads turns over
both router replicas, which share a real local redis-server (a conversation whose turns
alternate between them reuses KV on every turn); `stack down` leaves no process.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from kvtether import protocol as p
from kvtether.stack._state import load_state
from kvtether.stack.settings import StackSettings
from tests.support.stacks import PORT_BASE, Reference

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not (shutil.which("redis-server") or shutil.which("valkey-server")),
                       reason="needs redis-server or valkey-server (apt install redis-server)"),
]

_BASE = PORT_BASE + 400


@dataclass
class ScaledStack:
    url: str
    model: str
    state_dir: Path
    pids: list[int]  # every process of the stack and their children, at start


def _tree(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            out += [proc.pid, *(c.pid for c in proc.children(recursive=True))]
        except psutil.NoSuchProcess:
            pass
    return out


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _stack_down(state_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtether", "stack", "down", "--state-dir",
                           str(state_dir)], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def scaled(tmp_path_factory: pytest.TempPathFactory,
           reference_vllm: Reference) -> Iterator[ScaledStack]:
    from kvtether.stack.launcher import Stack

    del reference_vllm  # started first: booting vLLM is CPU-bound
    state_dir = tmp_path_factory.mktemp("scaled")
    settings = StackSettings(
        profile="cpu-tiny", routers=2, store="local", port=_BASE, base_port=_BASE + 10,
        side_channel_base_port=_BASE - 1700, control_base_port=_BASE + 20, state_dir=state_dir,
        lease_ttl_s=60, health_timeout_s=900,
    )
    stack = Stack(settings).up(detach=True)
    try:
        state = load_state(state_dir)
        assert state is not None
        yield ScaledStack(stack.router_url, stack.served_model_name, state_dir,
                          _tree([r.pid for r in state.processes]))
    finally:
        if load_state(state_dir) is not None:
            stack.down()


def _turn(client: httpx.Client, url: str, body: dict, cid: str) -> httpx.Response:
    return client.post(f"{url}/v1/chat/completions", json=body,
                       headers={p.HEADER_CONVERSATION_ID: cid})


def test_the_stack_runs_a_front_two_replicas_and_a_local_redis(scaled: ScaledStack) -> None:
    state = load_state(scaled.state_dir)
    assert state is not None and state.phase == "running"
    assert [r.name for r in state.processes] == [
        "prefill-0", "decode-0", "store", "router-0", "router-1", "front"]
    store = next(r for r in state.processes if r.name == "store")
    assert psutil.Process(store.pid).name() in ("redis-server", "valkey-server")
    health = httpx.get(f"{scaled.url}/health", timeout=30, trust_env=False).json()
    assert health == {"status": "ok", "replicas": {"router-0": True, "router-1": True}}


def test_turns_through_the_front_reach_both_replicas(
    scaled: ScaledStack, reference_vllm: Reference
) -> None:
    seen = []
    with httpx.Client(timeout=600, trust_env=False) as client:
        for i in range(4):
            body = {"model": scaled.model, "max_tokens": 8, "temperature": 0,
                    "return_token_ids": True,
                    "messages": [{"role": "user", "content": f"task {i}: read file {i}"}]}
            want = client.post(f"{reference_vllm.base_url}/v1/chat/completions", json=body)
            r = _turn(client, scaled.url, body, f"front-{i}-{uuid.uuid4().hex[:6]}")
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == want.json()["choices"][0]["token_ids"]
            seen.append(r.headers[p.HEADER_ROUTER])
    assert sorted(seen) == ["router-0", "router-0", "router-1", "router-1"]


def test_a_conversation_alternating_replicas_reuses_kv_every_turn(
    scaled: ScaledStack, reference_vllm: Reference
) -> None:
    cid = f"alternate-{uuid.uuid4().hex[:6]}"
    msgs = [{"role": "system", "content": "you are a helpful agent. use the tools. " * 6},
            {"role": "user", "content": "run the tests and read the files"}]
    replicas, outcomes = [], []
    with httpx.Client(timeout=600, trust_env=False) as client:
        for turn in range(4):
            body = {"model": scaled.model, "messages": msgs, "max_tokens": 8, "temperature": 0,
                    "return_token_ids": True}
            want = client.post(f"{reference_vllm.base_url}/v1/chat/completions", json=body)
            r = _turn(client, scaled.url, body, cid)
            assert r.status_code == 200, r.text
            got = r.json()["choices"][0]
            assert got["token_ids"] == want.json()["choices"][0]["token_ids"], turn
            replicas.append(r.headers[p.HEADER_ROUTER])
            outcomes.append(r.headers[p.HEADER_REUSE])
            msgs += [{"role": "assistant", "content": got["message"]["content"]},
                     {"role": "tool", "content": f"result {turn} ok"}]
        client.delete(f"{scaled.url}/v1/sessions/{cid}")
    print(f"\nalternating replicas {replicas}: {outcomes}")
    assert len(set(replicas)) == 2  # the front sent turns of one conversation to both
    assert outcomes[0] == "miss:first_turn"
    assert all(o in ("fired", "miss:below_threshold") for o in outcomes[1:]), outcomes


def test_stack_down_leaves_no_process(scaled: ScaledStack) -> None:
    down = _stack_down(scaled.state_dir)
    assert down.returncode == 0, down.stderr
    assert load_state(scaled.state_dir) is None
    assert _alive(scaled.pids) == []
