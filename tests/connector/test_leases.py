"""The lease table as the engine loop and the control channel use it (no vLLM, fake clock)."""

from __future__ import annotations

import threading

import pytest

from kvtether.connector._leases import (
    Gone,
    LeaseTable,
    NotFound,
    Opened,
    Published,
    Released,
    Releasing,
    Renewed,
    TooLateToRenew,
)
from kvtether.protocol import LeaseInfo, LeaseState


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


SLACK_S = 30.0  # LeaseTable's default worker_slack_s


def make_table(clock: FakeClock, **kwargs: object) -> LeaseTable:
    return LeaseTable(clock=clock, wall=lambda: clock.now + 1e9, op_timeout_s=2.0, **kwargs)


def open_lease(table: LeaseTable, key: str = "k1", rid: str = "r1", tokens: int = 100,
               ttl_s: float = 30.0) -> Opened:
    handle = {"remote_block_ids": [[1, 2, 3, 4]], "remote_num_tokens": tokens}
    return table.open(key, rid, handle, retained_blocks=4, retained_tokens=tokens, ttl_s=ttl_s)


def info_of(table: LeaseTable, key: str) -> LeaseInfo:
    info = table.lease(key)
    assert isinstance(info, LeaseInfo), info
    return info


def gone_as(result: object) -> LeaseState:
    """The state a :class:`Gone` result says the lease ended as."""
    assert isinstance(result, Gone), result
    return result.state


def test_open_publishes_handle_with_lease_deadline(clock: FakeClock) -> None:
    table = make_table(clock)
    opened = open_lease(table, ttl_s=30)
    assert opened.deadline == 1030.0
    # The worker would free the blocks only after the slack: the engine loop ends the lease.
    assert opened.updates == {"r1": 1030.0 + SLACK_S}
    body = table.handle("k1", wait_s=0)
    assert isinstance(body, Published)
    assert body.kv_transfer_params["remote_blocks_expiry_time"] == 1030.0
    assert body.info.state is LeaseState.ACTIVE
    assert body.info.remaining_s == 30.0
    assert body.info.deadline_unix_s == pytest.approx(1e9 + 1030.0)
    assert table.counters()["handles_published"] == 1


def test_initial_lease_is_capped(clock: FakeClock) -> None:
    table = make_table(clock, max_lease_ttl_s=10)
    assert open_lease(table, ttl_s=3600).deadline == 1010.0


def test_renew_is_answered_at_once_and_the_worker_learns_it_at_the_next_step(
    clock: FakeClock,
) -> None:
    table = make_table(clock)
    open_lease(table, ttl_s=30)
    clock.now += 20
    woken: list[bool] = []
    table.on_queued = lambda: woken.append(True)
    reply = table.renew("k1", 60)  # no engine thread at all
    assert isinstance(reply, Renewed) and woken == [True]  # a sleeping engine steps to tell it
    assert reply.info.remote_blocks_expiry_time == 1080.0 and reply.info.renewals == 1
    assert table.has_pending_work()
    assert table.drain() == {"r1": 1080.0 + SLACK_S}  # what the worker receives
    assert table.drain() == {}  # once
    handle = table.handle("k1", 0)
    assert isinstance(handle, Published)
    assert handle.kv_transfer_params["remote_blocks_expiry_time"] == 1080.0
    assert table.counters()["leases_renewed"] == 1


def test_renew_never_shortens_a_lease(clock: FakeClock) -> None:
    """A handle already forwarded carries the current deadline and P trusts it."""
    table = make_table(clock)
    open_lease(table, ttl_s=300)
    reply = table.renew("k1", 10)
    assert isinstance(reply, Renewed) and reply.info.remote_blocks_expiry_time == 1300.0
    assert table.drain() == {"r1": 1300.0 + SLACK_S}


def test_renew_too_close_to_expiry_is_refused(clock: FakeClock) -> None:
    table = make_table(clock, renew_guard_s=1.0)
    open_lease(table, ttl_s=30)
    clock.now += 29.5
    reply = table.renew("k1", 60)
    assert isinstance(reply, TooLateToRenew) and reply.remaining_s == pytest.approx(0.5)
    assert table.drain() == {}


