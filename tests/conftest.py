"""Test order for a 2-core machine.

Fast unit tests run first. Then the real-vLLM tests that start their own processes (their own
P/D pair, `kvtether stack up`, the smol conversion), then those that start their own stack but
compare with the session's reference vLLM (2P+2D, the baselines), and only then the tests that
share the session's P/D stack: the shared fixtures start lazily and live until the session
ends, and a second stack booting beside them on two cores takes more than five minutes (and
2P+2D beside 1P+1D and the reference is seven vLLM processes on one small host).
"""

from __future__ import annotations

import pytest

SHARED_STACK_FIXTURES = frozenset({"pd_stack", "short_lease"})
SHARED_FIXTURES = SHARED_STACK_FIXTURES | {"reference_vllm"}


def _phase(item: pytest.Item) -> int:
    if item.get_closest_marker("vllm") is None:
        return 0
    fixtures = getattr(item, "fixturenames", ())
    if SHARED_FIXTURES.isdisjoint(fixtures):
        return 1
    if SHARED_STACK_FIXTURES.isdisjoint(fixtures):
        return 2
    return 3


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_phase)  # stable: file order is kept within each phase
