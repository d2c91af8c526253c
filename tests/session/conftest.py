from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
from openai import AsyncOpenAI, OpenAI

from kvtether.session import AsyncSession, Session

from .fake_router import FakeRouter
from .fixtures import FAST, _server, dead_url, heartbeat_threads, router  # noqa: F401 (fixtures)

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





def wait_for(condition: Callable[[], object], timeout_s: float = 10.0) -> None:
    """Block until ``condition()`` is true. Tests wait for events, not for fixed times, so a
    busy machine makes them slower, never flaky."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {condition}")
        time.sleep(0.01)


async def await_for(condition: Callable[[], object], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {condition}")
        await asyncio.sleep(0.01)