def test_the_engine_loop_ends_a_lease_at_its_deadline(clock: FakeClock) -> None:
    """The table owns expiry: the worker's own deadline is later by the slack."""
    table = make_table(clock)
    open_lease(table, ttl_s=5)
    assert table.next_deadline() == 1005.0  # when a sleeping engine wakes
    clock.now += 4.9
    assert not table.has_pending_work() and table.drain() == {}
    clock.now += 0.2
    assert table.has_pending_work()
    assert table.drain() == {"r1": 1005.0}  # at or before the clock: freed in this step
    assert table.next_deadline() is None
    assert table.renew("k1", 60) == Gone(LeaseState.EXPIRED, info_of(table, "k1"))
    assert gone_as(table.handle("k1", 0)) is LeaseState.EXPIRED
    table.on_freed(["r1"])
    assert info_of(table, "k1").state is LeaseState.EXPIRED
    assert table.counters()["leases_expired"] == 1


def test_release_frees_at_once_and_reports_released(clock: FakeClock) -> None:
    table = make_table(clock)
    open_lease(table)
    sink: dict[str, float] = {}

    def engine() -> None:
        while not table.has_pending_work():
            threading.Event().wait(0.001)
        sink.update(table.drain())
        table.on_freed([rid for rid, deadline in sink.items() if deadline <= clock.now])

    thread = threading.Thread(target=engine)
    thread.start()
    reply = table.release("k1")
    thread.join()
    assert sink == {"r1": 1000.0}  # deadline "now": the worker reaps it in the same step
    assert isinstance(reply, Released) and reply.info.state is LeaseState.RELEASED
    assert table.totals().retained_tokens == 0
    assert gone_as(table.handle("k1", 0)) is LeaseState.RELEASED
    assert isinstance(table.release("k1"), Released)  # idempotent
    assert table.counters()["leases_released"] == 1


def test_a_release_that_does_not_wait_answers_202_without_an_engine_step(
    clock: FakeClock,
) -> None:
    # A loaded engine's step can outlast a session client's DELETE: the release is decided at
    # once, and the worker is told at the next step.
    table = make_table(clock)
    open_lease(table)
    woken: list[bool] = []
    table.on_queued = lambda: woken.append(True)
    reply = table.release("k1", wait_s=0)  # no engine thread at all
    assert isinstance(reply, Releasing) and reply.info.state is LeaseState.RELEASING
    assert woken == [True]
    assert gone_as(table.handle("k1", 0)) is LeaseState.RELEASED  # no handle from now on
    assert gone_as(table.renew("k1", 60)) is LeaseState.RELEASED  # nor a renewal
    assert table.has_pending_work()  # a sleeping engine steps to tell its worker
    assert table.drain() == {"r1": 1000.0}  # the worker is told to free it at once
    assert table.drain() == {}  # once
    table.on_freed(["r1"])
    assert info_of(table, "k1").state is LeaseState.RELEASED


def test_a_release_after_a_renewal_in_the_same_step_wins(clock: FakeClock) -> None:
    table = make_table(clock)
    open_lease(table)
    assert isinstance(table.renew("k1", 60), Renewed)
    assert isinstance(table.release("k1", wait_s=0), Releasing)
    assert table.drain() == {"r1": 1000.0}  # the release's deadline, not the renewal's


def test_freed_after_deadline_is_expired_before_is_consumed(clock: FakeClock) -> None:
    table = make_table(clock)
    open_lease(table, "a", "ra", ttl_s=5)
    open_lease(table, "b", "rb", ttl_s=50)
    clock.now += 6
    table.on_freed(["ra", "rb", "not-a-lease"])
    assert info_of(table, "a").state is LeaseState.EXPIRED
    assert info_of(table, "b").state is LeaseState.CONSUMED
    counters = table.counters()
    assert counters["leases_expired"] == 1 and counters["leases_consumed"] == 1
    assert gone_as(table.handle("b", 0)) is LeaseState.CONSUMED
    listing = table.leases()
    assert listing.leases == [] and {x.key for x in listing.recently_ended} == {"a", "b"}


