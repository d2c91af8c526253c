"""Faults on a real P/D stack (tiny model): what the client sees, what is freed, what comes back.

This module starts its own stack (it kills its instances), supervised as a foreground
``kvtether stack up`` is: a process that dies is restarted with back-off and the router takes it
back. Leases start at a few seconds so that KV a fault orphans lapses quickly, and prefill runs
without vLLM's prefix cache, so a turn's outcome says what it read from decode. For each fault:
every answer given is token-identical to the colocated reference, at most the turn in flight
fails, with a 5xx JSON error the OpenAI SDK retries (502/503; a streamed turn: an error event,
no ``[DONE]``, which the SDK raises), the router serves the next turn,
and once leases lapse no instance holds KV (connector lease totals and vLLM's
``kv_cache_usage_perc``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil
import pytest

from kvtether import protocol as p
from tests.support.servers import serve_app, unused_port
from tests.support.stacks import PORT_BASE, Reference, supervised
from tests.support.waiting import wait_for

pytestmark = pytest.mark.vllm

# Above the router's lease_safety_margin_s (6 s): a shorter lease is never forwarded at all.
LEASE_TTL_S = 10.0
# How long prefill holds a new turn's KV for decode's read (vLLM's kv_lease_duration).
PREFILL_KV_LEASE_S = 30
SYSTEM = "you are a helpful agent. use the tools. " * 6
TOOL_RESULT = "ok tests run result found file path value true " * 2
# Long enough to be caught mid-answer even on an idle machine (the tiny model writes hundreds of
# tokens a second); ignore_eos so the random tiny model does not stop early.
LONG = {"max_tokens": 1000, "ignore_eos": True}
# For a kill mid-answer: cpu-tiny's decode, scheduling asynchronously, can finish 1,000 tokens
# before the kill lands (seen once in CI); this leaves it ~3.5x longer (max_model_len 4096).
LONGEST = {"max_tokens": 3500, "ignore_eos": True}
# A killed vLLM instance is back (healthy, taken back by the router, warm-up done) within this:
# a cpu-tiny restart took 36-41 s on a 2-core machine; the rest is room for a loaded one.
RESTART_WITHIN_S = 300.0


@dataclass
class FaultStack:
    router_url: str
    model: str
    urls: dict[str, str]  # instance name -> vLLM URL
    controls: dict[str, str]  # instance name -> kvtether control URL
    control_secret: str  # every control-channel call needs it
    stack: Any
    say: list[str] = field(default_factory=list)  # what the supervisor reported

    def pid(self, name: str) -> int:
        return next(r.pid for r in self.stack.state.processes if r.name == name)

    def control(self, name: str, path: str) -> dict[str, Any]:
        """GET a connector's control channel, with the stack's secret."""
        r = httpx.get(f"{self.controls[name]}/kvtether/v1/{path}", timeout=10,
                      headers={"Authorization": f"Bearer {self.control_secret}"})
        r.raise_for_status()
        return r.json()

    def log(self, name: str) -> str:
        path = next(r.log_path for r in self.stack.state.processes if r.name == name)
        return path.read_text(errors="replace")

    def restart_times_s(self, name: str) -> list[float]:
        """Seconds each restart of ``name`` took to become healthy (the supervisor's lines)."""
        prefix = f"{name} is back: healthy "
        return [float(line[len(prefix):].split(" ", 1)[0]) for line in self.say
                if line.startswith(prefix)]


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory, reference_vllm: Reference
           ) -> Iterator[FaultStack]:
    del reference_vllm  # booted first (see conftest): vLLM boots are CPU-bound
    from kvtether.stack.launcher import Stack
    from kvtether.stack.settings import StackSettings

    base = PORT_BASE + 400
    settings = StackSettings(
        profile="cpu-tiny", port=base, base_port=base + 10, control_base_port=base + 20,
        side_channel_base_port=PORT_BASE - 1000, state_dir=tmp_path_factory.mktemp("faults"),
        health_timeout_s=900, lease_ttl_s=LEASE_TTL_S, restart_backoff_s=1.0,
        # Prefill recomputes whatever it does not read from decode: with its own prefix cache
        # a lost read would be served from there (and counted `fired`), so each fault's
        # outcome would depend on what prefill happened to still cache.
        prefill_prefix_caching=False,
        # vLLM's own default (CPU profiles hold 120 s): a late read needs a shorter wait.
        prefill_kv_lease_s=PREFILL_KV_LEASE_S,
    )
    with Stack(settings, die_with_parent=True) as stack, supervised(stack) as said:
        names = [r.name for r in stack.state.processes if r.role != "router"]
        fs = FaultStack(
            router_url=stack.router_url, model=stack.served_model_name,
            urls={r.name: r.url for r in stack.state.processes if r.role != "router"},
            controls={n: f"http://{settings.host}:{settings.control_port(i)}"
                      for i, n in enumerate(names)},
            control_secret=stack.control_secret,
            stack=stack,
            say=said,
        )
        yield fs
    print("\nsupervisor:\n  " + "\n  ".join(fs.say))


