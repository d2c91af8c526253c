"""Agents built with and without kvtether against the same fake server see the same thing;
tools heartbeat their thread's KV, and a failing tool's error reaches the graph unchanged."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
from kvtether.session import SessionPool
from langchain.agents import create_agent
from langchain_core.messages import BaseMessage
from langchain_core.tools import tool
from langgraph.warnings import LangGraphDeprecatedSinceV10
from lg_support import FAST, chat_model, heartbeat_threads, tool_call_reply

with warnings.catch_warnings():
    # langgraph-prebuilt 1.0.0 (the oldest in range) warns about its own use of its deprecated
    # AgentStatePydantic when imported.
    warnings.simplefilter("ignore", LangGraphDeprecatedSinceV10)
    from langgraph.prebuilt import ToolNode, create_react_agent

from kvtether_langgraph import KVTetherCallbackHandler, KVTetherMiddleware, is_tethered, tether
from tests.support.fake_router import FakeRouter


@tool
def add(a: int, b: int) -> int:
    """Add two numbers (slowly enough for heartbeats)."""
    time.sleep(0.2)
    return a + b


@tool
def broken(a: int) -> int:
    """Always fails."""
    raise ValueError(f"broken tool got {a}")


def react_agent(model: Any, tools: Any) -> Any:
    """``create_react_agent``: deprecated in LangGraph 1.0, still common, so still covered."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LangGraphDeprecatedSinceV10)
        return create_react_agent(model, tools)


def script(router: FakeRouter, name: str = "add", args: dict[str, Any] | None = None) -> None:
    router.reset()
    router.replies.extend(
        [tool_call_reply("call_1", name, args or {"a": 1, "b": 2}), {"content": "it is 3"}]
    )


def seen(messages: list[BaseMessage]) -> list[dict[str, Any]]:
    """What a user reads from messages, minus ids kvtether cannot influence (random per run)."""
    out = []
    for m in messages:
        d = m.model_dump()
        d.pop("id", None)
        out.append(d)
    return out


THREAD = {"configurable": {"thread_id": "t-1"}}


def run_both(
    router: FakeRouter, build: Callable[[bool], Any], go: Callable[[Any], Any]
) -> tuple[Any, Any]:
    script(router)
    plain = go(build(False))
    script(router)
    tethered = go(build(True))
    return plain, tethered


def test_create_agent_middleware_changes_nothing_the_user_sees(
    router: FakeRouter, pool: SessionPool
) -> None:
    def build(tethered: bool) -> Any:
        middleware = [KVTetherMiddleware(pool)] if tethered else []
        return create_agent(chat_model(router), [add], middleware=middleware)

    plain, tethered = run_both(
        router, build, lambda agent: agent.invoke({"messages": [("user", "1+2?")]}, THREAD)
    )
    assert seen(tethered["messages"]) == seen(plain["messages"])
    assert tethered["messages"][-1].usage_metadata == plain["messages"][-1].usage_metadata
    session = pool.get("t-1")
    assert [t.outcome for t in session.turns] == ["miss:first_turn", "fired"]
    (run,) = session.tool_runs
    assert run.name == "add" and run.error is None and run.heartbeats >= 1
    assert router.requests_to("/heartbeat")


def test_create_agent_streaming_chunks_are_unchanged(
    router: FakeRouter, pool: SessionPool
) -> None:
    def build(tethered: bool) -> Any:
        middleware = [KVTetherMiddleware(pool)] if tethered else []
        return create_agent(chat_model(router, streaming=True), [add], middleware=middleware)

    def go(agent: Any) -> list[dict[str, Any]]:
        stream = agent.stream({"messages": [("user", "1+2?")]}, THREAD, stream_mode="messages")
        return seen([chunk for chunk, _ in stream])

    plain, tethered = run_both(router, build, go)
    assert tethered == plain and len(plain) > 5
    assert [t.outcome for t in pool.get("t-1").turns] == ["miss:first_turn", "fired"]


async def test_create_agent_async_twin(router: FakeRouter, pool: SessionPool) -> None:
    script(router)
    agent = create_agent(chat_model(router), [add], middleware=[KVTetherMiddleware(pool)])
    result = await agent.ainvoke({"messages": [("user", "1+2?")]}, THREAD)
    assert result["messages"][-1].content == "it is 3"
    session = pool.get("t-1")
    assert [t.outcome for t in session.turns] == ["miss:first_turn", "fired"]
    assert session.tool_runs[0].heartbeats >= 1


