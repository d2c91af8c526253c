from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest
from agents import set_tracing_disabled

from kvtether_agents_support import FAST, plain_client
from kvtether_openai_agents import KVTetherProvider
from tests.session.fake_router import FakeRouter, ServerThread, build_app

# No trace ever leaves these tests (nothing outside the machine is reachable).
set_tracing_disabled(True)
os.environ.pop("OPENAI_API_KEY", None)


@pytest.fixture(scope="session")
def _server() -> Iterator[FakeRouter]:
    fake = FakeRouter()
    server = ServerThread(build_app(fake))
    fake.url = server.start()
    yield fake
    server.stop()


@pytest.fixture
def router(_server: FakeRouter) -> FakeRouter:
    _server.reset()
    return _server


@pytest.fixture
async def provider(router: FakeRouter) -> AsyncIterator[KVTetherProvider]:
    client = plain_client(router.url)
    async with KVTetherProvider(router.url, openai_client=client, settings=FAST) as kv:
        yield kv
    await client.close()


@pytest.fixture
def dead_url() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"
