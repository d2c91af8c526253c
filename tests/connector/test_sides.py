"""The prefill and decode sides of a turn, on stand-ins for vLLM's request and upstream's
send-side state (no vLLM): what each side does with a request the scheduler hands it."""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import pytest

from kvtether.connector._compat import mark_remote_read_done, remote_read_done
from kvtether.connector._leases import Gone, LeaseTable, Published
from kvtether.connector._prefix import annotate_handle
from kvtether.connector._sides import DecodeSide, PrefillSide, is_prefill_request
from kvtether.protocol import LeaseState

BS = 4
SLACK_S = 30.0  # LeaseTable's default worker_slack_s


class Sends:
    """Upstream's send-side state: deadlines for the worker, requests tracked for a reader."""

    def __init__(self) -> None:
        self.deadlines: dict[str, float] = {}
        self.tracked: set[str] = set()

    def send_deadline(self, request_id: str) -> float | None:
        return self.deadlines.get(request_id)

    def set_send_deadlines(self, deadlines: Mapping[str, float]) -> None:
        self.deadlines.update(deadlines)

    def drop_send_deadline(self, request_id: str) -> None:
        self.deadlines.pop(request_id, None)

    def track_for_reader(self, request_id: str) -> None:
        self.tracked.add(request_id)


def request(rid: str, params: dict[str, Any] | None, prompt: list[int],
            output: tuple[int, ...] = ()) -> Any:
    return SimpleNamespace(request_id=rid, kv_transfer_params=params,
                           prompt_token_ids=prompt, num_prompt_tokens=len(prompt),
                           output_token_ids=list(output), all_token_ids=[*prompt, *output])


@pytest.fixture
def table() -> LeaseTable:
    return LeaseTable(clock=lambda: 1000.0, wall=lambda: 2e9)


