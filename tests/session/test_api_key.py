"""The router's API key on the session API: heartbeats, status and release carry it."""

from __future__ import annotations

import pytest
from openai import AsyncOpenAI, OpenAI

from kvtether.session import AsyncSession, AsyncSessionPool, Session, SessionPool
from tests.support.fake_router import FAST, FakeRouter
from tests.support.waiting import await_for, wait_for

MESSAGES = [{"role": "user", "content": "hello"}]


def session_api_auth(router: FakeRouter) -> list[tuple[str, str | None]]:
    """(method + path suffix, Authorization) of every session API call the router got."""
    return [(f"{r.method} {r.path.rsplit('/', 1)[-1] if r.path.endswith('heartbeat') else ''}",
             r.headers.get("authorization"))
            for r in router.received if r.path.startswith("/v1/sessions/")]


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTETHER_API_KEY", raising=False)


def test_heartbeat_status_and_release_send_the_sessions_key(
    router: FakeRouter, base_client: OpenAI
) -> None:
    with Session(router.url, settings=FAST, api_key="router-key") as session:
        client = session.wrap(base_client)
        client.chat.completions.create(model="fake", messages=MESSAGES)  # type: ignore[arg-type]
        with session.tool_call("grep", eta_s=1):
            wait_for(lambda: router.requests_to("/heartbeat"))
        session.status()
    calls = session_api_auth(router)
    assert {method for method, _ in calls} == {"POST heartbeat", "GET ", "DELETE "}
    assert {auth for _, auth in calls} == {"Bearer router-key"}
    # The model request itself carries the OpenAI client's own key, as the SDK sends it.
    chat = next(r for r in router.received if r.path.endswith("/chat/completions"))
    assert chat.headers["authorization"] == "Bearer test"


def test_the_key_comes_from_the_env_else_from_the_wrapped_client(
    router: FakeRouter, base_client: OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Session(router.url, settings=FAST) as session:
        session.wrap(base_client).chat.completions.create(model="fake", messages=MESSAGES)  # type: ignore[arg-type]
    assert {auth for _, auth in session_api_auth(router)} == {"Bearer test"}
    router.reset()
    monkeypatch.setenv("KVTETHER_API_KEY", "from-env")
    with Session(router.url, settings=FAST) as session:
        session.wrap(base_client).chat.completions.create(model="fake", messages=MESSAGES)  # type: ignore[arg-type]
        session.status()
    assert {auth for _, auth in session_api_auth(router)} == {"Bearer from-env"}


def test_no_key_sends_no_authorization(router: FakeRouter) -> None:
    with Session(router.url, settings=FAST) as session:
        with pytest.raises(Exception):  # noqa: B017 - unknown session: any SessionError
            session.status()
    assert session_api_auth(router) == [("GET ", None)]


async def test_async_session_sends_its_key(router: FakeRouter) -> None:
    base = AsyncOpenAI(base_url=router.url + "/v1", api_key="sdk", max_retries=0)
    async with AsyncSession(router.url, settings=FAST, api_key="async-key") as session:
        client = session.wrap(base)
        await client.chat.completions.create(model="fake", messages=MESSAGES)  # type: ignore[arg-type]
        async with session.tool_call("grep", eta_s=1):
            await await_for(lambda: router.requests_to("/heartbeat"))
        await session.status()
    await base.close()
    calls = session_api_auth(router)
    assert {m for m, _ in calls} == {"POST heartbeat", "GET ", "DELETE "}
    assert {auth for _, auth in calls} == {"Bearer async-key"}


def test_pool_sessions_use_the_pools_key_or_the_wrapped_clients(
    router: FakeRouter, base_client: OpenAI
) -> None:
    with SessionPool(router.url, settings=FAST, api_key="pool-key") as pool:
        client = pool.wrap(base_client, resolver=lambda: "thread-1")
        client.chat.completions.create(model="fake", messages=MESSAGES)  # type: ignore[arg-type]
    assert {auth for _, auth in session_api_auth(router)} == {"Bearer pool-key"}
    router.reset()
    with SessionPool(router.url, settings=FAST) as pool:
        early = pool.get("made-before-wrap")
        client = pool.wrap(base_client, resolver=lambda: "made-before-wrap")
        client.chat.completions.create(model="fake", messages=MESSAGES)  # type: ignore[arg-type]
        assert early._state.auth_headers() == {"Authorization": "Bearer test"}
    assert {auth for _, auth in session_api_auth(router)} == {"Bearer test"}


async def test_async_pool_passes_its_key(router: FakeRouter) -> None:
    base = AsyncOpenAI(base_url=router.url + "/v1", api_key="sdk", max_retries=0)
    async with AsyncSessionPool(router.url, settings=FAST, api_key="apool") as pool:
        client = pool.wrap(base, resolver=lambda: "t")
        await client.chat.completions.create(model="fake", messages=MESSAGES)  # type: ignore[arg-type]
    await base.close()
    assert {auth for _, auth in session_api_auth(router)} == {"Bearer apool"}
