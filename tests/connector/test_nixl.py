"""The kvtether connector (``kvtether.connector.nixl``) inside a real vLLM 0.32 ``Scheduler``
(simulated worker, no NIXL), and its worker's own decisions.

Decode side: a finished turn is retained under a lease, its handle published; renew, release
and expiry travel through ``reqs_to_send`` to the worker and come back as freed blocks.
Prefill side: a decode handle is cut to the prefix the prompt repeats, and P reports it.
Worker: decode declines to read a new turn's KV from prefill once prefill may have freed it
(vLLM 0.32 checks a deadline only when the handle carries one, which upstream exports with
decode-held KV alone; kvtether's prefill exports its own, extended by decode's heartbeats, which
decode's worker credits); a lease kvtether ended is not warned about as an expiry; each step
brackets the stall watch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from cachetools import TTLCache  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (  # noqa: E402
    NixlPullConnectorWorker,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvtether.connector import nixl  # noqa: E402
from kvtether.connector._compat.upstream import UPSTREAM_WORKER_LOGGER  # noqa: E402
from kvtether.connector._leases import (  # noqa: E402
    Gone,
    Published,
    Released,
    Renewed,
)
from kvtether.connector._prefix import annotate_handle  # noqa: E402
from kvtether.connector.nixl import HeartbeatRun, KVTetherWorker, NixlConnector  # noqa: E402
from kvtether.protocol import LeaseInfo, LeaseState  # noqa: E402
from tests.support.waiting import wait_for  # noqa: E402

from .harness import BS, Harness, decode_leg, finish_decode_turn  # noqa: E402


def published_handle(h: Harness, key: str) -> Published:
    handle = h.conn.leases.handle(key, wait_s=0)
    assert isinstance(handle, Published), handle
    return handle


def lease_info(h: Harness, key: str) -> LeaseInfo:
    info = h.conn.leases.lease(key)
    assert isinstance(info, LeaseInfo), info
    return info


def lease_state(h: Harness, key: str) -> LeaseState:
    return lease_info(h, key).state


def call_during_step(h: Harness, call: Callable[[], object]) -> tuple[object, Any]:
    """Run a control-channel call (a renewal, answered at once, or a release, which waits for
    the worker) and step the loop once."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(call()))
    thread.start()
    leases = h.conn.leases
    wait_for(lambda: leases._updates or not thread.is_alive(), timeout_s=5,
             interval_s=0.001, message="the call to reach the lease table")
    out = h.step()
    thread.join(timeout=5)
    return result[0], out.kv_connector_metadata


def test_decode_turn_publishes_handle_with_lease_and_hashes(tmp_path: Path) -> None:
    h = Harness(tmp_path, extra={"kvtether_lease_ttl_s": 30})
    tokens = finish_decode_turn(h, "d-1", "key-1", kvtether_lease_ttl_s=12.5)
    params = h.outputs["d-1"]  # what a non-streaming response carries
    assert params["do_remote_decode"] is True and params["kvtether_lease_key"] == "key-1"
    n = params["remote_num_tokens"]
    assert n == len(tokens) - 1  # the last sampled token has no KV yet
    expected: dict[str, Any] = {}
    annotate_handle(expected, tokens[:n], BS)
    assert params["kvtether_block_hashes"] == expected["kvtether_block_hashes"]
    assert params["remote_blocks_expiry_time"] == pytest.approx(time.perf_counter() + 12.5, abs=2)

    published = published_handle(h, "key-1")
    block_ids = [list(group) for group in params["remote_block_ids"]]
    assert [list(g) for g in published.kv_transfer_params["remote_block_ids"]] == block_ids
    assert published.info.retained_tokens == n
    meta = h.step().kv_connector_metadata
    # The lease's deadline plus the slack (not the 480 s TTL): the engine loop ends the lease.
    slack = h.conn.leases.worker_slack_s
    assert meta.reqs_to_send["d-1"] == params["remote_blocks_expiry_time"] + slack
    assert h.conn.status().totals.active_leases == 1


