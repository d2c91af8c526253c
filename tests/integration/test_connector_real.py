"""The kvtether connector on real vLLM 0.32 P/D (tiny model, CPU, NIXL over UCX).

One prefill (P) and one decode (D) vLLM instance load ``kvtether.connector.nixl``; the tests
talk to them directly (no router), the way the router does: prefill leg on P, streamed decode
leg on D carrying ``kvtether_handle_key``, then the control channel on D. P runs without
prefix caching, so every token of a later turn comes either from D's KV or is recomputed
(the regime of several prefill instances or evicted caches): pulls and prefix cuts show.
Prompts are token ids through ``/v1/completions``, greedy, ``ignore_eos``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.waiting import wait_for

pytestmark = pytest.mark.vllm

_BASE = int(os.environ.get("KVTETHER_CONNECTOR_TEST_PORT", "8300"))
_SIDE = int(os.environ.get("KVTETHER_CONNECTOR_TEST_SIDE_PORT", "5800"))
_CONTROL = int(os.environ.get("KVTETHER_CONNECTOR_TEST_CONTROL_PORT", "5900"))
BLOCK = 32
# Generous: on a loaded 2-core machine a streamed answer can reach the client 20 s after D
# finished it, and a first NIXL handshake can take minutes.
DEFAULT_TTL_S = 300.0
# The control channel's shared secret, as `kvtether stack up` hands it to each instance.
SECRET = f"test-{uuid.uuid4().hex}"
CONTROL = httpx.Client(headers={"Authorization": f"Bearer {SECRET}"})
FIRST_LEG = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
             "remote_block_ids": None, "remote_host": None, "remote_port": None}


@dataclass
class Instance:
    name: str
    url: str
    control: str
    proc: subprocess.Popen[bytes]
    log: Path


def _model() -> Path:
    from kvtether.stack.models import prepare_model

    return prepare_model("tiny")


def _launch(name: str, idx: int, tmp: Path, extra_args: list[str]) -> Instance:
    kv_config = {
        "kv_connector": "NixlConnector", "kv_connector_module_path": "kvtether.connector.nixl",
        "kv_role": "kv_both", "kv_buffer_device": "cpu", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "bidirectional_kv_xfer": True, "kv_recompute_threshold": 16,
            # Upstream's lease on P-held blocks (default 30 s) can lapse during a slow first
            # NIXL handshake on a loaded 2-core machine; D would then read freed blocks.
            "kv_lease_duration": 120,
            "kvtether_control_port": _CONTROL + idx, "kvtether_lease_ttl_s": DEFAULT_TTL_S,
            "kvtether_role": name,
            # The cpu profiles' idle settings (kvtether.stack.profiles): these tests also show
            # that leases, releases and reads work with a sleeping engine.
            "kvtether_progress_thread_delay_us": 2000, "kvtether_rpc_busy_loop_s": 0.02,
        },
    }
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
               UCX_USE_MT_MUTEX="y", KVTETHER_CONTROL_SECRET=SECRET,
               VLLM_NIXL_SIDE_CHANNEL_PORT=str(_SIDE + 10 * idx))
    # One core each: P's and D's spinning OpenMP threads otherwise starve each other.
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(idx % (os.cpu_count() or 1)))
    port = _BASE + idx
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(_model()),
            "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--block-size", str(BLOCK), "--max-model-len", "4096",
            "--enforce-eager", "--kv-transfer-config", json.dumps(kv_config),
            "--scheduler-cls", "kvtether.connector.scheduler.IdleSleepScheduler",
            "--worker-cls", "kvtether.connector.worker.WatchedCPUWorker", *extra_args]
    log = tmp / f"{name}.log"
    with log.open("wb") as out:
        # its own process group in this session, as the stack spawns (kvtether.stack._procs)
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                process_group=0)
    return Instance(name, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{_CONTROL + idx}"
                    "/kvtether/v1", proc, log)


def _stop(inst: Instance) -> None:
    """Stop the instance's whole process group (vLLM spawns an EngineCore child)."""
    if inst.proc.poll() is not None:
        return
    os.killpg(inst.proc.pid, signal.SIGTERM)
    try:
        inst.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(inst.proc.pid, signal.SIGKILL)
        inst.proc.wait(timeout=10)