def decode_handle(tokens: list[int], **extra: Any) -> dict[str, Any]:
    """A prefill request's params carrying decode's handle on ``tokens`` (whole blocks)."""
    params = {"do_remote_decode": True, "remote_block_ids": [list(range(len(tokens) // BS))],
              "remote_num_tokens": len(tokens), **extra}
    annotate_handle(params, tokens, BS)
    return params


# --- which side ------------------------------------------------------------------------------

def test_a_request_is_on_the_prefill_side_when_upstream_marks_it_for_a_remote_decode() -> None:
    assert is_prefill_request({"do_remote_decode": True})
    assert not is_prefill_request({"do_remote_prefill": True, "do_remote_decode": False})
    assert not is_prefill_request({"kvtether_local_prefill": True})


# --- prefill ---------------------------------------------------------------------------------

def test_prefill_reads_a_handle_the_prompt_repeats_and_reports_the_read(
    table: LeaseTable,
) -> None:
    side = PrefillSide(table, require_block_hashes=False)
    held = list(range(100, 116))
    req = request("p-1", decode_handle(held), [*held, 1, 2, 3])
    assert side.may_read(req, num_computed_tokens=0)
    side.allocated(req, num_external_tokens=16)
    delay, out = side.finished(req, True, {"remote_blocks_expiry_time": 5.0},
                               {"queue_s": 0.1}, send_deadline=9.0)
    assert delay is True and out is not None
    assert out["kvtether_pull"] == "pulled" and out["kvtether_reused_tokens"] == 16
    assert out["kvtether_timings"] == {"queue_s": 0.1}
    assert out["remote_blocks_expiry_time"] == 5.0  # upstream's own deadline is kept
    counters = table.counters()
    assert counters["pulls_pulled"] == 1 and counters["pulled_tokens"] == 16


def test_prefill_cuts_a_handle_to_the_blocks_the_prompt_repeats(table: LeaseTable) -> None:
    side = PrefillSide(table, require_block_hashes=False)
    held = list(range(100, 116))
    params = decode_handle(held)
    req = request("p-1", params, [*held[:8], 7, 7, 7, 7, 7, 7, 7, 7])  # history rewritten
    assert side.may_read(req, num_computed_tokens=0)
    assert params["remote_num_tokens"] == 8  # what upstream reads now
    side.allocated(req, num_external_tokens=8)
    _, out = side.finished(req, True, {}, None, send_deadline=None)
    assert out is not None
    assert out["kvtether_prefix_break"] is True and out["kvtether_prefix_match_tokens"] == 8
    assert table.counters()["prefix_breaks"] == 1


def test_prefill_reads_nothing_of_a_handle_the_prompt_does_not_repeat(table: LeaseTable) -> None:
    side = PrefillSide(table, require_block_hashes=False)
    req = request("p-1", decode_handle(list(range(100, 108))), list(range(8)))
    assert not side.may_read(req, num_computed_tokens=0)
    side.allocated(req, num_external_tokens=0)
    _, out = side.finished(req, True, {}, None, send_deadline=None)
    assert out is not None and out["kvtether_pull"] == "no_match"


def test_prefill_offers_a_handle_once(table: LeaseTable) -> None:
    # Upstream would offer it again after a failed read or a preemption, but never read it.
    side = PrefillSide(table, require_block_hashes=False)
    held = list(range(100, 108))
    params = decode_handle(held)
    mark_remote_read_done(params)
    assert not side.may_read(request("p-1", params, held), num_computed_tokens=0)


def test_a_failed_read_is_reported_failed(table: LeaseTable) -> None:
    side = PrefillSide(table, require_block_hashes=False)
    held = list(range(100, 108))
    req = request("p-1", decode_handle(held), [*held, 1])
    side.may_read(req, num_computed_tokens=0)
    side.allocated(req, num_external_tokens=8)
    side.read_failed("p-1")
    _, out = side.finished(req, True, {}, None, send_deadline=None)
    assert out is not None and out["kvtether_pull"] == "failed"
    assert out["kvtether_reused_tokens"] == 0


def test_prefill_exports_its_own_deadline_for_the_new_turn_s_kv(table: LeaseTable) -> None:
    side = PrefillSide(table, require_block_hashes=False)
    req = request("p-0", {"do_remote_decode": True, "kvtether_report_token_ids": True}, [1, 2])
    delay, out = side.finished(req, True, {}, None, send_deadline=1480.0)
    assert delay and out == {"remote_blocks_expiry_time": 1480.0,
                             "kvtether_prompt_token_ids": [1, 2]}
    assert "kvtether_pull" not in out  # no decode handle: nothing read
    assert side.finished(req, False, None, None, send_deadline=None) == (False, None)


# --- decode ----------------------------------------------------------------------------------

def decode_side(table: LeaseTable, sends: Sends) -> DecodeSide:
    return DecodeSide(sends, table, block_size=BS, default_lease_ttl_s=60.0)


def finished_decode_params(key: str | None, **extra: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"do_remote_prefill": True, **extra}
    if key is not None:
        params["kvtether_handle_key"] = key
    mark_remote_read_done(params)  # upstream read prefill's KV for it
    return params


def test_decode_retains_a_finished_turn_under_a_lease_and_publishes_it(
    table: LeaseTable,
) -> None:
    sends = Sends()
    side = decode_side(table, sends)
    req = request("d-1", finished_decode_params("conv/t1", kvtether_lease_ttl_s=30),
                  list(range(10, 20)), output=(7, 7))
    handle = {"do_remote_decode": True, "remote_block_ids": [[0, 1, 2]], "remote_num_tokens": 11}
    delay, out = side.finished(req, True, handle, {"engine_s": 1.0})
    assert delay and out is handle
    assert out["kvtether_lease_key"] == "conv/t1" and out["kvtether_timings"] == {"engine_s": 1.0}
    assert out["remote_blocks_expiry_time"] == 1030.0  # the lease's, which prefill trusts
    assert len(out["kvtether_block_hashes"]) == 11 // BS
    assert sends.deadlines == {"d-1": 1030.0 + SLACK_S}  # the worker's, later by the slack
    assert isinstance(table.handle("conv/t1", 0), Published)


def test_a_turn_without_a_key_is_leased_under_its_request_id(table: LeaseTable) -> None:
    side = decode_side(table, Sends())
    handle = {"remote_block_ids": [[0]], "remote_num_tokens": 4}
    _, out = side.finished(request("d-1", finished_decode_params(None), [1, 2, 3, 4]),
                           True, handle, None)
    assert out is not None and out["kvtether_lease_key"] == "d-1"
    assert isinstance(table.handle("d-1", 0), Published)


def test_a_turn_that_retains_nothing_answers_its_waiters_not_retained(table: LeaseTable) -> None:
    side = decode_side(table, Sends())
    req = request("d-1", finished_decode_params("k"), [1, 2, 3, 4])
    assert side.finished(req, False, None, None) == (False, None)  # aborted
    gone = table.handle("k", 0)
    assert isinstance(gone, Gone) and gone.state is LeaseState.NOT_RETAINED


def test_a_request_that_skipped_the_p_d_path_is_not_retained(table: LeaseTable) -> None:
    # Upstream would hold its blocks, but its worker never tracked it: never freed.
    sends = Sends()
    sends.deadlines["x-1"] = 1480.0
    side = decode_side(table, sends)
    req = request("x-1", {"kvtether_handle_key": "k"}, [1, 2, 3, 4])
    assert side.finished(req, True, {"remote_num_tokens": 4}, {"engine_s": 1.0}) == (False, None)
    assert sends.deadlines == {}
    gone = table.handle("k", 0)
    assert isinstance(gone, Gone) and gone.state is LeaseState.NOT_RETAINED
    plain = request("x-2", {"kvtether_handle_key": "k2"}, [1])
    assert side.finished(plain, False, {"a": 1}, None) == (False, {"a": 1})


def test_a_local_prefill_turn_is_held_like_a_decode_request_and_reports_its_hits(
    table: LeaseTable,
) -> None:
    sends = Sends()
    side = decode_side(table, sends)
    params = {"kvtether_local_prefill": True, "kvtether_handle_key": "k"}
    req = request("d-2", params, list(range(12)))
    side.local_prefill_hit(req, num_computed_tokens=8)
    side.local_prefill_hit(req, num_computed_tokens=0)  # asked again (preempted): the first
    side.hold_local_prefill(req)
    assert sends.tracked == {"d-2"} and remote_read_done(params)
    _, out = side.finished(req, True, {"remote_block_ids": [[0, 1]], "remote_num_tokens": 8},
                           None)
    assert out is not None and out["kvtether_cached_tokens"] == 8


@pytest.mark.parametrize(("raw", "ttl_s"), [(None, 60.0), (12.5, 12.5), ("30", 30.0),
                                             (-1, 60.0), ("soon", 60.0), (float("nan"), 60.0)])
def test_the_initial_lease_is_the_one_asked_for_when_it_is_valid(
    table: LeaseTable, raw: Any, ttl_s: float,
) -> None:
    params = {} if raw is None else {"kvtether_lease_ttl_s": raw}
    assert decode_side(table, Sends()).initial_ttl_s(params) == ttl_s
