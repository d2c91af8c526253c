from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest
from agents import set_tracing_disabled

from kvtether_agents_support import FAST, plain_client
from kvtether_openai_agents import KVTetherProvider
from tests.support.fake_router import FakeRouter, _server, dead_url  # noqa: F401 (fixtures)

# No trace ever leaves these tests (nothing outside the machine is reachable).
set_tracing_disabled(True)
os.environ.pop("OPENAI_API_KEY", None)


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
