"""The integration changes nothing the agent sees, and tethers each run to its conversation."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from agents import (
    Agent,
    ModelProvider,
    OpenAIChatCompletionsModel,
    RunConfig,
    Runner,
    SQLiteSession,
    function_tool,
)
from agents.models.interface import Model

from kvtether.protocol import HEADER_CONVERSATION_ID
from kvtether_openai_agents import (
    SUPPORTED_RANGE,
    KVTetherHooks,
    KVTetherProvider,
    UnsupportedAgentsVersionError,
)
from kvtether_openai_agents._version import check_agents_version

from kvtether_agents_support import FAST, plain_client

CALLS: list[str] = []


@function_tool
def grep(pattern: str) -> str:
    """Search the code for a pattern."""
    CALLS.append(pattern)
    return f"3 matches for {pattern}"


@function_tool
def broken(pattern: str) -> str:
    """A tool that fails."""
    raise RuntimeError(f"cannot search {pattern}")


def tool_reply(name: str, call_id: str) -> dict[str, Any]:
    args = json.dumps({"pattern": "TODO"})
    return {
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
        ],
    }


class PlainProvider(ModelProvider):
    """The same agent without kvtether: the SDK's Chat Completions model on a plain client."""

    def __init__(self, url: str) -> None:
        self._client = plain_client(url)

    def get_model(self, model_name: str | None) -> Model:
        return OpenAIChatCompletionsModel(model=model_name or "fake", openai_client=self._client)

    async def aclose(self) -> None:
        await self._client.close()


def agent(*tools: Any) -> Agent[Any]:
    return Agent(name="coder", instructions="Fix the bug.", model="fake", tools=list(tools))


def script(router: Any, name: str = "grep") -> None:
    router.replies.extend([tool_reply(name, "call_1"), {"content": "done: 3 TODOs"}])


def chat_requests(router: Any) -> list[Any]:
    return router.requests_to("/chat/completions")


def summary(result: Any) -> dict[str, Any]:
    return {
        "final": result.final_output,
        "items": result.to_input_list(),
        "usage": [r.usage for r in result.raw_responses],
        "new_items": [type(i).__name__ for i in result.new_items],
    }


async def run_plain_and_tethered(
    router: Any, provider: KVTetherProvider, *tools: Any, stream: bool = False, name: str = "grep"
) -> tuple[Any, Any, list[Any], list[Any]]:
    results, bodies = [], []
    plain_provider = PlainProvider(router.url)
    # The same agent through Runner on the plain model, and through kv.run (grouped by
    # group_id, so bound to one conversation).
    entries: list[tuple[Any, RunConfig]] = [
        (Runner, RunConfig(model_provider=plain_provider)),
        (provider, RunConfig(group_id="g")),
    ]
    for runner, config in entries:
        router.reset()
        script(router, name)
        if stream:
            streamed = runner.run_streamed(agent(*tools), "fix it", run_config=config)
            events = [_event(e) async for e in streamed.stream_events()]
            results.append((streamed, events))
        else:
            results.append((await runner.run(agent(*tools), "fix it", run_config=config), None))
        bodies.append([r.body for r in chat_requests(router)])
    await plain_provider.aclose()
    return results[0], results[1], bodies[0], bodies[1]


def _untimed(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if k != "created_at"}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def _event(event: Any) -> Any:
    if event.type == "raw_response_event":
        return (event.type, _untimed(event.data.model_dump()))
    if event.type == "run_item_stream_event":
        return (event.type, event.name, event.item.to_input_item())
    return (event.type, getattr(event, "new_agent", None) and event.new_agent.name)


async def test_same_output_items_usage_and_request_bodies(router: Any, provider: Any) -> None:
    (plain, _), (tethered, _), plain_bodies, tethered_bodies = await run_plain_and_tethered(
        router, provider, grep
    )
    assert summary(tethered) == summary(plain)
    assert tethered.final_output == "done: 3 TODOs"
    # The runner's grouping key is taken back out: the router sees the plain request body.
    assert tethered_bodies == plain_bodies
    assert all("prompt_cache_key" not in body for body in tethered_bodies)


