"""Decode declines to read a new turn's KV from prefill once prefill may have freed it.

vLLM 0.32 checks a deadline before a read only when the handle carries one, which upstream
exports with decode-held KV alone; kvtether's prefill exports its own (its hold, extended by
decode's heartbeats). Decode's worker credits the heartbeats it sent. Checked here on the
worker's decision; the real stack's late read is in tests/integration/test_faults_real.py.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from cachetools import TTLCache  # noqa: E402

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (  # noqa: E402
    NixlPullConnectorWorker,
)

from kvtether.connector.nixl import HeartbeatRun, KVTetherWorker  # noqa: E402

LEASE_EXTENSION_S = 80  # kv_lease_duration 120 * 2 // 3


def worker() -> Any:
    """The worker's expiry decision without a NIXL agent (only what it reads is set)."""
    w = object.__new__(KVTetherWorker)
    w._engine_clock_offset = {"engine-p": 0.0}
    w._lease_extension = LEASE_EXTENSION_S
    w._remote_agents = {"engine-p": {}}
    w._heartbeats = TTLCache(maxsize=16, ttl=LEASE_EXTENSION_S)
    return w


def read(expiry: float | None) -> Any:
    remote = SimpleNamespace(engine_id="engine-p", request_id="p-req", blocks_expiry_time=expiry)
    return SimpleNamespace(remote=remote, local_physical_block_ids=[[3, 4]])


def heartbeat(w: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode's worker sends prefill a heartbeat for the waiting turn (upstream's send is
    stubbed: there is no agent to send with)."""
    monkeypatch.setattr(NixlPullConnectorWorker, "_send_heartbeats", lambda self, meta: None)
    meta = SimpleNamespace(heartbeat_by_engine={"engine-p": SimpleNamespace(req_ids={"p-req"})})
    w._send_heartbeats(meta)


def test_a_read_before_prefill_s_deadline_goes_ahead() -> None:
    assert not worker()._is_turn2_read_expired(read(time.perf_counter() + 60))


def test_a_read_past_prefill_s_deadline_is_declined() -> None:
    assert worker()._is_turn2_read_expired(read(time.perf_counter() + 1))


def test_heartbeats_sent_while_prefill_held_keep_the_read(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    w = worker()
    now = time.perf_counter()
    # The turn waited on decode: heartbeats from 20 s ago, while prefill still held the KV
    # (its exported deadline passed 10 s ago), to the latest 2 s ago.
    w._heartbeats["p-req"] = HeartbeatRun(now - 20, now - 4, True)
    heartbeat(w, monkeypatch)
    assert not w._is_turn2_read_expired(read(now - 10))


def test_a_heartbeat_after_prefill_s_deadline_vouches_for_nothing(monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    # A stalled decode engine whose first heartbeat goes out in the step that reads: prefill
    # may have freed the blocks already (a heartbeat only extends what it still holds).
    w = worker()
    heartbeat(w, monkeypatch)
    assert w._is_turn2_read_expired(read(time.perf_counter() - 30))


def test_a_gap_in_the_heartbeats_breaks_the_credit(monkeypatch: pytest.MonkeyPatch) -> None:
    w = worker()
    heartbeat(w, monkeypatch)
    first, _, _ = w._heartbeats["p-req"]
    w._heartbeats["p-req"] = HeartbeatRun(first - LEASE_EXTENSION_S, first - LEASE_EXTENSION_S,
                                         True)
    heartbeat(w, monkeypatch)  # the one before was an extension ago: prefill may have let go
    assert w._heartbeats["p-req"][2] is False
    assert w._is_turn2_read_expired(read(first - LEASE_EXTENSION_S + 6))


def test_without_a_deadline_upstream_reads_as_before() -> None:
    assert not worker()._is_turn2_read_expired(read(None))