# --- helpers --------------------------------------------------------------------------------
class Conv:
    def __init__(self, fs: FaultStack, ref: Reference, router_url: str | None = None) -> None:
        self.fs, self.ref = fs, ref.base_url
        self.url = router_url or fs.router_url
        self.cid = f"fault-{uuid.uuid4().hex[:8]}"
        self.last: httpx.Response | None = None  # the last answered turn
        self.msgs: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "please run the tests and read the files"}]

    def body(self, **extra: Any) -> dict[str, Any]:
        return {"model": self.fs.model, "messages": self.msgs, "max_tokens": 8,
                "temperature": 0, "return_token_ids": True, **extra}

    def reference(self, **extra: Any) -> list[int]:
        r = httpx.post(f"{self.ref}/v1/chat/completions", json=self.body(**extra), timeout=600)
        return list(r.json()["choices"][0]["token_ids"])

    def post(self, **extra: Any) -> httpx.Response:
        # Hints (none in particular): a kvtether client, whose leases are lease_ttl_s.
        return httpx.post(f"{self.url}/v1/chat/completions", json=self.body(**extra),
                          headers={p.HEADER_CONVERSATION_ID: self.cid, p.HEADER_HINTS: "{}"},
                          timeout=600)

    def turn(self, *, retry_s: float = 0.0, **extra: Any) -> str:
        """One turn, checked against the reference; retried like the OpenAI SDK (5xx,
        connection errors) for up to ``retry_s``. Returns the reuse outcome."""
        want = self.reference(**extra)
        deadline = time.monotonic() + retry_s
        while True:
            try:
                r = self.post(**extra)
            except httpx.TransportError:
                r = None
            if r is not None and r.status_code == 200:
                break
            if r is not None:
                assert_retryable(r)
            assert time.monotonic() < deadline, r.text if r is not None else "no answer"
            time.sleep(2.0)
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == want, "output differs from the reference"
        self.last = r
        self.msgs = self.msgs + [{"role": "assistant", "content": choice["message"]["content"]},
                                 {"role": "tool", "content": TOOL_RESULT}]
        return r.headers[p.HEADER_REUSE]

    def status(self) -> httpx.Response:
        return httpx.get(f"{self.url}/v1/sessions/{self.cid}", timeout=30)


def assert_retryable(r: httpx.Response) -> None:
    """A failed turn: 502 or 503 (the OpenAI SDK retries both) with an OpenAI-style body."""
    assert r.status_code in (502, 503), (r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"] and err["type"], r.text


def held(fs: FaultStack) -> dict[str, tuple[int, float]]:
    """Per instance: active leases on its connector, and vLLM's KV cache usage."""
    out = {}
    for name, url in fs.urls.items():
        try:
            st = fs.control(name, "status")
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
        except httpx.TransportError:
            out[name] = (-1, -1.0)  # restarting
            continue
        usage = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("vllm:kv_cache_usage_perc"))
        out[name] = (st["totals"]["active_leases"], usage)
    return out


def assert_nothing_held(fs: FaultStack, within_s: float = 3 * LEASE_TTL_S + 10) -> float:
    """Wait until no instance holds KV; return how long that took."""
    t0 = time.monotonic()
    while True:
        now = held(fs)
        if all(v == (0, 0.0) for v in now.values()):
            return time.monotonic() - t0
        if time.monotonic() - t0 >= within_s:
            leases = {n: fs.control(n, "leases")["leases"] for n in fs.controls}
            raise AssertionError(f"KV still held: {now}; leases: {leases}")
        time.sleep(0.5)


