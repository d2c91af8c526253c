"""Fixtures: the core's fake kvtether router (``tests/session/fake_router.py``), served once.

Run from the repository root, so the core's ``tests`` package is importable.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from kvtether.session import SessionPool
from lg_support import FAST, heartbeat_threads

from tests.session.fake_router import FakeRouter, ServerThread, build_app


@pytest.fixture(scope="session")
def _server() -> Iterator[FakeRouter]:
    fake = FakeRouter()
    server = ServerThread(build_app(fake))
    fake.url = server.start()
    yield fake
    server.stop()


@pytest.fixture
def router(_server: FakeRouter) -> Iterator[FakeRouter]:
    _server.reset()
    yield _server
    assert heartbeat_threads() == []  # a leaked heartbeat would renew a lease forever


@pytest.fixture
def pool(router: FakeRouter) -> Iterator[SessionPool]:
    with SessionPool(router.url, settings=FAST) as p:
        yield p


@pytest.fixture
def dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"