def test_operations_on_ended_or_unknown_leases_answer_without_engine(clock: FakeClock) -> None:
    table = make_table(clock)
    assert table.renew("nope", 10) == NotFound("nope")
    assert table.lease("nope") == NotFound("nope")
    open_lease(table)
    table.on_freed(["r1"])
    reply = table.renew("k1", 10)  # no engine step needed: nothing is retained
    assert isinstance(reply, Gone) and reply.info.state is LeaseState.CONSUMED


def test_handle_long_poll_returns_when_published(clock: FakeClock) -> None:
    table = make_table(clock)
    result: list[object] = []
    waiter = threading.Thread(target=lambda: result.append(type(table.handle("k1", 5))))
    waiter.start()
    threading.Event().wait(0.05)
    open_lease(table)
    waiter.join(timeout=5)
    assert result == [Published]
    assert table.handle("unknown", wait_s=0.05) == NotFound("unknown")


def test_not_retained_answers_waiters_with_410(clock: FakeClock) -> None:
    table = make_table(clock)
    table.not_retained("k9", "r9")
    assert gone_as(table.handle("k9", 1)) is LeaseState.NOT_RETAINED
    assert table.counters()["handles_not_retained"] == 1


def test_max_retained_tokens_evicts_closest_to_expiry(clock: FakeClock) -> None:
    table = make_table(clock, max_retained_tokens=250)
    open_lease(table, "a", "ra", tokens=100, ttl_s=10)
    open_lease(table, "b", "rb", tokens=100, ttl_s=100)
    updates = open_lease(table, "c", "rc", tokens=100, ttl_s=50).updates
    assert updates == {"ra": 1000.0, "rc": 1050.0 + SLACK_S}  # "a" is freed at once
    table.on_freed(["ra"])
    assert info_of(table, "a").state is LeaseState.EVICTED
    assert table.totals().retained_tokens == 200
    # A lease larger than the cap alone is not kept.
    assert open_lease(table, "d", "rd", tokens=300).updates == {"rd": 1000.0}
    assert gone_as(table.handle("d", 0)) is LeaseState.NOT_RETAINED


def test_reused_key_goes_to_newest_turn(clock: FakeClock) -> None:
    table = make_table(clock)
    open_lease(table, "k", "r1")
    open_lease(table, "k", "r2")
    handle = table.handle("k", 0)
    assert isinstance(handle, Published) and handle.info.request_id == "r2"
    assert info_of(table, "r1").state is LeaseState.ACTIVE  # older turn stays reachable
    table.on_freed(["r1"])
    assert info_of(table, "k").state is LeaseState.ACTIVE


def test_a_renewal_does_not_wait_for_an_engine_that_never_steps(clock: FakeClock) -> None:
    # A loaded (or stalled) engine's step can outlast a heartbeat's wait: the table decides.
    table = LeaseTable(clock=clock, op_timeout_s=0.05)
    open_lease(table, ttl_s=10)
    assert isinstance(table.renew("k1", 60), Renewed)
    assert table.drain() == {"r1": 1060.0 + SLACK_S}


def test_turn_not_retained_under_a_reused_key_hides_the_older_handle(clock: FakeClock) -> None:
    table = make_table(clock)
    open_lease(table, "k", "r1")
    table.not_retained("k", "r2")
    assert gone_as(table.handle("k", 0)) is LeaseState.NOT_RETAINED
    assert info_of(table, "r1").state is LeaseState.ACTIVE


def test_a_release_that_comes_before_its_lease_opens_frees_it_at_once(clock: FakeClock) -> None:
    # The router gave up on a streamed turn (client gone) while decode was still finishing it.
    table = make_table(clock)
    assert table.release("k-early") == NotFound("k-early")
    updates = open_lease(table, key="k-early", rid="r-early", ttl_s=60).updates
    assert updates["r-early"] <= clock.now  # the worker frees the blocks at its next step
    assert table.totals().active_leases == 0
    assert open_lease(table, key="k-other", rid="r-other", ttl_s=60).updates["r-other"] > clock.now
