"""Test order for a 2-core machine.

Fast unit tests run first. Then the real-vLLM tests that start their own processes (their own
P/D pair, `kvtether stack up`, the smol conversion), and only then the tests that share the
session's P/D stack and reference vLLM: those fixtures start lazily and live until the session
ends, and a second stack booting beside them on two cores takes more than five minutes.
"""

from __future__ import annotations

import pytest

SHARED_STACK_FIXTURES = frozenset({"pd_stack", "short_lease", "reference_vllm"})


def _phase(item: pytest.Item) -> int:
    if item.get_closest_marker("vllm") is None:
        return 0
    if SHARED_STACK_FIXTURES.isdisjoint(getattr(item, "fixturenames", ())):
        return 1
    return 2


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_phase)  # stable: file order is kept within each phase
