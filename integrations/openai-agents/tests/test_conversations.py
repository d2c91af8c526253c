"""Which conversation a run's model calls belong to, found through the SDK's public API only.

``kv.run`` / ``run_streamed`` / ``run_sync`` take the grouping from ``Runner``'s own arguments;
``kv.bind(...)`` does the same for ``Runner`` itself; the provider handed to ``Runner`` as is
sees only ``conversation_id``, else keeps one conversation per run.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from typing import Any

import pytest
from agents import Agent, RunConfig, RunHooks, Runner, SQLiteSession, function_tool
from openai import AsyncOpenAI

from kvtether.protocol import HEADER_CONVERSATION_ID
from kvtether_openai_agents import KVTetherHooks, KVTetherProvider

CID = HEADER_CONVERSATION_ID.lower()


def agent(*tools: Any) -> Agent[Any]:
    return Agent(name="coder", instructions="Fix the bug.", model="fake", tools=list(tools))


def replies(router: Any, count: int) -> None:
    router.replies.extend({"content": f"ok {i}"} for i in range(count))


def tool_then_done(router: Any, name: str) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": name, "arguments": json.dumps({"pattern": "TODO"})}}
    router.replies.extend([{"content": None, "tool_calls": [call]}, {"content": "done"}])


def cids(router: Any) -> list[str]:
    return [r.headers[CID] for r in router.requests_to("/chat/completions")]


async def test_kv_run_groups_runs_in_the_runners_order(router: Any, provider: Any) -> None:
    alice, bob = SQLiteSession("alice"), SQLiteSession("bob")
    replies(router, 6)
    await provider.run(agent(), "1", session=alice, run_config=RunConfig(group_id="team"))
    await provider.run(agent(), "2", session=alice)  # the session, not the group, decides
    await provider.run(agent(), "3", session=bob, run_config=RunConfig(group_id="team"))
    await provider.run(agent(), "4", run_config=RunConfig(group_id="team"))
    await provider.run(agent(), "5", run_config=RunConfig(group_id="team"))
    await provider.run(agent(), "6")  # no grouping: its own conversation
    one, two, three, four, five, six = cids(router)
    assert one == two == provider.session_for(session=alice).conversation_id
    assert three == provider.session_for(session="bob").conversation_id
    assert four == five == provider.session_for(group_id="team").conversation_id
    assert len({one, three, four, six}) == 4
    assert [t.outcome for t in provider.session_for(session=alice).turns] == [
        "miss:first_turn", "fired"]


async def test_kv_run_takes_conversation_id_first(router: Any, provider: Any) -> None:
    replies(router, 2)
    for text in ("one", "two"):
        await provider.run(
            agent(), text, conversation_id="conv-9", run_config=RunConfig(group_id="team")
        )
    first, second = cids(router)
    assert first == second == provider.session_for(conversation_id="conv-9").conversation_id
    assert first != provider.session_for(group_id="team").conversation_id


def test_blank_ids_count_as_absent_as_in_the_runner(provider: Any) -> None:
    by_group = provider.session_for(group_id="g")
    assert provider.session_for(conversation_id="  ", session=" ", group_id=" g ") is by_group
    with pytest.raises(ValueError, match="conversation_id, session or group_id"):
        provider.session_for(conversation_id="", group_id="  ")


async def test_the_provider_given_to_runner_sees_conversation_id_else_one_per_run(
    router: Any, provider: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    config = RunConfig(model_provider=provider)
    replies(router, 4)
    await Runner.run(agent(), "one", run_config=config, conversation_id="conv-1")
    await Runner.run(agent(), "two", run_config=config, conversation_id="conv-1")
    await Runner.run(agent(), "three", run_config=config)
    # A Session never reaches the model: this run is its own conversation (and says so once).
    await Runner.run(agent(), "four", run_config=config, session=SQLiteSession("carol"))
    one, two, three, four = cids(router)
    assert one == two == provider.session_for(conversation_id="conv-1").conversation_id
    assert len({two, three, four}) == 3
    assert four != provider.session_for(session="carol").conversation_id
    hints = [r for r in caplog.records if "kv.run(" in r.getMessage()]
    assert len(hints) == 1 and hints[0].levelno == logging.WARNING


async def test_one_run_given_the_provider_keeps_one_conversation_across_its_turns(
    router: Any, provider: Any
) -> None:
    @function_tool
    def grep(pattern: str) -> str:
        """Search."""
        return "1 match"

    tool_then_done(router, "grep")
    await Runner.run(agent(grep), "fix it", run_config=RunConfig(model_provider=provider))
    first, second = cids(router)
    assert first == second and router.conversations[first].turns == 2


async def test_bind_tethers_runner_runs_to_one_conversation(router: Any, provider: Any) -> None:
    dave = SQLiteSession("dave")
    bound = provider.bind(session=dave)
    fresh = provider.bind()  # no grouping: a new conversation, kept while it is reused
    replies(router, 5)
    for runner_config in (bound, bound, fresh, fresh, provider.bind()):
        await Runner.run(
            agent(), "hi", session=dave if runner_config is bound else None,
            run_config=RunConfig(model_provider=runner_config), hooks=provider.hooks,
        )
    a, b, c, d, e = cids(router)
    assert a == b == provider.session_for(session=dave).conversation_id
    assert bound.session is provider.session_for(session=dave)  # type: ignore[attr-defined]
    assert c == d and len({a, c, e}) == 3
    assert router.conversations[a].turns == 2 and router.conversations[c].turns == 2


async def test_kv_run_keeps_your_hooks_and_heartbeats_tools(router: Any, provider: Any) -> None:
    seen: list[str] = []

    class Mine(RunHooks[Any]):
        async def on_tool_start(self, context: Any, agent: Any, tool: Any) -> None:
            seen.append(f"start {tool.name}")

        async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: Any) -> None:
            seen.append(f"end {tool.name}")

    @function_tool
    async def slow_grep(pattern: str) -> str:
        """Search slowly."""
        await asyncio.sleep(0.3)  # several heartbeat intervals
        return "1 match"

    router.lease_remaining_s = 30.0
    tool_then_done(router, "slow_grep")
    result = await provider.run(agent(slow_grep), "fix it", hooks=Mine(),
                                session=SQLiteSession("erin"))
    assert result.final_output == "done"
    assert seen == ["start slow_grep", "end slow_grep"]
    session = provider.session_for(session="erin")
    (run,) = session.tool_runs
    assert run.name == "slow_grep" and run.heartbeats >= 1
    assert provider.pool.open_tool_runs() == []
    # Hooks that already are KVTetherHooks are used as they are.
    tool_then_done(router, "slow_grep")
    await provider.run(agent(slow_grep), "again", hooks=KVTetherHooks(provider, wrapped=Mine()),
                       session=SQLiteSession("erin"))
    assert seen[2:] == ["start slow_grep", "end slow_grep"]
    assert len(session.tool_runs) == 2


async def test_kv_run_keeps_the_rest_of_your_run_config(router: Any, provider: Any) -> None:
    replies(router, 1)
    config = RunConfig(group_id="g", workflow_name="mine", tracing_disabled=True)
    yours = config.model_provider
    result = await provider.run(agent(), "hi", run_config=config, max_turns=3)
    assert result.final_output == "ok 0"
    assert config.model_provider is yours  # your RunConfig itself is left as it was
    assert cids(router) == [provider.session_for(group_id="g").conversation_id]


@pytest.mark.skipif(
    "dict" not in str(inspect.signature(Runner.run).parameters["run_config"].annotation),
    reason="this SDK takes no dict for run_config",
)
async def test_kv_run_takes_a_run_config_dict_where_the_sdk_does(
    router: Any, provider: Any
) -> None:
    replies(router, 1)
    await provider.run(agent(), "hi", run_config={"group_id": "g"})
    assert cids(router) == [provider.session_for(group_id="g").conversation_id]


async def test_kv_run_streamed_with_a_session(router: Any, provider: Any) -> None:
    frank = SQLiteSession("frank")
    replies(router, 2)
    for text in ("one", "two"):
        streamed = provider.run_streamed(agent(), text, session=frank)
        _ = [event async for event in streamed.stream_events()]
    first, second = cids(router)
    assert first == second == provider.session_for(session=frank).conversation_id


def test_kv_run_sync_with_a_session(router: Any) -> None:
    loop = asyncio.new_event_loop()  # the loop run_sync runs on; closed by this test
    asyncio.set_event_loop(loop)
    client = AsyncOpenAI(base_url=router.url + "/v1", api_key="router-key", max_retries=0)
    kv = KVTetherProvider(router.url, openai_client=client)
    try:
        grace = SQLiteSession("grace")
        replies(router, 2)
        assert kv.run_sync(agent(), "one", session=grace).final_output == "ok 0"
        assert kv.run_sync(agent(), "two", session=grace).final_output == "ok 1"
        first, second = cids(router)
        assert first == second == kv.session_for(session=grace).conversation_id
    finally:
        loop.run_until_complete(kv.aclose())
        loop.run_until_complete(client.close())
        asyncio.set_event_loop(None)
        loop.close()



async def test_kv_run_keeps_a_binding_you_made(router: Any, provider: Any) -> None:
    mine = provider.bind(group_id="mine")
    replies(router, 1)
    await provider.run(agent(), "hi", session=SQLiteSession("henry"),
                       run_config=RunConfig(model_provider=mine))
    assert cids(router) == [provider.session_for(group_id="mine").conversation_id]
