"""The session pool: one session per conversation key, picked per request, evicted without
losing KV, found again from a tool call's id."""

from __future__ import annotations

import asyncio
import gc
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from openai import AsyncOpenAI, OpenAI

from kvtether import AsyncSessionPool, SessionPool
from kvtether.errors import ConfigError, KVTetherError, MissingConversationKeyWarning
from kvtether.protocol import HEADER_CONVERSATION_ID
from kvtether.session import AsyncSession, Session
from tests.support.fake_router import FAST, FakeRouter, heartbeat_threads

USER = {"role": "user", "content": "hi"}
CID = HEADER_CONVERSATION_ID.lower()


def call(call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "grep", "arguments": "{}"}}


class FakeTimer:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def pool(router: FakeRouter) -> Iterator[SessionPool]:
    with SessionPool(router.url, settings=FAST) as p:
        yield p


def sent_ids(router: FakeRouter) -> list[str]:
    return [r.headers[CID] for r in router.requests_to("/chat/completions")]


def deletes(router: FakeRouter) -> list[str]:
    return [r.path.rsplit("/", 1)[1] for r in router.received if r.method == "DELETE"]


def test_same_key_same_session_and_ids_match_from_thread_id(pool: SessionPool) -> None:
    a = pool.get("thread-a")
    assert pool.get("thread-a") is a
    b = pool.get("thread-b")
    assert a.conversation_id != b.conversation_id
    assert a.conversation_id == Session.from_thread_id("thread-a").conversation_id
    assert b.conversation_id == Session.from_thread_id("thread-b").conversation_id
    assert isinstance(a, Session) and len(pool) == 2


def test_namespace_reaches_the_conversation_id(router: FakeRouter) -> None:
    with SessionPool(router.url, namespace="app2") as pool:
        got = pool.get("t").conversation_id
    assert got == Session.from_thread_id("t", namespace="app2").conversation_id


def test_concurrent_get_of_one_key_makes_one_session(pool: SessionPool) -> None:
    got: list[Session] = []
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        got.append(pool.get("shared"))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and all(s is got[0] for s in got)


