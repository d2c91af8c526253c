"""The framework integrations on the real stack (tiny model): LangGraph and the OpenAI Agents SDK.

For each integration, two conversations interleaved turn by turn, one streamed and one not; one
tool outlives the router's lease (only heartbeats keep the KV) and one tool raises. Every turn
after the first of each conversation reads the previous turns' KV ("fired"), each conversation's
turns land on its own conversation id, and closing the pool / provider releases the KV.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.vllm

SLOW_TOOL_MARGIN_S = 3.0  # the slow tool runs this much longer than the lease
MAX_TOKENS = 24
# The tiny model's tokenizer knows only a few hundred words (anything else is <unk>), so every
# conversation opens with its own random run of known words: otherwise conversations share
# their first KV blocks, prefill's own prefix cache covers all but a few decode-held tokens, and
# vLLM recomputes those (fewer than its threshold, 16) instead of reading them, which is a
# correct "miss:below_threshold" but not what these tests are about. For the same reason each
# reply is long: prefill caches the full blocks of the prompt it computed, so decode must hold
# at least 16 tokens beyond them (the prompt's last partial block plus the reply).
_WORDS = (
    "you are a helpful please can could would should will is was be have has had do did what "
    "when where which who why how this that these those it its in on at to from by with for of "
    "and or but not no yes all any some each every more most less first last next hello hi "
    "thanks ok sure here there now then again write code python shell command repo repository "
    "files tests tool tools call calls called read wrote open close edit summarize explain "
    "check find show tell give make use need want see look get set go"
).split()


def _system_prompt() -> str:
    rng = random.SystemRandom()
    return " ".join(rng.choice(_WORDS) for _ in range(48)) + ". you are a helpful assistant."


def _router_status(url: str, cid: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/v1/sessions/{cid}", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _lease_state(stack: Any, key: str) -> str:
    r = httpx.get(f"{stack.decode_control_urls[0]}/kvtether/v1/leases/{key}", timeout=10)
    body = r.json()
    return body["state"] if r.status_code == 200 else body.get("lease", {}).get("state", "unknown")


def _assert_released(stack: Any, cid: str, lease_key: str) -> None:
    """The router no longer holds the conversation's KV, nor does the decode instance."""
    r = httpx.get(f"{stack.base_url}/v1/sessions/{cid}", timeout=10)
    if r.status_code == 200:
        st = r.json()
        assert st["lease_state"] == "released" and st["retained_tokens"] == 0, st
    else:
        assert r.status_code in (404, 410), r.text
    deadline = time.monotonic() + 2.0
    while (state := _lease_state(stack, lease_key)) != "released":
        assert time.monotonic() < deadline, state
        time.sleep(0.05)


def _assert_conversation(stack: Any, session: Any, n_turns: int) -> str:
    """Every turn after the first fired, all on this session's id, as the router saw them too.
    Returns the decode lease key (still active)."""
    outcomes = [t.outcome for t in session.turns]
    report = session.report()
    assert len(outcomes) == n_turns, report
    assert outcomes[0].startswith("miss:") and outcomes[1:] == ["fired"] * (n_turns - 1), report
    assert all(t.reused_tokens > 0 for t in session.turns[1:]), report
    st = _router_status(stack.base_url, session.conversation_id)
    assert st["conversation_id"] == session.conversation_id
    assert [t["outcome"] for t in st["turns"]] == outcomes, st
    assert st["lease_state"] == "active" and st["retained_tokens"] > 0, st
    assert st["lease_key"], st
    return st["lease_key"]


