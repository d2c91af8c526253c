"""Which conversations' retained KV is worth the most, and which goes first when the budget
is full (:mod:`kvtether.router.budget`)."""

from __future__ import annotations

import pytest

from kvtether import protocol as p
from kvtether.router.budget import lease_value, pick_evictions
from tests.router.kv import NOW, conv, retained


def test_lease_value_falls_with_idle_time_phase_and_a_short_next_turn() -> None:
    fresh = conv(retained(100))
    assert lease_value(fresh, NOW, 60.0) == pytest.approx(1.0)
    assert lease_value(fresh, NOW + 60.0, 60.0) == pytest.approx(0.5)
    assert lease_value(conv(retained(100), phase=p.Phase.IDLE), NOW, 60.0) == pytest.approx(0.3)
    assert lease_value(conv(retained(100), phase=p.Phase.FINAL), NOW, 60.0) == 0.0
    short = conv(retained(100), expected_next_prompt_tokens=25)
    assert lease_value(short, NOW, 60.0) == pytest.approx(0.25)
    assert lease_value(conv(None), NOW, 60.0) == 0.0


def test_evictions_take_the_least_valuable_until_the_newcomer_fits() -> None:
    idle = conv(retained(100), phase=p.Phase.IDLE)
    stale = conv(retained(100))
    stale.last_active_unix_s = NOW - 600
    busy = conv(retained(100), phase=p.Phase.TOOL_RUNNING)
    cands = [busy, idle, stale]
    assert pick_evictions(cands, 300, 50, 400, 60.0, now_unix_s=NOW) == []
    assert pick_evictions(cands, 300, 150, 400, 60.0, now_unix_s=NOW) == [stale]
    assert pick_evictions(cands, 300, 250, 400, 60.0, now_unix_s=NOW) == [stale, idle]