def ended_since(fs: FaultStack, since_unix_s: float) -> dict[str, list[str]]:
    """Per instance: how each lease that ended since ``since_unix_s`` ended (released,
    consumed, expired, evicted): what freed the KV, rather than how fast."""
    out = {}
    for name in fs.controls:
        ended = fs.control(name, "leases")["recently_ended"]
        out[name] = [x["state"] for x in ended
                     if x.get("ended_unix_s") and x["ended_unix_s"] >= since_unix_s]
    return out


def assert_freed_not_lapsed(fs: FaultStack, since_unix_s: float) -> float:
    """Nothing held, and no lease that ended since ``since_unix_s`` lapsed: its KV was freed
    by a release or a read, not by waiting out the lease. Returns how long freeing took."""
    freed_s = assert_nothing_held(fs)
    ended = ended_since(fs, since_unix_s)
    assert not any("expired" in states for states in ended.values()), ended
    return freed_s


def wait_back(fs: FaultStack, name: str, timeout_s: float = RESTART_WITHIN_S) -> None:
    """Until the supervisor has restarted ``name`` and the router counts it healthy again."""
    deadline = time.monotonic() + timeout_s
    wait_for(lambda: any(line.startswith(f"{name} is back") for line in fs.say), timeout_s,
             interval_s=1, message=lambda: fs.say)

    def taken_back() -> bool:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            health = httpx.get(f"{fs.router_url}/health", timeout=10).json()
            return bool(health.get("backends", {}).get(name))
        return False

    wait_for(taken_back, max(0.0, deadline - time.monotonic()), interval_s=1,
             message="the router to take it back")


def kill9(fs: FaultStack, name: str) -> None:
    os.kill(fs.pid(name), signal.SIGKILL)


@contextlib.contextmanager
def streamed_turn(c: Conv, **extra: Any) -> Iterator[tuple[httpx.Response, Iterator[str]]]:
    """A streamed turn; reading its first lines means decode is mid-answer (with LONG)."""
    body = {**c.body(**extra), "stream": True}
    with httpx.stream("POST", f"{c.url}/v1/chat/completions", json=body, timeout=600,
                      headers={p.HEADER_CONVERSATION_ID: c.cid}) as r:
        assert r.status_code == 200, r.read()
        yield r, r.iter_lines()


def sse_data(lines: list[str]) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


# --- faults that keep every process ---------------------------------------------------------
def test_client_drops_a_streamed_turn_halfway(faults: FaultStack, reference_vllm: Reference):
    c = Conv(faults, reference_vllm)
    assert c.turn() == "miss:first_turn"
    t0 = time.time()
    with streamed_turn(c, **LONG) as (_, lines):
        for _ in range(6):  # a few chunks, then the client goes away
            next(lines)
    # vLLM aborts the request when the router closes D's stream: nothing is retained for it
    # (the previous turn's KV, read by prefill, goes at decode's next housekeeping step), and
    # no lease is left to lapse.
    freed_s = assert_freed_not_lapsed(faults, t0)
    outcome = c.turn()  # the agent retries the turn
    assert outcome.startswith("miss:"), outcome
    after = c.turn()  # and the conversation goes on (served, identical)
    print(f"\ndropped stream: KV freed {freed_s:.1f} s after; retried turn {outcome}, "
          f"next {after}")
    assert_nothing_held(faults)


def test_heartbeat_racing_lease_expiry(faults: FaultStack, reference_vllm: Reference):
    c = Conv(faults, reference_vllm)
    c.turn()
    deadline = c.status().json()["lease_deadline_unix_s"]
    time.sleep(max(0.0, deadline - time.time() - 0.6))
    answers = []
    while time.time() < deadline + 0.6:  # heartbeats on both sides of the deadline
        r = httpx.post(f"{c.url}/v1/sessions/{c.cid}/heartbeat", json={}, timeout=30)
        assert r.status_code in (200, 410), r.text  # never a 5xx
        answers.append(r.status_code)
        if r.status_code == 410:
            break
        time.sleep(0.1)
    outcome = c.turn()  # identical output either way (checked in turn())
    assert c.last is not None
    reused = int(c.last.headers[p.HEADER_REUSED_TOKENS])
    reusable = int(c.last.headers[p.HEADER_REUSABLE_TOKENS])
    settings = faults.stack.settings
    assert reusable >= settings.kv_recompute_threshold_tokens  # eligible: the race decides
    # Prefill keeps no prefix cache here, so what the turn reused is exactly what it read.
    if answers[-1] == 200:  # renewed in time: decode's KV is read
        assert outcome == "fired", (answers, outcome)
        slack = max(settings.kv_recompute_threshold_tokens, settings.block_size_tokens)
        assert reusable - reused < slack, (reused, reusable)
    else:  # lapsed first: nothing is read, the prompt is recomputed
        assert outcome == "miss:lease_expired", (answers, outcome)
        assert reused == 0, (reused, reusable)
    print(f"\nheartbeat race: answers {answers}, next turn {outcome} "
          f"({reused} of {reusable} reusable tokens read)")
    print(f"  KV freed {assert_nothing_held(faults):.1f} s after")