def test_create_react_agent_with_tethered_model_and_handler(
    router: FakeRouter, pool: SessionPool
) -> None:
    handler = KVTetherCallbackHandler(pool)

    def build(tethered: bool) -> Any:
        model = chat_model(router)
        return react_agent(tether(model, pool) if tethered else model, [add])

    def go(agent: Any) -> Any:
        config = {**THREAD, "callbacks": [handler]}
        return agent.invoke({"messages": [("user", "1+2?")]}, config)

    plain_handler_runs = handler.running
    plain, tethered = run_both(router, build, go)
    assert seen(tethered["messages"]) == seen(plain["messages"])
    assert plain_handler_runs == 0 and handler.running == 0
    session = pool.get("t-1")
    assert [t.outcome for t in session.turns] == ["miss:first_turn", "fired"]
    # The untethered run had no session reply to find, but its thread: both runs heartbeat.
    assert [r.name for r in session.tool_runs] == ["add", "add"]
    assert session.tool_runs[-1].heartbeats >= 1


@pytest.mark.parametrize("kind", ["middleware", "handler"])
def test_failing_tool_ends_its_heartbeat_and_raises_as_without_kvtether(
    router: FakeRouter, pool: SessionPool, kind: str
) -> None:
    def build(tethered: bool) -> Any:
        model = chat_model(router)
        if kind == "middleware":
            middleware = [KVTetherMiddleware(pool)] if tethered else []
            return create_agent(model, [broken], middleware=middleware)
        tools = ToolNode([broken], handle_tool_errors=False)
        return react_agent(tether(model, pool) if tethered else model, tools)

    def go(agent: Any) -> Any:
        config = {**THREAD, "callbacks": [KVTetherCallbackHandler(pool)]} if kind == "handler" else THREAD
        script(router, "broken", {"a": 7})
        try:
            return agent.invoke({"messages": [("user", "go")]}, config)
        except Exception as exc:  # noqa: BLE001 - compared below
            return exc

    plain, tethered = go(build(False)), go(build(True))
    if isinstance(plain, Exception):
        assert type(tethered) is type(plain) and str(tethered) == str(plain)
    else:
        assert seen(tethered["messages"]) == seen(plain["messages"])
    assert heartbeat_threads() == []
    errors = [r.error for r in pool.get("t-1").tool_runs]
    assert errors[-1] in ("ValueError", None)  # None: create_agent turned it into a ToolMessage
    if kind == "handler":
        assert errors[-1] == "ValueError" and isinstance(plain, ValueError)


def test_router_unreachable_agent_still_answers_with_one_warning(
    router: FakeRouter, dead_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The model server answers; the kvtether router's session API (heartbeats) is down.
    with SessionPool(dead_url, settings=FAST) as dead_pool:
        agent = create_agent(chat_model(router), [add], middleware=[KVTetherMiddleware(dead_pool)])
        caplog.set_level(logging.WARNING, logger="kvtether")
        for _ in range(2):
            script(router)
            result = agent.invoke({"messages": [("user", "1+2?")]}, THREAD)
            assert result["messages"][-1].content == "it is 3"
        session = dead_pool.get("t-1")
        assert all(r.heartbeat_failures >= 1 for r in session.tool_runs)
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len([m for m in logged if "heartbeat" in m]) == 1, logged


def test_the_models_key_or_the_middlewares_goes_on_heartbeats_and_release(
    router: FakeRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVTETHER_API_KEY", raising=False)
    for key, expected in ((None, "Bearer test"), ("tenant-key", "Bearer tenant-key")):
        script(router)
        middleware = KVTetherMiddleware(api_key=key, base_url=router.url)
        agent = create_agent(chat_model(router), [add], middleware=[middleware])
        agent.invoke({"messages": [("user", "add 1 and 2")]}, THREAD)
        middleware.pool.close()
        session_calls = [r.headers.get("authorization") for r in router.received
                         if r.path.startswith("/v1/sessions/")]
        assert len(session_calls) >= 2  # heartbeats while `add` ran, then the release
        assert set(session_calls) == {expected}


def test_models_made_per_call_are_not_kept_forever(router: FakeRouter, pool: SessionPool) -> None:
    import gc
    import weakref
    from types import SimpleNamespace

    middleware = KVTetherMiddleware(pool)

    def through(model: Any) -> Any:
        request = SimpleNamespace(model=model, override=lambda model: SimpleNamespace(model=model))
        return middleware._tethered_request(request).model  # what wrap_model_call hands on

    first = chat_model(router)
    assert is_tethered(through(first)) and through(first) is through(first)  # reused
    gone = weakref.ref(first)
    del first
    for _ in range(100):  # e.g. a dynamic-model middleware building one per call
        assert is_tethered(through(chat_model(router)))
    gc.collect()
    assert gone() is None  # the middleware let go of it