def _wait_healthy(instances: list[Instance], timeout_s: float = 600) -> None:
    pending = list(instances)

    def all_healthy() -> bool:
        for inst in list(pending):
            if inst.proc.poll() is not None:
                tail = inst.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{inst.name} exited with {inst.proc.returncode}:\n{tail}")
            try:
                if httpx.get(f"{inst.url}/health", timeout=2).status_code == 200:
                    pending.remove(inst)
            except httpx.HTTPError:
                pass
        return not pending

    wait_for(all_healthy, timeout_s, interval_s=2,
             message=lambda: f"health of {[i.name for i in pending]}")


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Instance, Instance]]:
    tmp = tmp_path_factory.mktemp("connector-pd")
    prefill = _launch("prefill", 0, tmp, ["--no-enable-prefix-caching"])
    decode = _launch("decode", 1, tmp, [])
    try:
        _wait_healthy([prefill, decode])
        _warm_up(prefill, decode)
        yield prefill, decode
    finally:
        _stop(prefill)
        _stop(decode)


def _warm_up(p: Instance, d: Instance) -> None:
    """Two turns, so both NIXL handshakes (D reads P, P reads D) are done before the tests."""
    key, key2 = f"warm-{uuid.uuid4().hex[:8]}", f"warm-{uuid.uuid4().hex[:8]}"
    prompt = tokens(70, seed=99)
    _, out = turn(p, d, prompt, key=key, max_tokens=4)
    turn(p, d, prompt + out + [5] * 20, handle=fetch_handle(d, key)["kv_transfer_params"],
         key=key2, max_tokens=2)
    release(d, key)
    release(d, key2)


# --- one turn, the way the router runs it ---------------------------------------------------
def tokens(n: int, seed: int = 0) -> list[int]:
    return [10 + (i * 37 + seed * 101) % 900 for i in range(n)]