async def test_same_stream_events(router: Any, provider: Any) -> None:
    (plain, plain_events), (tethered, events), _, _ = await run_plain_and_tethered(
        router, provider, grep, stream=True
    )
    assert events == plain_events and len(events) > 5
    assert summary(tethered) == summary(plain)


async def test_turns_are_tethered_and_the_tool_heartbeats(router: Any, provider: Any) -> None:
    router.lease_remaining_s = 30.0
    script(router)

    @function_tool
    async def slow_grep(pattern: str) -> str:
        """Search slowly."""
        await asyncio.sleep(0.3)  # several heartbeat intervals
        return "1 match"

    router.replies.clear()
    script(router, "slow_grep")
    await Runner.run(
        agent(slow_grep), "fix it", run_config=RunConfig(model_provider=provider),
        hooks=provider.hooks,
    )
    first, second = chat_requests(router)
    cid = first.headers[HEADER_CONVERSATION_ID.lower()]
    assert second.headers[HEADER_CONVERSATION_ID.lower()] == cid
    beats = router.requests_to("/heartbeat")
    assert beats and all(f"/sessions/{cid}/" in b.path for b in beats)
    (session,) = [provider.pool.session_for_tool_call("call_1")]
    assert session is not None and session.conversation_id == cid
    (run,) = session.tool_runs
    assert run.name == "slow_grep" and run.heartbeats >= 1
    assert [t.outcome for t in session.turns] == ["miss:first_turn", "fired"]
    count = len(router.requests_to("/heartbeat"))
    await asyncio.sleep(0.2)
    assert len(router.requests_to("/heartbeat")) == count  # heartbeats stopped with the tool


async def test_interleaved_runs_keep_their_own_conversation(router: Any, provider: Any) -> None:
    sessions = {name: SQLiteSession(f"user-{name}") for name in "ab"}

    async def converse(name: str) -> None:
        for i in range(2):
            await provider.run(agent(), f"{name} says {i}", session=sessions[name])

    await asyncio.gather(converse("a"), converse("b"))
    seen: dict[str, set[str]] = {"a": set(), "b": set()}
    for request in chat_requests(router):
        said = request.body["messages"][1]["content"]
        seen[said[0]].add(request.headers[HEADER_CONVERSATION_ID.lower()])
    assert len(seen["a"]) == 1 and len(seen["b"]) == 1 and seen["a"] != seen["b"]
    # Each conversation's second run continued its first (the router counted two turns each).
    assert [router.conversations[cid].turns for cid in (*seen["a"], *seen["b"])] == [2, 2]
    # session_for() finds each conversation's kvtether session from the SDK session or its id.
    for name in "ab":
        found = provider.session_for(session=sessions[name])
        assert {found.conversation_id} == seen[name]
        assert provider.session_for(session=f"user-{name}") is found
        assert len(found.turns) == 2


async def test_group_id_and_a_fresh_run_each(router: Any, provider: Any) -> None:
    config = RunConfig(group_id="thread-7")
    await provider.run(agent(), "one", run_config=config)
    await provider.run(agent(), "two", run_config=config)
    await provider.run(agent(), "three")
    await provider.run(agent(), "four", run_config=RunConfig())
    cids = [r.headers[HEADER_CONVERSATION_ID.lower()] for r in chat_requests(router)]
    assert cids[0] == cids[1]
    assert provider.session_for(group_id="thread-7").conversation_id == cids[0]
    assert len({cids[1], cids[2], cids[3]}) == 3  # no grouping: one conversation per run