def test_lease_released_while_its_turn_is_in_flight(faults: FaultStack, reference_vllm):
    c = Conv(faults, reference_vllm)
    c.turn()
    t0 = time.time()
    with streamed_turn(c, **LONG) as (r, lines):
        assert r.headers[p.HEADER_REUSE] == "fired"  # planned before the DELETE
        seen = [next(lines) for _ in range(6)]  # decode is mid-answer
        deleted = httpx.delete(f"{c.url}/v1/sessions/{c.cid}", timeout=30)
        assert deleted.status_code == 200, deleted.text
        seen += list(lines)  # the turn in flight is answered to the end...
    data = sse_data(seen)
    assert data[-1] == "[DONE]", data[-3:]
    choices = [ch for chunk in data[:-1] for ch in json.loads(chunk)["choices"]]
    # ...and what it retained is freed as it settles (released), not when its lease lapses.
    freed_s = assert_freed_not_lapsed(faults, t0)
    assert "released" in ended_since(faults, t0)["decode-0"], ended_since(faults, t0)
    # The reference after the turn: computing a long answer first could outlast the lease.
    assert [t for ch in choices for t in ch.get("token_ids") or []] == c.reference(**LONG)
    content = "".join(ch["delta"].get("content") or "" for ch in choices)
    c.msgs += [{"role": "assistant", "content": content},
               {"role": "tool", "content": TOOL_RESULT}]
    after = c.turn()
    assert after == "miss:released", after
    print(f"\nreleased in flight: DELETE {deleted.status_code}, the streamed turn answered "
          f"to [DONE]; KV freed {freed_s:.1f} s after; next turn {after}")


# Far past any descriptor NIXL registered for decode's KV (and still an int32 after vLLM adds a
# layer's offset): NIXL refuses to prepare the read (NIXL_ERR_INVALID_PARAM).
_UNREGISTERED_BLOCK_ID = 2**30


def test_a_late_read_of_prefill_kv_is_declined(faults: FaultStack, reference_vllm: Reference):
    """Decode reads a new turn's KV from prefill only while prefill still holds it.

    The two legs by hand, as the router runs them, with decode's leg sent after prefill's hold
    has passed (what a decode engine stalled for minutes does) and prefill's freed blocks
    refilled by other prompts: decode declines the read and recomputes, identical output.
    """
    from kvtether.router.legs import _FRESH_PREFILL_PARAMS

    c = Conv(faults, reference_vllm)
    want = c.reference()
    p_url, d_url = faults.urls["prefill-0"], faults.urls["decode-0"]
    leg = {**c.body(), "max_tokens": 1, "kv_transfer_params": dict(_FRESH_PREFILL_PARAMS)}
    r = httpx.post(f"{p_url}/v1/chat/completions", json=leg, timeout=600)
    assert r.status_code == 200, r.text
    handle = r.json()["kv_transfer_params"]
    expiry = handle["remote_blocks_expiry_time"]  # prefill's perf_counter: one host, one clock
    assert expiry is not None, handle
    # Prefill frees the blocks at its deadline; other prompts take them over.
    while time.perf_counter() < expiry + 1:
        filler = {**c.body(), "messages": [{"role": "user", "content": uuid.uuid4().hex * 8}]}
        httpx.post(f"{p_url}/v1/chat/completions", json=filler, timeout=600)
        time.sleep(1.0)
    d_log_before = len(faults.log("decode-0"))
    r = httpx.post(f"{d_url}/v1/chat/completions",
                   json={**c.body(), "kv_transfer_params": handle}, timeout=600)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want, "decode read freed blocks"
    assert "Declining expired remote read" in faults.log("decode-0")[d_log_before:]
    print(f"\nlate read ({time.perf_counter() - expiry:.0f} s past prefill's hold): declined, "
          "recomputed on decode, identical")
    # What decode retained for this turn has no router to release it: its lease lapses.
    assert_nothing_held(faults)


