"""Issue 13 on real vLLM P/D (tiny model): two router replicas share conversations in a real
redis-server. Replica ``a`` runs in this process; replica ``b`` is a ``kvtether router``
process, so that it can be killed with SIGKILL mid-conversation."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from tests.integration.test_leases_real import NO_SPECIAL, Conv
from tests.support.redis_server import RedisServer, redis_port
from tests.support.stacks import PORT_BASE, StackHandle, serve_router
from tests.support.waiting import wait_for

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with RedisServer.running(redis_port(5), tmp_path_factory.mktemp("redis")) as server:
        yield server.url


@contextlib.contextmanager
def router_process(stack: StackHandle, port: int, store: str, log: Path) -> Iterator[
        subprocess.Popen[bytes]]:
    """``kvtether router`` on ``port`` over the stack's instances; stopped on the way out."""
    cmd = [sys.executable, "-m", "kvtether", "router", "--port", str(port),
           "--prefill-urls", f'{stack.prefill_urls}'.replace("'", '"'),
           "--decode-urls", f'{stack.decode_urls}'.replace("'", '"'),
           "--decode-control-urls", f'{stack.decode_control_urls}'.replace("'", '"'),
           "--kv-block-size-tokens", str(stack.block_size_tokens),
           "--lease-ttl-s", str(stack.lease_ttl_s), "--store", store]
    env = {**os.environ, "KVTETHER_ROUTER_CONTROL_SECRET": stack.control_secret or ""}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    def healthy() -> bool:
        assert proc.poll() is None, log.read_text()[-2000:]
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(healthy, timeout_s=120, interval_s=0.2, message="the router process to come up")
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(15)


@pytest.fixture
def replicas(pd_stack: StackHandle, redis_url: str, tmp_path: Path):  # noqa: ANN201
    """(replica a's stack handle, replica b's stack handle, replica b's process)."""
    port_b = PORT_BASE + 90
    with serve_router(pd_stack, lease_ttl_s=pd_stack.lease_ttl_s, store=redis_url) as url_a, \
            router_process(pd_stack, port_b, redis_url, tmp_path / "router-b.log") as proc:
        yield (replace(pd_stack, base_url=url_a),
               replace(pd_stack, base_url=f"http://127.0.0.1:{port_b}"), proc)


def test_alternating_replicas_reuse_every_turn_and_replica_loss(replicas, reference_vllm):
    a, b, proc_b = replicas
    c = Conv(a, reference_vllm, cid=f"alt-{uuid.uuid4().hex[:8]}")
    outcomes = [c.turn(url=(a if i % 2 == 0 else b).base_url) for i in range(5)]
    assert outcomes == ["miss:first_turn"] + ["fired"] * 4
    ops = _store_ops(a.base_url, b.base_url)
    print(f"\nstore round trips over 5 turns on two replicas: {ops}")
    # Replica b dies between turns: the next turn, on a, still reads what b's turn left.
    assert c.turn(url=b.base_url) == "fired"
    proc_b.send_signal(signal.SIGKILL)
    proc_b.wait(30)
    assert c.turn(url=a.base_url) == "fired"  # token-identical: checked in turn()
    status = httpx.get(f"{a.base_url}/v1/sessions/{c.cid}", timeout=30).json()
    assert status["turn_count"] == 7 and status["fired_turns"] == 6


def test_heartbeats_on_one_replica_release_on_the_other(replicas, reference_vllm, pd_stack):
    a, b, _ = replicas
    c = Conv(a, reference_vllm, cid=f"hb-{uuid.uuid4().hex[:8]}")
    assert c.turn(url=b.base_url) == "miss:first_turn"
    shared = _heartbeats_per_s(c.cid, [a.base_url, b.base_url])
    # The same through the stack's own router (in-memory store), for comparison.
    alone = Conv(pd_stack, reference_vllm, cid=f"hb1-{uuid.uuid4().hex[:8]}")
    alone.turn(check=False)
    memory = _heartbeats_per_s(alone.cid, [pd_stack.base_url])
    print(f"\nheartbeats/s, one client, each renewing on decode: {shared:.0f} through two "
          f"replicas sharing Redis, {memory:.0f} through one in-memory router")
    assert c.turn(url=b.base_url) == "fired"
    gone = httpx.delete(f"{b.base_url}/v1/sessions/{c.cid}", timeout=30)
    assert gone.status_code == 200 and gone.json()["retained_tokens_freed"] > 0, gone.text
    r = httpx.post(f"{a.base_url}/v1/sessions/{c.cid}/heartbeat", json={}, timeout=30)
    assert r.status_code == 410 and r.json()["error"]["code"] == "lease_released"
    assert c.turn(url=a.base_url) == "miss:released"


def test_racing_turns_through_both_replicas_wait_or_409_never_wrong(replicas, reference_vllm):
    a, b, _ = replicas
    c = Conv(a, reference_vllm, cid=f"race-{uuid.uuid4().hex[:8]}")
    c.turn(url=a.base_url)
    body = {"model": a.model, "messages": c.msgs, "max_tokens": 16, "temperature": 0,
            "return_token_ids": True, **NO_SPECIAL}
    ref = httpx.post(f"{reference_vllm.base_url}/v1/chat/completions", json=body,
                     timeout=600).json()["choices"][0]["token_ids"]

    def send(url: str) -> httpx.Response:
        return httpx.post(f"{url}/v1/chat/completions", json=body,
                          headers={"X-Conversation-Id": c.cid}, timeout=600)

    answered = 0
    for _ in range(3):
        with cf.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(send, [a.base_url, b.base_url]))
        assert any(r.status_code == 200 for r in answers)
        for r in answers:
            if r.status_code == 200:
                answered += 1
                assert r.json()["choices"][0]["token_ids"] == ref, "output differs"
            else:
                assert r.status_code == 409, r.text
                assert r.json()["error"]["code"] == "conversation_busy"
    # Every answered turn is recorded once, on the conversation or on a branch of it: a turn
    # whose branch is busy runs on a sibling (router/branches.py), and which one a racing
    # pair lands on depends on timing.
    status = httpx.get(f"{b.base_url}/v1/sessions/{c.cid}", timeout=30).json()
    recorded = status["turn_count"] + sum(br["turn_count"] for br in status["branches"])
    assert recorded == 1 + answered, status


def _store_ops(*urls: str) -> dict[str, float]:
    """kvtether_store_ops_total by operation, summed over the replicas."""
    out: dict[str, float] = {}
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
            if line.startswith("kvtether_store_ops_total{"):
                key, _, value = line.rpartition(" ")
                op = key.split('"')[1]
                out[op] = out.get(op, 0.0) + float(value)
    return out


def _heartbeats_per_s(cid: str, urls: list[str], n: int = 200) -> float:
    with httpx.Client(timeout=30) as client:
        t0 = time.perf_counter()
        for i in range(n):
            r = client.post(f"{urls[i % len(urls)]}/v1/sessions/{cid}/heartbeat",
                            json={"phase": "tool_running", "expected_duration_s": 5})
            assert r.status_code == 200, r.text
            assert r.json()["retained_tokens"] > 0
        return n / (time.perf_counter() - t0)