async def test_a_failing_tool_reaches_the_agent_as_without_kvtether(
    router: Any, provider: Any
) -> None:
    (plain, _), (tethered, _), plain_bodies, tethered_bodies = await run_plain_and_tethered(
        router, provider, broken, name="broken"
    )
    assert summary(tethered) == summary(plain)
    assert tethered_bodies == plain_bodies
    assert "An error occurred while running the tool" in json.dumps(tethered_bodies[1])
    (run,) = provider.pool.session_for_tool_call("call_1").tool_runs  # type: ignore[union-attr]
    assert run.duration_s is not None  # its heartbeat scope was closed
    assert provider.pool.open_tool_runs() == []


async def test_a_tool_error_that_ends_the_run_stops_its_heartbeat(
    router: Any, provider: Any
) -> None:
    @function_tool(failure_error_function=None)
    def fatal(pattern: str) -> str:
        """A tool whose error ends the run."""
        raise RuntimeError("disk on fire")

    errors = []
    plain_provider = PlainProvider(router.url)
    for runner, config in [
        (Runner, RunConfig(model_provider=plain_provider)),
        (provider, RunConfig(group_id="g")),
    ]:
        router.reset()
        script(router, "fatal")
        with pytest.raises(Exception) as info:
            await runner.run(agent(fatal), "fix it", run_config=config)
        errors.append((type(info.value), str(info.value)))
    await plain_provider.aclose()
    assert errors[0] == errors[1]
    # The end hook never came; the next model call of that conversation closes it.
    assert len(provider.pool.open_tool_runs()) == 1
    router.replies.append({"content": "ok"})
    await provider.run(agent(), "again", run_config=RunConfig(group_id="g"))
    assert provider.pool.open_tool_runs() == []
    count = len(router.requests_to("/heartbeat"))
    await asyncio.sleep(0.2)
    assert len(router.requests_to("/heartbeat")) == count


