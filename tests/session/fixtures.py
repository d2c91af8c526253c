"""The fake kvtether router and the fixtures around it, shared by the core's session tests and
the framework integrations' tests (which import them into their own conftest)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from kvtether.session import SessionSettings
from tests.session.fake_router import FakeRouter, ServerThread, build_app

FAST = SessionSettings(heartbeat_interval_s=0.05, request_timeout_s=1.0)


def heartbeat_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvtether-heartbeat")]


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
    # Every test must leave no heartbeat running: a leaked thread would renew a lease forever.
    assert heartbeat_threads() == []


@pytest.fixture
def dead_url() -> str:
    """A localhost URL nothing listens on: connections are refused at once."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"