# --- LangGraph ---------------------------------------------------------------------------------
def test_langgraph_two_threads_interleaved_with_a_long_and_a_failing_tool(short_lease: Any) -> None:
    from kvtether import SessionPool
    from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode

    from kvtether_langgraph import KVTetherCallbackHandler, tether

    stack = short_lease
    slow_s = stack.lease_ttl_s + SLOW_TOOL_MARGIN_S

    @tool
    def slow_lookup(topic: str) -> str:
        """Look a topic up (slower than the decode lease)."""
        time.sleep(slow_s)
        return f"Notes on {topic}: caches keep recent results close to where they are used."

    @tool
    def broken(topic: str) -> str:
        """Always fails."""
        raise RuntimeError(f"broken tool cannot look up {topic}")

    @tool
    def quick(topic: str) -> str:
        """A quick lookup."""
        return f"{topic}: fine."

    # The tiny model cannot call tools, so after each model turn a deterministic node asks for
    # the thread's next planned tool (an AIMessage with tool_calls built here) and ToolNode runs
    # it, with KVTetherCallbackHandler heartbeating the thread's lease meanwhile.
    plans: dict[str, list[str | None]] = {
        "lg-plain": ["slow_lookup", "broken", None],
        "lg-stream": ["quick", "quick", None],
    }
    ids = itertools.count(1)

    def plan_tool(state, config):  # untyped: LangGraph reads the hints, local names here
        name = plans[config["configurable"]["thread_id"]].pop(0)
        call = {"name": name, "args": {"topic": "caching"}, "id": f"call_{next(ids)}",
                "type": "tool_call"}
        return {"messages": [AIMessage(content="", tool_calls=[call])]}

    def after_agent(state, config):
        return "plan" if plans[config["configurable"]["thread_id"]][0] else END

    with SessionPool(stack.base_url) as pool:
        model = tether(
            ChatOpenAI(model=stack.model, base_url=stack.base_url + "/v1", api_key="-",
                       max_tokens=MAX_TOKENS, temperature=0, max_retries=0),
            pool,
        )

        def agent(state):
            return {"messages": [model.invoke(state["messages"])]}

        builder = StateGraph(MessagesState)
        builder.add_node("agent", agent)
        builder.add_node("plan", plan_tool)
        builder.add_node("tools", ToolNode([slow_lookup, broken, quick], handle_tool_errors=True))
        builder.add_edge(START, "agent")
        builder.add_conditional_edges("agent", after_agent, ["plan", END])
        builder.add_edge("plan", "tools")
        builder.add_edge("tools", END)
        graph = builder.compile(checkpointer=InMemorySaver())
        handler = KVTetherCallbackHandler(pool)

        def config(thread: str) -> dict[str, Any]:
            return {"configurable": {"thread_id": thread}, "callbacks": [handler]}

        def first(thread: str) -> list[Any]:
            return [SystemMessage(_system_prompt()),
                    HumanMessage("explain what the tests do.")]

        streamed_chunks = 0

        def run_plain(messages: list[Any]) -> list[Any]:
            return graph.invoke({"messages": messages}, config("lg-plain"))["messages"]

        def run_stream(messages: list[Any]) -> list[Any]:
            nonlocal streamed_chunks
            for chunk, _meta in graph.stream(
                {"messages": messages}, config("lg-stream"), stream_mode="messages"
            ):
                streamed_chunks += isinstance(chunk, AIMessageChunk)
            return graph.get_state(config("lg-stream")).values["messages"]

        t0 = time.monotonic()
        plain, streamed = run_plain(first("lg-plain")), run_stream(first("lg-stream"))
        # The slow tool outlived the lease; only the handler's heartbeats kept the KV.
        assert isinstance(plain[-1], ToolMessage) and plain[-1].name == "slow_lookup"
        assert time.monotonic() - t0 > stack.lease_ttl_s
        plain = run_plain([HumanMessage("tell more.")])
        # The failing tool's error reached the graph as ToolNode reports it without kvtether.
        assert plain[-1].status == "error" and "broken tool cannot" in plain[-1].content, plain[-1]
        streamed = run_stream([HumanMessage("tell more.")])
        plain = run_plain([HumanMessage("and then?")])
        streamed = run_stream([HumanMessage("and then?")])
        assert isinstance(plain[-1], AIMessage) and isinstance(streamed[-1], AIMessage)
        assert streamed_chunks > 3  # the streamed thread really streamed

        s_plain, s_stream = pool.get("lg-plain"), pool.get("lg-stream")
        assert s_plain.conversation_id != s_stream.conversation_id
        assert [t.stream for t in s_plain.turns] == [False] * 3
        assert [t.stream for t in s_stream.turns] == [True] * 3
        keys = [_assert_conversation(stack, s, 3) for s in (s_plain, s_stream)]
        runs = {r.name: r for r in s_plain.tool_runs}
        assert runs["slow_lookup"].duration_s > stack.lease_ttl_s
        assert runs["slow_lookup"].heartbeats >= 2 and runs["slow_lookup"].heartbeat_failures == 0
        assert not runs["broken"].ok and runs["broken"].error == "RuntimeError"
        assert [r.name for r in s_stream.tool_runs] == ["quick", "quick"]
        assert handler.running == 0
    # Closing the pool (the with-block) released both threads' KV.
    for s, key in zip((s_plain, s_stream), keys, strict=True):
        assert s.released
        _assert_released(stack, s.conversation_id, key)
