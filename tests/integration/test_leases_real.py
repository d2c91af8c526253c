"""Issue 3 on real vLLM P/D (tiny model): leases renewed by heartbeats, released, bounded.

The ``short_lease`` router gives each turn's KV a 10 s initial lease, so a tool that runs 30 s
outlives it unless heartbeats renew it.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import threading
import time
import uuid

import httpx
import pytest

from kvtether import protocol as p

from tests.support.stacks import serve_router
from tests.support.waiting import wait_for

pytestmark = pytest.mark.vllm

SYSTEM = "you are a helpful agent. use the tools. " * 8
TOOL_RESULT = "ok tests run result found file path value true " * 3


# Words the tiny model's tokenizer knows (anything else is one shared <unk>).
_WORDS = sorted(set((SYSTEM + TOOL_RESULT + " please read the files").replace(".", "").split()))
# Replies long enough that losing the decode-held KV loses more than a block (32 tokens on
# cpu-tiny): prefill's own prefix cache holds the previous prompt's whole blocks, and a turn
# that recomputes less than a block of what it could reuse counts as fired. No special tokens
# (ids 0-3): vLLM leaves them out of the reply's text, so the history would not re-send them.
MAX_TOKENS = 40
NO_SPECIAL = {"logit_bias": {str(i): -100 for i in range(4)}}


class Conv:
    """A conversation driven by hand over plain HTTP, checked against the reference.

    Each one opens with its own random words: greedy conversations with equal prompts give
    equal answers, and prefill's prefix cache would then hold one conversation's turns for
    another (its turns would reuse KV whatever happened to their own).
    """

    def __init__(self, stack, reference, cid: str | None = None,
                 max_tokens: int = MAX_TOKENS) -> None:
        self.url = stack.base_url
        self.ref = reference.base_url
        self.model = stack.model
        self.cid = cid or f"lease-{uuid.uuid4().hex[:8]}"
        self.max_tokens = max_tokens
        rng = random.Random(self.cid)
        opening = " ".join(rng.choice(_WORDS) for _ in range(8))
        self.msgs = [{"role": "system", "content": f"{opening}. {SYSTEM}"},
                     {"role": "user", "content": "please run the tests and read the files"}]

    def turn(self, *, check: bool = True, url: str | None = None) -> str:
        body = {"model": self.model, "messages": self.msgs, "max_tokens": self.max_tokens,
                "temperature": 0, "return_token_ids": True, **NO_SPECIAL}
        # The reference answers first: the lease clock starts when the P/D turn ends, and a
        # slow reference call must not eat into it before the test's next step.
        ref = (httpx.post(f"{self.ref}/v1/chat/completions", json=body, timeout=600).json()
               if check else None)
        # Hints (none in particular) mark a kvtether client, whose leases are lease_ttl_s; a
        # client that sends none is held as a coding agent is (docs/leases.md).
        r = httpx.post(f"{url or self.url}/v1/chat/completions", json=body,
                       headers={"X-Conversation-Id": self.cid, p.HEADER_HINTS: "{}"},
                       timeout=600)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if ref is not None:
            assert choice["token_ids"] == ref["choices"][0]["token_ids"], "output differs"
        self.msgs = self.msgs + [{"role": "assistant", "content": choice["message"]["content"]},
                                 {"role": "tool", "content": TOOL_RESULT}]
        return r.headers["x-kvtether-reuse"]

    def heartbeat(self, **body) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/sessions/{self.cid}/heartbeat", json=body, timeout=30)

    def status(self) -> dict:
        return httpx.get(f"{self.url}/v1/sessions/{self.cid}", timeout=30).json()


def _lease(stack, key: str) -> dict:
    r = httpx.get(f"{stack.decode_control_urls[0]}/kvtether/v1/leases/{key}",
                  headers=stack.control_headers, timeout=10)
    if r.status_code == 200:
        return r.json()
    return r.json().get("lease", {"state": "unknown", "reply": r.json()})


def _all_leases(stack) -> dict:
    return httpx.get(f"{stack.decode_control_urls[0]}/kvtether/v1/leases",
                     headers=stack.control_headers, timeout=10).json()


def test_heartbeats_keep_kv_through_a_long_tool(short_lease, reference_vllm):
    c = Conv(short_lease, reference_vllm)
    assert c.turn() == "miss:first_turn"
    deadline = time.monotonic() + 3 * short_lease.lease_ttl_s  # a 30 s tool call
    while time.monotonic() < deadline:
        r = c.heartbeat(phase="tool_running", tool_name="pytest", expected_duration_s=5)
        assert r.status_code == 200, r.text
        time.sleep(3)
    assert c.turn() == "fired"


def test_without_heartbeats_the_lease_lapses_and_the_turn_is_correct(short_lease, reference_vllm):
    c = Conv(short_lease, reference_vllm)
    c.turn()
    key = c.status()["lease_key"]
    assert key, c.status()
    time.sleep(3 * short_lease.lease_ttl_s)
    # A crashed client's KV is freed when its lease lapses, long before vLLM's 480 s.
    lease = _lease(short_lease, key)
    assert lease["state"] == "expired", (lease, _all_leases(short_lease))
    assert c.turn() == "miss:lease_expired"  # and token-identical (checked in turn())


def test_release_frees_decode_blocks_within_a_second(short_lease, reference_vllm):
    c = Conv(short_lease, reference_vllm)
    c.turn()
    st = c.status()
    key = st["lease_key"]
    assert st["retained_tokens"] > 0 and _lease(short_lease, key)["state"] == "active"
    t0 = time.monotonic()
    deleted = httpx.delete(f"{short_lease.base_url}/v1/sessions/{c.cid}", timeout=10)
    assert deleted.status_code == 200, deleted.text
    wait_for(lambda: _lease(short_lease, key)["state"] == "released",
             timeout_s=max(0.0, 1.0 - (time.monotonic() - t0)), interval_s=0.05,
             message=lambda: _lease(short_lease, key))
    assert c.heartbeat().status_code == 410
    assert c.turn() == "miss:released"


def test_races_never_give_a_wrong_answer_or_a_failed_turn(short_lease, reference_vllm):
    rng = random.Random(7)
    convs = [Conv(short_lease, reference_vllm, max_tokens=4) for _ in range(4)]
    for c in convs:
        c.turn()
    stop = threading.Event()

    def noise(c: Conv) -> None:
        # Heartbeats and releases racing the conversation's next turn and its expiry.
        while not stop.is_set():
            action = rng.random()
            if action < 0.6:
                c.heartbeat(expected_duration_s=rng.random())
            elif action < 0.75:
                httpx.delete(f"{c.url}/v1/sessions/{c.cid}", timeout=30)
            time.sleep(rng.random() * 0.3)

    with cf.ThreadPoolExecutor(8) as pool:
        noisy = [pool.submit(noise, c) for c in convs]
        try:
            for round_ in range(3):
                outcomes = list(pool.map(lambda c: c.turn(), convs))
                assert all(o == "fired" or o.startswith("miss:") for o in outcomes), outcomes
                time.sleep(rng.random() * 2)
        finally:
            stop.set()
            for f in noisy:
                f.result()


def test_budget_evicts_the_least_valuable_session(pd_stack, reference_vllm):
    a, b, c = (Conv(pd_stack, reference_vllm) for _ in range(3))
    a.turn(check=False)
    one_session = None
    with serve_router(pd_stack, lease_ttl_s=900, max_retained_tokens=10_000) as probe_url:
        probe = Conv(pd_stack, reference_vllm)
        probe.turn(url=probe_url, check=False)
        one_session = httpx.get(f"{probe_url}/v1/sessions/{probe.cid}").json()["retained_tokens"]
        httpx.delete(f"{probe_url}/v1/sessions/{probe.cid}")
    cap = int(one_session * 2.5)  # room for two sessions, not three
    with serve_router(pd_stack, lease_ttl_s=900, max_retained_tokens=cap) as url:
        a.turn(url=url, check=False)
        time.sleep(1.0)  # a is now the idlest
        b.turn(url=url, check=False)
        b_status = httpx.get(f"{url}/v1/sessions/{b.cid}").json()
        assert b_status["lease_state"] == "active"
        c.turn(url=url, check=False)
        states = {x.cid: httpx.get(f"{url}/v1/sessions/{x.cid}").json()["lease_state"]
                  for x in (a, b, c)}
        assert states == {a.cid: "evicted", b.cid: "active", c.cid: "active"}, states
        assert b.turn(url=url) == "fired"
        # a's turn retains KV again, and the cap makes room by evicting c, now the idlest.
        assert a.turn(url=url) == "miss:evicted"  # and correct
        for x in (a, b, c):
            httpx.delete(f"{url}/v1/sessions/{x.cid}", timeout=60)
