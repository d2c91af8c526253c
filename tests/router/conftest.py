"""Router test fixtures: the harness of :mod:`tests.support.router_harness`, per test."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.support.router_harness import Harness, make_router


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    """One prefill, one decode, upstream NIXL connector only (no control channel)."""
    async with make_router() as harness:
        yield harness


@pytest.fixture
async def hc() -> AsyncIterator[Harness]:
    """One prefill, one decode running the kvtether connector (control channel)."""
    async with make_router(control=True) as harness:
        yield harness


@pytest.fixture(params=[False, True], ids=["upstream", "control"])
async def hx(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    """Both configurations."""
    async with make_router(control=request.param) as harness:
        yield harness