def _tampering_router(fs: FaultStack, tamper: threading.Event,
                      rewrite: Callable[[dict[str, Any]], None]):
    """An in-process router over the stack's instances whose prefill legs, while ``tamper`` is
    set, carry decode's handle as ``rewrite`` changes it (in place)."""
    from kvtether.router import create_app

    class Tamper(httpx.AsyncHTTPTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if tamper.is_set() and request.url.path.endswith("/completions"):
                body = json.loads(request.content)
                kvp = body.get("kv_transfer_params") or {}
                if kvp.get("do_remote_decode") and kvp.get("remote_block_ids"):
                    rewrite(kvp)
                    headers = {k: v for k, v in request.headers.items()
                               if k.lower() not in ("content-length", "content-type")}
                    request = httpx.Request(request.method, request.url, json=body,
                                            headers=headers)
            return await super().handle_async_request(request)

    def make_app(port: int) -> Any:
        # No hand-off extension: the KV prefill fails to read lapses with the 10 s lease.
        rs = _router_settings(fs, port, handoff_lease_s=0)
        return create_app(rs, transport=Tamper())

    return serve_app(make_app)


def _unregistered_blocks(kvp: dict[str, Any]) -> None:
    """Decode's block ids moved outside its registered KV region: prefill's NIXL read of them
    fails for real (descriptor preparation), and vLLM's failure path (``failed_recving``,
    ``kv_load_failure_policy: recompute``) runs."""
    kvp["remote_block_ids"] = [[_UNREGISTERED_BLOCK_ID + i for i in range(len(group))]
                               for group in kvp["remote_block_ids"]]


def _unreachable_side_channel(kvp: dict[str, Any]) -> None:
    """Decode's handle names an engine prefill has not met, behind a side-channel port nobody
    answers: prefill's NIXL handshake times out (vLLM's 5 s zmq limit), as it does when a
    starved decode engine answers late."""
    kvp["remote_port"] = unused_port()
    kvp["remote_engine_id"] = f"unmet-{uuid.uuid4().hex[:8]}"


def test_nixl_read_failure(faults: FaultStack, reference_vllm: Reference):
    tamper = threading.Event()
    prefill = next(n for n in faults.urls if n.startswith("prefill"))
    with _tampering_router(faults, tamper, _unregistered_blocks) as url:
        c = Conv(faults, reference_vllm, router_url=url)
        c.turn()
        pulls_failed = faults.control(prefill, "status")["counters"].get("pulls_failed", 0)
        setup_failures = faults.log(prefill).count("transfer_setup_failed")
        tamper.set()
        outcome = c.turn()  # P's read of D's KV fails: it recomputes, same tokens
        tamper.clear()
        assert c.last is not None
        reused = int(c.last.headers[p.HEADER_REUSED_TOKENS])
        # The read failed in NIXL (vLLM logs the failed setup) and the connector saw vLLM
        # report it (failed_recving): the router labels the turn from what prefill reported.
        assert faults.log(prefill).count("transfer_setup_failed") > setup_failures
        assert faults.control(prefill, "status")["counters"]["pulls_failed"] == pulls_failed + 1
        assert outcome == "miss:transfer_failed", outcome
        assert reused == 0, reused
        after = c.turn()  # the next turn reads again (identical)
        assert after == "fired", after
    print(f"\nNIXL read failure: {outcome} ({reused} tokens reused); next turn {after}")
    print(f"  KV freed {assert_nothing_held(faults):.1f} s after")


def test_nixl_handshake_failure(faults: FaultStack, reference_vllm: Reference):
    tamper = threading.Event()
    prefill = next(n for n in faults.urls if n.startswith("prefill"))
    with _tampering_router(faults, tamper, _unreachable_side_channel) as url:
        c = Conv(faults, reference_vllm, router_url=url)
        c.turn()
        failures = faults.log(prefill).count("handshake_failed")
        tamper.set()
        t0 = time.perf_counter()
        outcome = c.turn()  # P cannot reach "decode" to read its KV: it recomputes
        seconds = time.perf_counter() - t0
        tamper.clear()
        assert faults.log(prefill).count("handshake_failed") > failures
        assert outcome == "miss:transfer_failed", outcome
        after = c.turn()  # the real handle again: read
        assert after == "fired", after
    print(f"\nNIXL handshake failure: {outcome} in {seconds:.1f} s; next turn {after}")
    print(f"  KV freed {assert_nothing_held(faults):.1f} s after")


def _router_settings(fs: FaultStack, port: int, **overrides: Any) -> Any:
    from kvtether.router import RouterSettings

    def of(role: str, urls: dict[str, str]) -> list[str]:
        return [u for n, u in urls.items() if n.startswith(role)]

    return RouterSettings(
        port=port, prefill_urls=of("prefill", fs.urls), decode_urls=of("decode", fs.urls),
        prefill_control_urls=of("prefill", fs.controls),
        decode_control_urls=of("decode", fs.controls), control_secret=fs.control_secret,
        kv_block_size_tokens=fs.stack.settings.block_size_tokens, lease_ttl_s=LEASE_TTL_S,
        **overrides,
    )


def _worker(fs: FaultStack, name: str) -> psutil.Process:
    """The vLLM worker process of instance ``name`` (API server > engine core > worker)."""
    procs = psutil.Process(fs.pid(name)).children(recursive=True)
    return next(q for q in procs if "VLLM::Worker" in " ".join(q.cmdline()))


# --- a frozen worker ---------------------------------------------------------------------------
STALL_AFTER_S = 3.0


def test_a_frozen_decode_worker_is_given_up_in_bounded_time(faults: FaultStack,
                                                            reference_vllm: Reference):
    """Decode's worker stops (SIGSTOP) mid-conversation, as a worker frozen inside vLLM's RPC
    does: the engine's step waits for it, the connector reports that wait, and the router
    gives the turn's decode leg up with a 503 in seconds, not vLLM's 300 s RPC timeout."""
    from kvtether.router import create_app

    with serve_app(lambda port: create_app(_router_settings(
            faults, port, stall_after_s=STALL_AFTER_S))) as url:
        c = Conv(faults, reference_vllm, router_url=url)
        c.turn()
        worker = _worker(faults, "decode-0")
        worker.suspend()
        try:
            t0 = time.monotonic()
            r = c.post()  # non-streamed: nothing arrives until decode has answered
            waited_s = time.monotonic() - t0
            step_s = faults.control("decode-0", "status")["step_running_s"]
            health = httpx.get(f"{url}/health", timeout=10)
            again = c.post()  # while it is stalled: answered at once
        finally:
            worker.resume()
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "upstream_stalled", r.text
        # Housekeeping checks every 5 s: given up within the check after stall_after_s.
        assert waited_s < STALL_AFTER_S + 20, waited_s
        assert step_s is not None and step_s >= STALL_AFTER_S, step_s
        assert health.status_code == 503 and health.json()["backends"]["decode-0"] is False
        assert again.status_code == 503, again.text
        assert again.json()["error"]["code"] == "upstream_stalled"
        # It steps again: the router takes it back, and the answers are the reference's.
        outcome = c.turn(retry_s=60)
        print(f"\nfrozen decode worker: 503 upstream_stalled after {waited_s:.1f} s "
              f"(its step had waited {step_s:.1f} s); resumed, next turn {outcome}, "
              f"then {c.turn()}")
    print(f"  KV freed "
          f"{assert_nothing_held(faults, within_s=PREFILL_KV_LEASE_S + 30):.0f} s after")


# --- processes killed and restarted ---------------------------------------------------------
def test_router_restarted_mid_conversation(faults: FaultStack, reference_vllm: Reference):
    c = Conv(faults, reference_vllm)
    c.turn()
    kill9(faults, "router")
    wait_back_router = time.monotonic()
    # The new router knows nothing of the conversation: a plain first turn, same tokens.
    outcome = c.turn(retry_s=120)
    print(f"\nrouter restart: back after {time.monotonic() - wait_back_router:.1f} s; "
          f"next turn {outcome}")
    assert outcome == "miss:first_turn"
    print(f"  then {c.turn()}")
    # What the old router left on D has no owner any more: its lease lapses.
    print(f"  KV freed {assert_nothing_held(faults):.1f} s after")


def test_prefill_killed(faults: FaultStack, reference_vllm: Reference):
    c = Conv(faults, reference_vllm)
    c.turn()
    kill9(faults, "prefill-0")
    time.sleep(0.5)
    r = c.post()
    assert_retryable(r)  # no prefill: a clear 502/503 until it is back
    print(f"\nprefill killed: {r.status_code} {r.json()['error']}")
    wait_back(faults, "prefill-0")
    outcome = c.turn(retry_s=60)
    # Decode kept the conversation's KV: read if its lease outlived the restart, else lapsed.
    assert outcome in ("fired", "miss:lease_expired"), outcome
    print(f"prefill back (healthy {faults.restart_times_s('prefill-0')} s after its restart): "
          f"next turn {outcome}, then {c.turn()}")
    print(f"  KV freed {assert_nothing_held(faults):.1f} s after")


def _restarts(faults: FaultStack) -> int:
    return sum(line.endswith("restarting it") for line in faults.say)


def _answer_tokens(events: list[str]) -> int:
    """How many answer tokens a chat stream's events carried (``return_token_ids``)."""
    n = 0
    for data in events:
        with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
            n += len(json.loads(data)["choices"][0].get("token_ids") or [])
    return n


def _killed_mid_answer(faults: FaultStack, c: Conv) -> list[str]:
    """A streamed turn's events, decode-0 SIGKILLed once its first chunks have arrived.

    Should the answer still complete (every token, then ``[DONE]``), the kill did not land
    mid-answer and the scenario did not happen; that is retried once, after decode is back. Any
    other ``[DONE]`` fails the test with what the stream and decode-0 said.
    """
    for attempt in (1, 2):
        pid = faults.pid("decode-0")
        with streamed_turn(c, **LONGEST) as (_, lines):
            seen = [next(lines) for _ in range(6)]  # decode is mid-answer
            kill9(faults, "decode-0")
            with contextlib.suppress(psutil.Error):
                # SIGKILL is final; a process still running here would say the kill missed.
                still = psutil.Process(pid).status()
                print(f"\ndecode-0 (pid {pid}) just after SIGKILL: {still}")
            seen += list(lines)
        events = sse_data(seen)
        if events[-1] != "[DONE]":
            return events
        tokens = _answer_tokens(events)
        diagnosis = (f"attempt {attempt}: decode-0 (pid {pid}) was SIGKILLed after the stream's "
                     f"first 6 lines, yet the stream ended with [DONE] after {tokens} answer "
                     f"tokens of {LONGEST['max_tokens']}; its last events: {events[-3:]}")
        print(diagnosis)
        if tokens < LONGEST["max_tokens"] or attempt == 2:
            log = faults.log("decode-0")
            pytest.fail(f"{diagnosis}\ndecode-0's log ends:\n{log[-3000:]}")
        wait_back(faults, "decode-0")
        c.turn(retry_s=60)
    raise AssertionError("unreachable")


def test_decode_killed_mid_turn(faults: FaultStack, reference_vllm: Reference):
    restarts = _restarts(faults)
    c = Conv(faults, reference_vllm)
    c.turn()
    # The turn in flight fails: its stream ends with an error event and no [DONE], which the
    # OpenAI SDK raises as APIError (a non-streamed turn gets the same error as a 502).
    last = _killed_mid_answer(faults, c)[-1]
    err = json.loads(last)["error"]
    assert err["code"] == "upstream_unavailable" and err["message"], err
    print(f"\ndecode killed mid-turn: stream ended with {err}")
    r2 = c.post()
    assert_retryable(r2)  # and so does any turn until decode is back
    wait_back(faults, "decode-0")
    outcome = c.turn(retry_s=60)
    assert outcome.startswith("miss:"), outcome  # its KV died with it
    print(f"decode back (healthy {faults.restart_times_s('decode-0')} s after its restart): "
          f"next turn {outcome}, then {c.turn()}")
    # KV prefill computed for a reader that never came goes when vLLM's prefill lease
    # (kv_lease_duration: PREFILL_KV_LEASE_S here, 120 s on CPU profiles) lapses.
    print(f"  held then: {held(faults)}; all KV freed "
          f"{assert_nothing_held(faults, within_s=PREFILL_KV_LEASE_S + 30):.0f} s after")
    # The supervisor said it restarted what died (this test's kill, not the module's others).
    assert _restarts(faults) > restarts, faults.say