async def test_router_down_answers_through_the_fallback_with_one_warning(
    router: Any, dead_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    router.send_headers = False  # the fallback is plain vLLM
    caplog.set_level(logging.WARNING)
    fallback, dead = plain_client(router.url), plain_client(dead_url)
    async with KVTetherProvider(
        dead_url, openai_client=dead, fallback_client=fallback, settings=FAST
    ) as kv:
        for i in range(3):
            router.replies.append({"content": f"plain {i}"})
            result = await kv.run(agent(), "hi", run_config=RunConfig(group_id="g"))
            assert result.final_output == f"plain {i}"
        streamed = kv.run_streamed(agent(), "hi")
        router.replies.append({"content": "streamed"})
        _ = [e async for e in streamed.stream_events()]
        assert streamed.final_output == "streamed"
        assert kv.fallback_turns == 4
    await fallback.close()
    await dead.close()
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "unreachable" in warned[0].getMessage()


async def test_router_down_without_fallback_raises_the_sdks_error(dead_url: str) -> None:
    import openai

    dead = plain_client(dead_url)
    async with KVTetherProvider(dead_url, openai_client=dead) as kv:
        with pytest.raises(openai.APIConnectionError):
            await Runner.run(agent(), "hi", run_config=RunConfig(model_provider=kv))
    await dead.close()


async def test_the_routers_key_never_becomes_the_trace_export_key(
    router: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agents.tracing.processors import default_exporter

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    before = default_exporter()._api_key
    async with KVTetherProvider(router.url, api_key="router-secret", settings=FAST) as kv:
        router.replies.append({"content": "ok"})
        await Runner.run(agent(), "hi", run_config=RunConfig(model_provider=kv))
    assert default_exporter()._api_key == before
    assert default_exporter().api_key != "router-secret"


async def test_your_own_hooks_still_get_every_event(router: Any, provider: Any) -> None:
    from agents import RunHooks

    seen: list[str] = []

    class Mine(RunHooks[Any]):
        async def on_tool_start(self, context: Any, agent: Any, tool: Any) -> None:
            seen.append(f"start {tool.name}")

        async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: Any) -> None:
            seen.append(f"end {tool.name}")

        async def on_llm_end(self, context: Any, agent: Any, response: Any) -> None:
            seen.append("llm")

    script(router)
    await Runner.run(
        agent(grep), "fix it", run_config=RunConfig(model_provider=provider),
        hooks=KVTetherHooks(provider, wrapped=Mine()),
    )
    assert seen == ["llm", "start grep", "end grep", "llm"]


async def test_every_hook_the_sdk_defines_reaches_your_hooks(provider: Any) -> None:
    from agents import RunHooks

    names = sorted(n for n in dir(RunHooks) if n.startswith("on_"))
    got: list[str] = []

    class Everything(RunHooks[Any]):
        def __getattribute__(self, name: str) -> Any:
            if name.startswith("on_"):
                async def record(*args: Any, **kwargs: Any) -> None:
                    got.append(name)
                return record
            return super().__getattribute__(name)

    hooks = KVTetherHooks(provider, wrapped=Everything())
    for name in names:
        if name in ("on_tool_start", "on_tool_end"):
            continue  # these also heartbeat (above)
        await getattr(hooks, name)(None, None, None)
    assert got == [n for n in names if n not in ("on_tool_start", "on_tool_end")]
    # A hook a later SDK adds would be forwarded as well: the forwarders come from RunHooks.
    assert all(getattr(KVTetherHooks, n) is not getattr(RunHooks, n) for n in names)


@pytest.mark.parametrize("version", ["0.3.3", "0.26.0", "1.0.0", "garbage"])
def test_an_sdk_version_outside_the_range_is_refused_naming_it(version: str) -> None:
    with pytest.raises(UnsupportedAgentsVersionError, match=r">=0\.4,<0\.26") as info:
        check_agents_version(version)
    assert version in str(info.value) and isinstance(info.value, ImportError)
    assert "pip install 'openai-agents>=0.4,<0.26'" in str(info.value)
    assert SUPPORTED_RANGE == ">=0.4,<0.26"


@pytest.mark.parametrize("version", ["0.4.0", "0.4.2", "0.13.6", "0.24.0", "0.25.9"])
def test_every_version_in_the_range_is_accepted(version: str) -> None:
    assert check_agents_version(version) == version


def test_session_for_needs_a_grouping(provider: Any) -> None:
    with pytest.raises(ValueError, match="conversation_id, session or group_id"):
        provider.session_for()


def test_public_names() -> None:
    import kvtether_openai_agents

    assert sorted(kvtether_openai_agents.__all__) == sorted(
        ["KVTetherProvider", "KVTetherHooks", "UnsupportedAgentsVersionError", "SUPPORTED_RANGE"]
    )
    assert FAST.heartbeat_interval_s == 0.05


async def test_the_routers_key_goes_on_model_requests_heartbeats_and_release(
    router: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVTETHER_API_KEY", raising=False)

    @function_tool
    async def slow_grep(pattern: str) -> str:
        """Search slowly."""
        await asyncio.sleep(0.3)
        return "1 match"

    router.lease_remaining_s = 30.0
    async with KVTetherProvider(router.url, api_key="tenant-key", settings=FAST) as kv:
        script(router, "slow_grep")
        await Runner.run(agent(slow_grep), "fix it", run_config=RunConfig(model_provider=kv),
                         hooks=kv.hooks)
    sent = [(r.path, r.headers.get("authorization")) for r in router.received]
    assert any(p.endswith("/heartbeat") for p, _ in sent)
    assert any(p.startswith("/v1/sessions/") and not p.endswith("/heartbeat") for p, _ in sent)
    assert {auth for _, auth in sent} == {"Bearer tenant-key"}


async def test_an_agent_that_names_no_model_gets_the_one_the_router_serves(
    router: Any, provider: Any
) -> None:
    router.replies.append({"content": "done"})
    config = RunConfig(model_provider=provider)
    nameless = Agent(name="coder", instructions="Fix the bug.")
    assert (await Runner.run(nameless, "fix it", run_config=config)).final_output == "done"
    assert chat_requests(router)[-1].body["model"] == "fake"  # not "default"
    named = KVTetherProvider(router.url, model="picked", settings=FAST)
    assert named.get_model(None).model == "picked"
    await named.aclose()
