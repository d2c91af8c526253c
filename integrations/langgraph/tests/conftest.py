"""Fixtures: the core's fake kvtether router (``tests/support/fake_router.py``), served once.

Run from the repository root, so the core's ``tests`` package is importable.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kvtether.session import SessionPool
from lg_support import FAST

from tests.support.fake_router import FakeRouter, _server, dead_url, router  # noqa: F401


@pytest.fixture
def pool(router: FakeRouter) -> Iterator[SessionPool]:
    with SessionPool(router.url, settings=FAST) as p:
        yield p
