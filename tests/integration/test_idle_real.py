"""Issue 8 on real vLLM P/D (tiny model, the cpu-tiny profile's defaults): an engine that only
holds KV for a remote reader sleeps, and still frees that KV on time.

Upstream, such an engine steps every ~1 ms for the whole lease (thousands of steps a few
seconds); kvtether's ``IdleSleepScheduler`` steps only when woken. Step counts come from each
connector's control-channel status (``idle.engine_steps``); CPU figures are the benchmark's job
(``kvtether bench idle``), not a test's.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.integration.test_leases_real import Conv, _lease

pytestmark = pytest.mark.vllm


def _idle(url: str, headers: dict[str, str]) -> dict:
    status = httpx.get(f"{url}/kvtether/v1/status", headers=headers, timeout=10).json()
    assert status["idle"] is not None, "the engine does not run IdleSleepScheduler"
    return status


def test_an_engine_that_only_holds_kv_sleeps(pd_stack, reference_vllm):
    c = Conv(pd_stack, reference_vllm)
    c.turn()
    assert c.turn() == "fired"
    control = pd_stack.decode_control_urls[0]
    time.sleep(0.5)  # the turn's own bookkeeping steps
    before = _idle(control, pd_stack.control_headers)
    assert before["totals"]["active_leases"] >= 1
    time.sleep(3.0)
    after = _idle(control, pd_stack.control_headers)
    assert after["totals"]["active_leases"] >= 1  # the KV is still held...
    steps = after["idle"]["engine_steps"] - before["idle"]["engine_steps"]
    # ...and the engine took a handful of steps at most (a tick is 5 s; another test's lease
    # may expire meanwhile), where upstream takes one every millisecond.
    assert steps <= 10, (before["idle"], after["idle"])
    # The held KV is still good: the next turn reads it.
    assert c.turn() == "fired"
    httpx.delete(f"{pd_stack.base_url}/v1/sessions/{c.cid}", timeout=30)


def test_a_lease_expiring_while_the_engine_sleeps_is_freed_within_2s(short_lease,
                                                                      reference_vllm):
    c = Conv(short_lease, reference_vllm)
    c.turn()
    key = c.status()["lease_key"]
    lease = _lease(short_lease, key)
    assert lease["state"] == "active"
    # Nothing touches the conversation until well past its deadline: only the waker's
    # deadline wake-up can free it.
    time.sleep(max(0.0, lease["deadline_unix_s"] - time.time()) + 3.0)
    ended = _lease(short_lease, key)
    # If this fails with `releasing`, the router's reap (its copy of the deadline, checked
    # every second) reached the lease before the engine's expiry step and no step freed it
    # since: the engine's own counters say whether it was woken and stepped.
    why = {"lease": ended, "late_s": round(time.time() - lease["deadline_unix_s"], 3),
           "decode_idle": _idle(short_lease.decode_control_urls[0],
                                short_lease.control_headers)["idle"]}
    assert ended["state"] == "expired", why
    assert ended["retained_tokens"] == 0
    assert c.turn() == "miss:lease_expired"  # and the turn after it is correct (checked)