def prefill_leg(p: Instance, prompt: list[int], rid: str,
                kv: dict[str, Any] | None = None) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": kv or FIRST_LEG}
    r = httpx.post(f"{p.url}/v1/completions", json=body, headers={"X-Request-Id": rid},
                   timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def decode_leg(d: Instance, prompt: list[int], rid: str, p_params: dict[str, Any], *,
               key: str | None, max_tokens: int, ttl_s: float | None = None) -> list[int]:
    """Streamed decode leg; returns the generated token ids."""
    kv = dict(p_params)
    if key is not None:
        kv["kvtether_handle_key"] = key
    if ttl_s is not None:
        kv["kvtether_lease_ttl_s"] = ttl_s
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "kv_transfer_params": kv}
    out: list[int] = []
    with httpx.stream("POST", f"{d.url}/v1/completions", json=body, timeout=300,
                      headers={"X-Request-Id": rid}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    out.extend(choice.get("token_ids") or [])
    assert len(out) == max_tokens
    return out


def turn(p: Instance, d: Instance, prompt: list[int], *, handle: dict[str, Any] | None = None,
         key: str | None = None, max_tokens: int = 24,
         ttl_s: float | None = None) -> tuple[dict[str, Any], list[int]]:
    """Prefill on P (reading ``handle`` if given), streamed decode on D; (P's params, output)."""
    rid = f"kvt-{uuid.uuid4().hex[:12]}"
    p_params = prefill_leg(p, prompt, rid, handle)
    return p_params, decode_leg(d, prompt, rid, p_params, key=key, max_tokens=max_tokens,
                                ttl_s=ttl_s)


def recompute(p: Instance, d: Instance, prompt: list[int], max_tokens: int = 24) -> list[int]:
    """Reference output: the same turn with no decode-held KV offered (P recomputes)."""
    key = f"ref-{uuid.uuid4().hex[:8]}"
    _, out = turn(p, d, prompt, key=key, max_tokens=max_tokens)
    CONTROL.delete(f"{d.control}/leases/{key}", timeout=30)
    return out


def fetch_handle(d: Instance, key: str) -> dict[str, Any]:
    r = CONTROL.get(f"{d.control}/handles/{key}", params={"wait_s": 5}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def release(d: Instance, key: str) -> None:
    CONTROL.delete(f"{d.control}/leases/{key}", timeout=30)


def wait_for_state(d: Instance, key: str, state: str, timeout_s: float) -> dict[str, Any]:
    seen: list[dict[str, Any]] = []

    def reached() -> dict[str, Any] | None:
        seen.append(CONTROL.get(f"{d.control}/leases/{key}", timeout=10).json())
        return seen[-1] if seen[-1].get("state") == state else None

    return wait_for(reached, timeout_s, interval_s=0.2,
                    message=lambda: f"lease {key} {state}; last seen {seen[-1]}")


# --- tests ----------------------------------------------------------------------------------
def test_streamed_turn_publishes_handle_and_release_frees_at_once(
    pd: tuple[Instance, Instance],
) -> None:
    p, d = pd
    prompt, key = tokens(150), f"k-{uuid.uuid4().hex[:8]}"
    _, out = turn(p, d, prompt, key=key, max_tokens=20, ttl_s=250)
    published = fetch_handle(d, key)
    kv, lease = published["kv_transfer_params"], published["lease"]
    assert kv["do_remote_decode"] is True and kv["kvtether_lease_key"] == key
    assert kv["remote_num_tokens"] == len(prompt) + len(out) - 1
    assert len(kv["kvtether_block_hashes"]) == kv["remote_num_tokens"] // BLOCK
    assert 150 < lease["remaining_s"] <= 250 and lease["state"] == "active"
    status = CONTROL.get(f"{d.control}/status", timeout=10).json()
    assert status["totals"]["retained_tokens"] >= kv["remote_num_tokens"]
    # Without the secret the control channel answers nothing and changes nothing.
    for method in ("GET", "DELETE"):
        refused = httpx.request(method, f"{d.control}/leases/{key}", timeout=10)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_control_secret"
    assert CONTROL.get(f"{d.control}/leases/{key}", timeout=10).json()["state"] == "active"
    assert status["block_size"] == BLOCK
    # The expiry P compares is in D's perf_counter clock, which status reports too.
    assert kv["remote_blocks_expiry_time"] - status["perf_counter"] == pytest.approx(
        lease["remaining_s"], abs=10)

    renewed = CONTROL.post(f"{d.control}/leases/{key}/renew", json={"ttl_s": 400}, timeout=30)
    assert renewed.status_code == 200, renewed.text
    assert 395 < renewed.json()["remaining_s"] <= 400
    # A shorter renewal never shortens the lease: the forwarded handle's deadline still holds.
    shorter = CONTROL.post(f"{d.control}/leases/{key}/renew", json={"ttl_s": 10}, timeout=30)
    assert shorter.status_code == 200, shorter.text
    assert shorter.json()["remote_blocks_expiry_time"] == renewed.json()["remote_blocks_expiry_time"]
    refreshed = fetch_handle(d, key)["kv_transfer_params"]["remote_blocks_expiry_time"]
    assert refreshed == renewed.json()["remote_blocks_expiry_time"]

    started = time.perf_counter()
    gone = CONTROL.delete(f"{d.control}/leases/{key}", timeout=30)
    freed_after_s = time.perf_counter() - started
    print(f"DELETE -> blocks freed by vLLM in {freed_after_s * 1000:.1f} ms")
    assert gone.status_code == 200 and gone.json()["state"] == "released"
    listing = CONTROL.get(f"{d.control}/leases", timeout=10).json()
    assert key not in {x["key"] for x in listing["leases"]}
    assert CONTROL.get(f"{d.control}/handles/{key}", timeout=10).status_code == 410


def test_turn_two_pulls_from_decode_and_matches_recompute(pd: tuple[Instance, Instance]) -> None:
    p, d = pd
    prompt, key = tokens(120, seed=1), f"k-{uuid.uuid4().hex[:8]}"
    _, out1 = turn(p, d, prompt, key=key, max_tokens=24)
    handle = fetch_handle(d, key)["kv_transfer_params"]
    prompt2 = prompt + out1 + tokens(30, seed=2)
    key2 = f"k-{uuid.uuid4().hex[:8]}"
    p_params, out2 = turn(p, d, prompt2, handle=handle, key=key2, max_tokens=16)
    assert p_params["kvtether_pull"] == "pulled"
    assert p_params["kvtether_reused_tokens"] == handle["remote_num_tokens"] == 143
    assert p_params["kvtether_prefix_break"] is False
    consumed = CONTROL.get(f"{d.control}/leases/{key}", timeout=10).json()
    assert consumed["state"] == "consumed" and consumed["retained_tokens"] == 0
    release(d, key2)
    assert out2 == recompute(p, d, prompt2, max_tokens=16)


def test_rewritten_history_pulls_only_matching_prefix(pd: tuple[Instance, Instance]) -> None:
    p, d = pd
    prompt, key = tokens(130, seed=3), f"k-{uuid.uuid4().hex[:8]}"
    _, out1 = turn(p, d, prompt, key=key, max_tokens=30)
    handle = fetch_handle(d, key)["kv_transfer_params"]
    edited = prompt.copy()
    edited[70] = 11 if edited[70] != 11 else 12  # inside block 2 (tokens 64-95)
    prompt2 = edited + out1 + tokens(20, seed=4)
    key2 = f"k-{uuid.uuid4().hex[:8]}"
    p_params, out2 = turn(p, d, prompt2, handle=handle, key=key2, max_tokens=16)
    assert p_params["kvtether_prefix_break"] is True
    assert p_params["kvtether_prefix_match_tokens"] == 64
    assert p_params["kvtether_reused_tokens"] == 64 and p_params["kvtether_pull"] == "pulled"
    release(d, key2)
    assert out2 == recompute(p, d, prompt2, max_tokens=16)


def test_expired_lease_is_freed_and_never_read(pd: tuple[Instance, Instance]) -> None:
    p, d = pd
    prompt, key = tokens(100, seed=5), f"k-{uuid.uuid4().hex[:8]}"
    # A short lease (renewals only extend, so it is set when the turn finishes).
    _, out1 = turn(p, d, prompt, key=key, max_tokens=20, ttl_s=15)
    stale = fetch_handle(d, key)["kv_transfer_params"]
    lease = wait_for_state(d, key, "expired", timeout_s=90)
    assert lease["retained_tokens"] == 0
    assert CONTROL.get(f"{d.control}/handles/{key}", timeout=10).status_code == 410
    # Forwarding the handle anyway: P declines (expiry passed) and recomputes.
    prompt2 = prompt + out1 + tokens(20, seed=6)
    key2 = f"k-{uuid.uuid4().hex[:8]}"
    p_params, out2 = turn(p, d, prompt2, handle=stale, key=key2, max_tokens=12)
    assert p_params["kvtether_pull"] == "failed" and p_params["kvtether_reused_tokens"] == 0
    release(d, key2)
    assert out2 == recompute(p, d, prompt2, max_tokens=12)


def test_renewed_lease_is_read_where_the_old_expiry_is_refused(
    pd: tuple[Instance, Instance],
) -> None:
    p, d = pd
    prompt, key = tokens(100, seed=7), f"k-{uuid.uuid4().hex[:8]}"
    _, out1 = turn(p, d, prompt, key=key, max_tokens=20)
    handle = fetch_handle(d, key)["kv_transfer_params"]
    # The handle as it looked when the lease had 3 s left: inside P's 5 s read margin.
    d_now = CONTROL.get(f"{d.control}/status", timeout=10).json()["perf_counter"]
    old = dict(handle, remote_blocks_expiry_time=d_now + 3)
    prompt2 = prompt + out1 + tokens(10, seed=8)
    key_refused = f"k-{uuid.uuid4().hex[:8]}"
    refused, _ = turn(p, d, prompt2, handle=old, key=key_refused, max_tokens=1)
    assert refused["kvtether_pull"] == "failed"  # declined, recomputed; D was not told
    release(d, key_refused)
    assert CONTROL.get(f"{d.control}/leases/{key}", timeout=10).json()["state"] == "active"
    renewed = CONTROL.post(f"{d.control}/leases/{key}/renew", json={"ttl_s": 300}, timeout=30)
    assert renewed.status_code == 200, renewed.text
    fresh = fetch_handle(d, key)["kv_transfer_params"]
    assert fresh["remote_blocks_expiry_time"] == renewed.json()["remote_blocks_expiry_time"]
    key2 = f"k-{uuid.uuid4().hex[:8]}"
    p_params, _ = turn(p, d, prompt2, handle=fresh, key=key2, max_tokens=8)
    assert p_params["kvtether_pull"] == "pulled" and p_params["kvtether_reused_tokens"] > 0
    release(d, key2)
    counters = CONTROL.get(f"{d.control}/status", timeout=10).json()["counters"]
    assert counters["leases_renewed"] >= 1 and counters["leases_consumed"] >= 1
    assert "kvtether_connector_active_leases" in CONTROL.get(f"{d.control}/metrics").text