def test_renew_reaches_worker_and_release_frees_blocks_in_one_step(tmp_path: Path) -> None:
    h = Harness(tmp_path, extra={"kvtether_lease_ttl_s": 30})
    finish_decode_turn(h, "d-1", "key-1")
    h.step()
    reply, meta = call_during_step(h, lambda: h.conn.leases.renew("key-1", 100))
    assert isinstance(reply, Renewed)
    slack = h.conn.leases.worker_slack_s
    assert meta.reqs_to_send["d-1"] - meta.scheduler_clock == pytest.approx(100 + slack, abs=0.5)
    assert h.worker.deadlines["d-1"] - time.perf_counter() == pytest.approx(100 + slack, abs=0.5)
    handle = published_handle(h, "key-1")
    # the same instant, computed in another order: equal up to float rounding
    assert handle.kv_transfer_params["remote_blocks_expiry_time"] == pytest.approx(
        meta.reqs_to_send["d-1"] - slack, abs=1e-6)

    free_before = h.free_blocks()
    reply, meta = call_during_step(h, lambda: h.conn.leases.release("key-1"))
    assert isinstance(reply, Released) and reply.info.state is LeaseState.RELEASED
    assert "d-1" not in h.scheduler.requests  # freed by the same engine step
    assert h.free_blocks() > free_before
    assert isinstance(h.conn.leases.handle("key-1", 0), Gone)
    assert h.conn.status().counters["leases_released"] == 1


def test_a_renewal_answered_at_once_outlives_a_step_in_flight_past_the_old_deadline(
    tmp_path: Path,
) -> None:
    """A renewal is answered before any engine step applies it. A step scheduled before it
    (async scheduling keeps one in flight) may run after the old deadline: the worker must not
    free the blocks then. Its deadline is the lease's plus the slack, so it does not."""
    h = Harness(tmp_path)
    finish_decode_turn(h, "d-1", "key-1", kvtether_lease_ttl_s=1.3)
    h.step()
    in_flight = h.scheduler.schedule()  # scheduled before the renewal
    assert isinstance(h.conn.leases.renew("key-1", 60), Renewed)  # no step in between
    time.sleep(1.4)  # the old deadline passes while that step runs
    assert h.worker.step(in_flight.kv_connector_metadata) == set()  # nothing freed
    h.scheduler.update_from_output(in_flight, ModelRunnerOutput(
        req_ids=[], req_id_to_index={}, kv_connector_output=KVConnectorOutput()))
    meta = h.step().kv_connector_metadata  # the next step carries the renewal
    slack = h.conn.leases.worker_slack_s
    assert meta.reqs_to_send["d-1"] - meta.scheduler_clock == pytest.approx(60 - 1.4 + slack,
                                                                            abs=0.5)
    h.step()
    assert "d-1" in h.scheduler.requests
    assert lease_state(h, "key-1") is LeaseState.ACTIVE


