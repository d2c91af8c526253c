"""200 conversations at once, heartbeating every second while their tools run (fake vLLM).

No turn or heartbeat may fail, no KV is read wrong or left held; the router's overhead per turn
is printed (no timing is asserted: this machine's speed is not the router's).
"""

from __future__ import annotations

import pytest

from tests.support.load import run_load

pytestmark = pytest.mark.soak


@pytest.mark.timeout(300)
async def test_200_concurrent_conversations_with_heartbeats() -> None:
    # The fakes share the router's event loop here, so every KV read is checked and nothing
    # depends on sockets; benchmarks/bench_load.py runs them in a process of their own to
    # measure the router's overhead alone.
    r = await run_load(conversations=200, turns=4)
    print("\n(fakes on the router's loop) " + r.summary())
    assert r.failed_turns == [] and r.failed_heartbeats == []
    assert r.turns == 200 * 4
    assert r.heartbeats >= 200 * 3  # a tool of 1-3 s between every two turns
    assert r.fired == r.eligible  # every later turn reused its conversation's KV