def test_resolver_picks_the_session_per_request_across_threads(
    router: FakeRouter, pool: SessionPool, base_client: OpenAI
) -> None:
    current = threading.local()
    client = pool.wrap(base_client, lambda: getattr(current, "key", None))
    turns = 3
    # Two threads take turns through one wrapped client, each its own conversation.
    go = [threading.Semaphore(1), threading.Semaphore(0)]

    def agent(index: int, key: str) -> None:
        current.key = key
        for _ in range(turns):
            go[index].acquire()
            client.chat.completions.create(model="fake", messages=[USER])
            go[1 - index].release()

    threads = [threading.Thread(target=agent, args=(i, k)) for i, k in enumerate(["a", "b"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    a, b = pool.get("a").conversation_id, pool.get("b").conversation_id
    assert sent_ids(router) == [a, b] * turns  # interleaved, each on its own id
    assert len(pool.get("a").turns) == len(pool.get("b").turns) == turns


def test_missing_key_goes_to_the_default_session_and_warns_once(
    router: FakeRouter, pool: SessionPool, base_client: OpenAI
) -> None:
    client = pool.wrap(base_client, lambda: None)
    with pytest.warns(MissingConversationKeyWarning, match="resolver returned None") as caught:
        client.chat.completions.create(model="fake", messages=[USER])
        client.chat.completions.create(model="fake", messages=[USER])
        assert pool.get(None) is pool.default
    assert len(caught) == 1
    assert caught[0].filename == __file__  # points at the agent's code, not kvtether's
    assert sent_ids(router) == [pool.default.conversation_id] * 2
    assert len(pool) == 0  # the default session is not a keyed one


def test_warning_made_an_error_is_logged_not_raised(
    router: FakeRouter, pool: SessionPool, caplog: pytest.LogCaptureFixture
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", MissingConversationKeyWarning)
        assert pool.get(None) is pool.default
    assert "no conversation key" in caplog.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_id_finds_its_session(
    router: FakeRouter, pool: SessionPool, base_client: OpenAI, stream: bool
) -> None:
    current = {"key": "a"}
    client = pool.wrap(base_client, lambda: current["key"])
    router.replies.append({"content": None, "tool_calls": [call("call_a1"), call("call_a2")]})
    router.replies.append({"content": None, "tool_calls": [call("call_b1")]})
    for key in ("a", "b"):
        current["key"] = key
        reply = client.chat.completions.create(model="fake", messages=[USER], stream=stream)
        if stream:
            list(reply)

    assert pool.session_for_tool_call("call_a1") is pool.get("a")
    assert pool.session_for_tool_call("call_a2") is pool.get("a")
    assert pool.session_for_tool_call("call_b1") is pool.get("b")
    assert pool.session_for_tool_call("call_unknown") is None


def test_a_tool_call_of_the_default_session_finds_it(
    router: FakeRouter, pool: SessionPool, base_client: OpenAI
) -> None:
    client = pool.wrap(base_client, lambda: None)
    router.replies.append({"content": None, "tool_calls": [call("call_d")]})
    with pytest.warns(MissingConversationKeyWarning):
        client.chat.completions.create(model="fake", messages=[USER])
    assert pool.session_for_tool_call("call_d") is pool.default


def test_lru_eviction_keeps_the_kv_and_the_key_comes_back_to_it(
    router: FakeRouter, base_client: OpenAI
) -> None:
    with SessionPool(router.url, max_sessions=2, settings=FAST) as pool:
        current = {"key": "a"}
        client = pool.wrap(base_client, lambda: current["key"])
        for key in ("a", "b", "c"):  # "a" leaves the pool when "c" comes in
            current["key"] = key
            client.chat.completions.create(model="fake", messages=[USER])
        assert len(pool) == 2
        gc.collect()  # the evicted session is gone, and its exit finalizer with it
        assert deletes(router) == []  # eviction released nothing

        current["key"] = "a"
        client.chat.completions.create(model="fake", messages=[USER])
        # A fresh session, but the same conversation: the router still held its KV.
        assert pool.get("a").turns[0].outcome == "fired"
        assert deletes(router) == []
    # close() releases what is pooled at the end ("c" and "a"), once each; not the evicted "b".
    ids = {k: Session.from_thread_id(k).conversation_id for k in "abc"}
    assert sorted(deletes(router)) == sorted([ids["a"], ids["c"]])


def test_idle_sessions_leave_without_release_or_threads(
    router: FakeRouter, base_client: OpenAI
) -> None:
    timer = FakeTimer()
    with SessionPool(router.url, idle_ttl_s=60, settings=FAST, timer=timer) as pool:
        current = {"key": "a"}
        client = pool.wrap(base_client, lambda: current["key"])
        router.replies.append({"content": None, "tool_calls": [call("call_1")]})
        client.chat.completions.create(model="fake", messages=[USER])
        a = pool.get("a")
        with a.tool_call("grep"):  # heartbeats open the session's HTTP client
            pass
        timer.now_s = 30.0
        assert pool.get("a") is a  # used again: its idle time starts over
        timer.now_s = 89.0
        current["key"] = "b"
        client.chat.completions.create(model="fake", messages=[USER])
        assert len(pool) == 2
        timer.now_s = 91.0
        assert len(pool) == 1  # "a" idle for 61 s: gone; "b" only 2 s
        assert deletes(router) == [] and heartbeat_threads() == []
        assert a._http._client is None  # its client was closed
        # Its tool call still leads to the conversation, in a session of the same id.
        again = pool.session_for_tool_call("call_1")
        assert again is not None and again is not a
        assert again.conversation_id == a.conversation_id


def test_close_releases_every_pooled_session_once(router: FakeRouter, base_client: OpenAI) -> None:
    pool = SessionPool(settings=FAST)
    keys = iter(["a", "b", None])
    client = pool.wrap(base_client, lambda: next(keys))  # base_url comes from the client
    with pytest.warns(MissingConversationKeyWarning):
        for _ in range(3):
            client.chat.completions.create(model="fake", messages=[USER])
    expected = sorted(
        [pool.get("a").conversation_id, pool.get("b").conversation_id, pool.default.conversation_id]
    )
    pool.close()
    pool.close()
    assert sorted(deletes(router)) == expected


def test_bad_arguments_are_config_errors(router: FakeRouter, base_client: OpenAI) -> None:
    with pytest.raises(ConfigError, match="max_sessions"):
        SessionPool(router.url, max_sessions=0)
    with pytest.raises(ConfigError, match="idle_ttl_s"):
        SessionPool(router.url, idle_ttl_s=0)
    with pytest.raises(ConfigError, match="idle_ttl_s"):
        AsyncSessionPool(router.url, idle_ttl_s=-1.0)
    with pytest.raises(KVTetherError, match="resolver"):
        SessionPool(router.url).wrap(base_client, "thread-1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="router's address"):
        SessionPool("localhost:8000")


# --- the async twin -------------------------------------------------------------------------


async def test_async_pool_routes_keys_tool_calls_and_releases_on_exit(router: FakeRouter) -> None:
    base = AsyncOpenAI(base_url=router.url + "/v1", api_key="test", max_retries=0)
    try:
        async with AsyncSessionPool(router.url, settings=FAST) as pool:
            current: dict[str, str | None] = {"key": None}
            client = pool.wrap(base, lambda: current["key"])

            async def agent(key: str, call_id: str) -> None:
                current["key"] = key
                router.replies.append({"content": None, "tool_calls": [call(call_id)]})
                stream = await client.chat.completions.create(
                    model="fake", messages=[USER], stream=True
                )
                async for _ in stream:
                    pass

            await agent("a", "call_a")
            await agent("b", "call_b")
            a, b = pool.get("a"), pool.get("b")
            assert isinstance(a, AsyncSession) and a is not b
            assert sent_ids(router) == [a.conversation_id, b.conversation_id]
            assert a.conversation_id == AsyncSession.from_thread_id("a").conversation_id
            assert pool.session_for_tool_call("call_b") is b
            with pytest.warns(MissingConversationKeyWarning):
                assert pool.get(None) is pool.default
        assert sorted(deletes(router)) == sorted([a.conversation_id, b.conversation_id])
    finally:
        await base.close()


async def test_async_eviction_keeps_kv_and_closes_clients(router: FakeRouter) -> None:
    timer = FakeTimer()
    async with AsyncSessionPool(
        router.url, max_sessions=1, idle_ttl_s=10, settings=FAST, timer=timer
    ) as pool:
        a = pool.get("a")
        a._ahttp.get()  # as a heartbeat task would have opened it
        pool.get("b")  # "a" leaves (least recently used)
        await asyncio.sleep(0)  # the close task runs on this loop
        await asyncio.sleep(0)
        assert a._ahttp._client is None
        timer.now_s = 11.0
        assert len(pool) == 0  # "b" idle too long
        assert deletes(router) == []
    assert deletes(router) == []  # no turn went through: nothing was retained to release


def test_async_get_from_a_worker_thread(router: FakeRouter) -> None:
    pool = AsyncSessionPool(router.url, max_sessions=1, settings=FAST)
    got: list[AsyncSession] = []
    worker = threading.Thread(target=lambda: got.extend([pool.get("a"), pool.get("b")]))
    worker.start()
    worker.join()
    assert [type(s) for s in got] == [AsyncSession, AsyncSession]
    asyncio.run(pool.aclose())


def test_a_tool_run_reported_by_two_callbacks_is_followed_by_the_pool(
    router: FakeRouter, pool: SessionPool, base_client: OpenAI
) -> None:
    client = pool.wrap(base_client, lambda: "a")
    router.replies.append({"content": None, "tool_calls": [call("call_a1")]})
    client.chat.completions.create(model="fake", messages=[USER])
    session = pool.get("a")
    # Found from the reply's tool call id; then from the key alone; an unknown one is not.
    run = pool.begin_tool("run-1", "grep", tool_call_id="call_a1", args={"q": "x"})
    assert run is not None and pool.open_tool_runs() == ["run-1"]
    assert pool.open_tool_runs(session.conversation_id) == ["run-1"]
    assert pool.open_tool_runs("another") == []
    assert pool.begin_tool("run-2", "ls", key="b") is not None
    assert pool.begin_tool("run-3", "ls", tool_call_id="call_unknown") is None
    with pytest.raises(ConfigError, match="begun already"):
        pool.begin_tool("run-1", "grep", key="a")
    ended = pool.end_tool("run-1", ValueError("boom"))
    assert ended is run and ended.error == "ValueError" and not ended.ok
    assert [r.name for r in session.tool_runs] == ["grep"]
    assert pool.end_tool("run-1") is None  # ended once
    b = pool.get("b")
    pool.close()  # ends run-2 too
    assert pool.open_tool_runs() == [] and [r.name for r in b.tool_runs] == ["ls"]


async def test_an_async_tool_run_reported_by_two_callbacks(router: FakeRouter) -> None:
    async with AsyncSessionPool(router.url, settings=FAST) as pool:
        a = pool.get("a")
        run = await pool.abegin_tool("r", "grep", key="a", eta_s=1.0)
        assert run is not None and pool.open_tool_runs() == ["r"]
        with pytest.raises(ConfigError, match="aend_tool"):
            pool.end_tool("r")
        await pool.abegin_tool("left-open", "ls", key="a")
    assert pool.open_tool_runs() == []  # aclose() ended the one left open
    assert sorted(r.name for r in a.tool_runs) == ["grep", "ls"]