def test_short_lease_expires_and_frees(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    finish_decode_turn(h, "d-1", "key-1", kvtether_lease_ttl_s=0.3)

    def freed() -> bool:  # else one more engine step
        if "d-1" not in h.scheduler.requests:
            return True
        h.step()
        return False

    wait_for(freed, timeout_s=5, interval_s=0.02, message="d-1 freed")
    assert lease_state(h, "key-1") is LeaseState.EXPIRED


def test_prefill_reading_the_handle_consumes_the_lease(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    finish_decode_turn(h, "d-1", None)  # no key: the lease is keyed by request id
    assert h.outputs["d-1"]["kvtether_lease_key"] == "d-1"
    h.worker.read_by_prefill.add("d-1")
    h.step()
    assert lease_state(h, "d-1") is LeaseState.CONSUMED


def test_aborted_turn_is_reported_not_retained(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.add("d-1", list(range(10, 20)), decode_leg("key-1"), max_tokens=5)
    h.step()
    h.step(recved={"d-1"})
    h.step()
    h.scheduler.finish_requests(["d-1"], RequestStatus.FINISHED_ABORTED)
    handle = h.conn.leases.handle("key-1", wait_s=0)
    assert isinstance(handle, Gone) and handle.state is LeaseState.NOT_RETAINED


def test_plain_request_with_a_key_is_not_retained_forever(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.add("x-1", list(range(10, 20)), {"kvtether_handle_key": "key-x"}, max_tokens=2)
    for _ in range(4):
        h.step()
    assert "x-1" not in h.scheduler.requests  # upstream would hold it with no worker deadline
    handle = h.conn.leases.handle("key-x", 0)
    assert isinstance(handle, Gone) and handle.state is LeaseState.NOT_RETAINED


# --- prefill side ---------------------------------------------------------------------------
SEQ = list(range(100, 122))  # decode's 22 tokens: 5 full blocks + 2


def decode_handle() -> dict[str, Any]:
    handle = {
        "do_remote_prefill": False, "do_remote_decode": True, "remote_engine_id": "engine-d",
        "remote_request_id": "d-7", "remote_block_ids": [[50, 51, 52, 53, 54, 55]],
        "remote_host": "127.0.0.1", "remote_port": 5610, "tp_size": 1, "remote_num_tokens": 22,
    }
    annotate_handle(handle, SEQ, BS)
    return handle


def test_rewritten_history_reads_only_the_matching_prefix(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    prompt = SEQ.copy()
    prompt[9] = 7  # inside block 2
    request = h.add("p-1", prompt + [1, 2, 3], decode_handle())
    meta = h.step().kv_connector_metadata
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    recv = meta.reqs_to_recv["p-1"]
    assert recv.remote.block_ids == [[50, 51]] and recv.remote.num_tokens == 8
    assert [len(g) for g in recv.local_block_ids] == [2]
    h.step(recved={"p-1"})
    h.step()
    report = h.outputs["p-1"]
    assert report["kvtether_pull"] == "pulled" and report["kvtether_reused_tokens"] == 8
    assert report["kvtether_prefix_match_tokens"] == 8 and report["kvtether_prefix_break"] is True
    assert report["kvtether_remote_tokens"] == 22
    assert h.conn.status().counters["prefix_breaks"] == 1


def test_extending_prompt_reads_everything(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.add("p-1", SEQ + [1, 2, 3], decode_handle())
    recv = h.step().kv_connector_metadata.reqs_to_recv["p-1"]
    assert recv.remote.block_ids == [[50, 51, 52, 53, 54, 55]] and recv.remote.num_tokens == 22
    h.step(recved={"p-1"})
    h.step()
    assert h.outputs["p-1"]["kvtether_reused_tokens"] == 22
    assert h.outputs["p-1"]["kvtether_prefix_break"] is False


def test_no_matching_block_reads_nothing_but_tells_decode_to_free(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    request = h.add("p-1", [9] + SEQ[1:] + [1], decode_handle())
    meta = h.step().kv_connector_metadata
    assert request.status != RequestStatus.WAITING_FOR_REMOTE_KVS
    notify = meta.reqs_to_recv["p-1"]  # notify-only: decode frees its blocks at once
    assert not any(notify.local_block_ids) and notify.remote.request_id == "d-7"
    assert h.outputs["p-1"]["kvtether_pull"] == "no_match"


def test_failed_read_recomputes_instead_of_waiting_forever(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    prompt = SEQ + [1, 2, 3]
    request = h.add("p-1", prompt, decode_handle())
    h.step()
    h.step(failed={"p-1"})  # e.g. declined: the handle's expiry was within 5 s
    out = h.step()
    assert out.num_scheduled_tokens.get("p-1") == len(prompt)
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert h.outputs["p-1"]["kvtether_pull"] == "failed"
    assert h.outputs["p-1"]["kvtether_reused_tokens"] == 0


def test_prefill_exports_how_long_it_holds_a_new_turn_s_kv(tmp_path: Path) -> None:
    # Upstream exports a deadline only with decode-held KV; prefill's lets decode decline a
    # read that comes after prefill may have freed the blocks (the worker tests below).
    h = Harness(tmp_path, extra={"kv_lease_duration": 120})
    before = time.perf_counter()
    h.add("p-0", list(range(10, 22)), {"do_remote_decode": True})
    for _ in range(3):
        h.step()
    expiry = h.outputs["p-0"]["remote_blocks_expiry_time"]
    assert before + 120 <= expiry <= time.perf_counter() + 120  # prefill's own hold


# --- where a leg's time went (EngineTimings in the leg's kv_transfer_params) ---------------
def test_prefill_reports_its_queue_and_read_time(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    request = h.add("p-1", SEQ + [1, 2, 3], decode_handle())
    request.arrival_time = time.time() - 0.5  # half a second in vLLM's queue
    h.step()
    time.sleep(0.05)  # the NIXL read
    h.step(recved={"p-1"})
    h.step()
    timings = h.outputs["p-1"]["kvtether_timings"]
    # Lower bounds only: a loaded host makes every step slower, never faster.
    assert timings["queue_s"] >= 0.49 and timings["read_s"] >= 0.049
    assert timings["engine_s"] >= timings["queue_s"] + timings["read_s"]
    assert h.conn.timings == {}  # nothing kept once the request finished


def test_decode_publishes_its_timings_with_the_handle_and_a_fresh_prefill_has_no_read(
    tmp_path: Path,
) -> None:
    h = Harness(tmp_path, extra={"kvtether_lease_ttl_s": 30})
    finish_decode_turn(h, "d-1", "key-1")
    timings = published_handle(h, "key-1").kv_transfer_params["kvtether_timings"]
    assert timings["read_s"] is not None and timings["queue_s"] is not None
    h.add("p-0", list(range(10, 22)), {"do_remote_decode": True})
    for _ in range(3):
        h.step()
    assert h.outputs["p-0"]["kvtether_timings"]["read_s"] is None


# --- the worker: decode's late read of prefill's KV ------------------------------------------

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


# --- the worker: upstream's expiry warning ---------------------------------------------------

def expiry_warning(request_id: str) -> logging.LogRecord:
    """The record upstream's ``_reap_expired_send_leases`` logs."""
    return logging.LogRecord(
        UPSTREAM_WORKER_LOGGER, logging.WARNING, __file__, 1,
        "Releasing expired KV blocks for request %s which were retrieved by %d remote "
        "worker(s) before lease expired.", (request_id, 0), None,
    )


def test_ended_leases_are_not_warned_about_and_lapsed_ones_are(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[Any] = []
    monkeypatch.setattr(KVTetherWorker.__mro__[1], "start_load_kv",
                        lambda self, metadata: started.append(metadata))
    monkeypatch.setattr(nixl._ENDED_BY_KVTETHER, "ended", type(nixl._ENDED_BY_KVTETHER.ended)(
        maxsize=16, ttl=300.0))
    worker = object.__new__(KVTetherWorker)
    meta = SimpleNamespace(scheduler_clock=100.0,
                           reqs_to_send={"released": 99.5, "at-clock": 100.0, "renewed": 160.0})
    worker.start_load_kv(meta)
    assert started == [meta]  # upstream still gets the step's metadata

    quiet = nixl._ENDED_BY_KVTETHER
    assert not quiet.filter(expiry_warning("released"))
    assert not quiet.filter(expiry_warning("at-clock"))
    assert quiet.filter(expiry_warning("renewed"))  # its deadline lapsed later, on its own
    assert quiet.filter(expiry_warning("released"))  # marked once, for the step that freed it
    other = logging.LogRecord("x", logging.WARNING, __file__, 1, "other %s", ("released",), None)
    assert quiet.filter(other)


def test_the_filter_sits_on_upstream_s_worker_logger_once() -> None:
    upstream = logging.getLogger(UPSTREAM_WORKER_LOGGER)
    nixl.quiet_ended_leases()
    nixl.quiet_ended_leases()
    assert upstream.filters.count(nixl._ENDED_BY_KVTETHER) == 1


# --- the connector: each step brackets the stall watch ----------------------------------------

class _Watch:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def begin(self) -> None:
        self.calls.append("begin")

    def end(self) -> None:
        self.calls.append("end")


def test_every_step_of_the_connector_begins_and_ends_the_watch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM binds a step's metadata first and asks for its transfer results last (also on a
    step with no forward pass): that pair brackets the watch, even when the last call raises."""
    worker = object.__new__(KVTetherWorker)
    worker._step_watch = _Watch()
    connector = object.__new__(NixlConnector)
    connector.connector_worker = worker
    results = object()
    parent = KVTetherWorker.__mro__[1]
    monkeypatch.setattr(parent, "get_transfer_results", lambda self: results)
    connector.bind_connector_metadata(object())
    assert worker.get_transfer_results() is results
    # upstream's legacy get_finished goes through get_transfer_results: one end, not two
    monkeypatch.setattr(parent, "get_transfer_results",
                        lambda self: (_ for _ in ()).throw(RuntimeError("nixl")))
    connector.bind_connector_metadata(object())
    with pytest.raises(RuntimeError):
        worker.get_transfer_results()
    assert worker._step_watch.calls == ["begin", "end", "begin", "end"]
