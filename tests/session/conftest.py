"""Session-layer fixtures: sessions and OpenAI clients on the fake router of tests.support."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from openai import AsyncOpenAI, OpenAI

from kvtether.session import AsyncSession, Session
from tests.support.fake_router import FAST, FakeRouter, _server, dead_url, router  # noqa: F401


@pytest.fixture
def session(router: FakeRouter) -> Iterator[Session]:
    with Session(router.url, settings=FAST) as s:
        yield s


@pytest.fixture(scope="session")
def base_client(_server: FakeRouter) -> Iterator[OpenAI]:
    # Shared: building an SDK client costs ~0.2 s (TLS setup), and wrap() leaves it unchanged.
    base = OpenAI(base_url=_server.url + "/v1", api_key="test", max_retries=0)
    yield base
    base.close()


@pytest.fixture
def client(base_client: OpenAI, session: Session) -> OpenAI:
    return session.wrap(base_client)


@pytest.fixture
async def asession(router: FakeRouter) -> AsyncIterator[AsyncSession]:
    async with AsyncSession(router.url, settings=FAST) as s:
        yield s


@pytest.fixture
async def aclient(router: FakeRouter, asession: AsyncSession) -> AsyncIterator[AsyncOpenAI]:
    base = AsyncOpenAI(base_url=router.url + "/v1", api_key="test", max_retries=0)
    yield asession.wrap(base)
    await base.close()
