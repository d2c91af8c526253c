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

from tests.support.waiting import wait_for

pytestmark = pytest.mark.vllm

SLOW_TOOL_MARGIN_S = 3.0  # the slow tool runs this much longer than the lease
# The tiny model's tokenizer knows only a few hundred words (anything else is <unk>), so every
# conversation opens with its own random run of known words: otherwise conversations share
# their first KV blocks, prefill's own prefix cache covers all but a few decode-held tokens, and
# vLLM recomputes those (fewer than its threshold, 16) instead of reading them: a "fired" turn
# that read nothing from decode, which is not what these tests are about. For the same reason each
# reply is long: prefill caches the full blocks of the prompt it computed, so decode must hold
# at least 16 tokens beyond them (the prompt's last partial block plus the reply).
MAX_TOKENS = 24
# The random model must not emit the tokenizer's special tokens (ids 0-3: <|endoftext|>,
# <|im_start|>, <|im_end|>, <unk>): vLLM leaves them out of the reply's text, so the re-sent
# history would not extend the KV decode holds (only its whole blocks before the difference
# are read), and an early
# <|im_end|> would leave too short a reply. Every reply is MAX_TOKENS ordinary words.
EXTRA_BODY = {"logit_bias": {str(i): -100 for i in range(4)}}
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
    r = httpx.get(f"{stack.decode_control_urls[0]}/kvtether/v1/leases/{key}",
                  headers=stack.control_headers, timeout=10)
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
    wait_for(lambda: _lease_state(stack, lease_key) == "released", timeout_s=2.0,
             interval_s=0.05, message=lambda: f"released, not {_lease_state(stack, lease_key)}")


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
                       max_tokens=MAX_TOKENS, temperature=0, max_retries=0,
                       extra_body=EXTRA_BODY),
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


# --- OpenAI Agents SDK -------------------------------------------------------------------------
class _ToolCallingTransport(httpx.AsyncBaseTransport):
    """Forwards to the router, and adds a planned tool call to some replies.

    The tiny model cannot call tools, and vLLM cannot force it to (``tool_choice="required"``
    uses guided decoding, which its word-level tokenizer breaks: "grammar rejected tokens", a
    500). So the planned call is added to the reply below kvtether's client wrapper: the pool
    sees a reply that asked for the tool (its ``tool_call_id`` finds the session for the
    hooks' heartbeats) and the SDK runs the tool, as when a real model asks for it. The text the
    model generated is unchanged, so the next prompt still extends the KV decode holds.
    """

    def __init__(self, plans: dict[str, list[str | None]]) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self.plans = plans  # conversation id -> per model call: a tool to call, or None
        self._ids = itertools.count(1)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        import json

        cid = request.headers.get("x-conversation-id")
        response = await self._inner.handle_async_request(request)
        plan = self.plans.get(cid or "")
        name = plan.pop(0) if plan else None
        if name is None or not request.url.path.endswith("/chat/completions"):
            return response
        body = await response.aread()
        await response.aclose()
        call_id = f"call_{next(self._ids)}"
        call = {"id": call_id, "type": "function",
                "function": {"name": name, "arguments": json.dumps({"topic": "tests"})}}
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            events = body.decode().split("\n\n")
            out = []
            for event in events:
                if event.startswith("data: {"):
                    obj = json.loads(event[len("data: "):])
                    choice = (obj.get("choices") or [None])[0]
                    if choice and choice.get("finish_reason"):
                        extra = {**obj, "choices": [{"index": 0, "finish_reason": None, "delta": {
                            "tool_calls": [{"index": 0, **call}]}}]}
                        out.append("data: " + json.dumps(extra))
                        choice["finish_reason"] = "tool_calls"
                        event = "data: " + json.dumps(obj)
                out.append(event)
            new = "\n\n".join(out).encode()
        else:
            obj = json.loads(body)
            obj["choices"][0]["message"]["tool_calls"] = [call]
            obj["choices"][0]["finish_reason"] = "tool_calls"
            new = json.dumps(obj).encode()
        headers = [(k, v) for k, v in response.headers.items()
                   if k.lower() not in ("content-length", "content-encoding", "transfer-encoding")]
        return httpx.Response(response.status_code, headers=headers, content=new,
                              request=request)

    async def aclose(self) -> None:
        await self._inner.aclose()


def test_openai_agents_two_sessions_interleaved_with_a_long_and_a_failing_tool(
    short_lease: Any,
) -> None:
    from agents import (
        Agent,
        ModelSettings,
        RunConfig,
        SQLiteSession,
        function_tool,
    )
    from openai import AsyncOpenAI

    from kvtether_openai_agents import KVTetherProvider

    stack = short_lease
    # Not strict: vLLM enforces a strict tool's schema with a grammar once the model emits
    # <tool_call>, which the random tiny model sometimes does, and the grammar fails on its
    # word-level tokenizer (a 500). The tools' calls come from _ToolCallingTransport anyway.
    slow_s = stack.lease_ttl_s + SLOW_TOOL_MARGIN_S
    raised: list[str] = []

    @function_tool(strict_mode=False)
    async def slow_lookup(topic: str) -> str:
        """Look a topic up (slower than the decode lease)."""
        await asyncio.sleep(slow_s)
        return f"notes on {topic}: all tests pass."

    @function_tool(strict_mode=False)
    def broken(topic: str) -> str:
        """Always fails."""
        raised.append(topic)
        raise RuntimeError(f"broken tool cannot look up {topic}")

    @function_tool(strict_mode=False)
    def quick(topic: str) -> str:
        """A quick lookup."""
        return f"{topic}: fine."

    async def main() -> None:
        transport = _ToolCallingTransport({})
        client = AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="-", max_retries=0,
                             http_client=httpx.AsyncClient(transport=transport, timeout=30))
        kv = KVTetherProvider(stack.base_url, openai_client=client)
        # Per model call of each conversation: the tool its reply asks for, or None (text only).
        # A run whose reply asks for a tool calls the model again after the tool: two turns.
        transport.plans.update({
            kv.session_for(session="oa-plain").conversation_id:
                ["slow_lookup", None, "broken", None, None],
            kv.session_for(session="oa-stream").conversation_id: ["quick", None, None],
        })
        agent = Agent(
            name="coder", instructions=_system_prompt(), model=stack.model,
            tools=[slow_lookup, broken, quick],
            # "none": vLLM runs no tool parser on the replies. With tools and "auto", the hermes
            # parser reads the random model's stray <tool_call> words: a streamed reply then
            # loses that text (the next prompt no longer extends the held KV: only the whole
            # blocks before it are read) and a strict tool's grammar fails on the tiny tokenizer.
            # The SDK still runs the tool calls a reply holds.
            model_settings=ModelSettings(max_tokens=MAX_TOKENS, temperature=0, tool_choice="none",
                                         extra_body=EXTRA_BODY),
        )
        # A second agent with its own instructions: the two conversations share no KV blocks.
        agent_b = agent.clone(instructions=_system_prompt())
        run_config = RunConfig(tracing_disabled=True)  # kv.run binds its provider
        plain, streamed = SQLiteSession("oa-plain"), SQLiteSession("oa-stream")
        events: list[str] = []

        async def run_plain(text: str) -> Any:
            return await kv.run(agent, text, session=plain, run_config=run_config, max_turns=4)

        async def run_stream(text: str) -> Any:
            result = kv.run_streamed(agent_b, text, session=streamed, run_config=run_config,
                                     max_turns=4)
            async for event in result.stream_events():
                events.append(event.type)
            return result

        t0 = time.monotonic()
        r = await run_plain("explain what the tests do.")  # slow_lookup outlives the lease
        assert time.monotonic() - t0 > stack.lease_ttl_s, (r.new_items, transport.plans)
        assert [i.type for i in r.new_items] == [
            "message_output_item", "tool_call_item", "tool_call_output_item",
            "message_output_item"], r.new_items
        assert "all tests pass" in r.new_items[2].output
        s = await run_stream("explain what the tests do.")  # quick
        assert s.new_items[2].output == "tests: fine."
        r = await run_plain("tell more.")  # broken: the error reaches the model, as without us
        # The SDK's default tool-error handling, as without kvtether: the model reads a message.
        assert raised == ["tests"]
        assert r.new_items[2].output.startswith("An error occurred while running the tool")
        s = await run_stream("tell more.")
        r = await run_plain("and then?")
        assert isinstance(r.final_output, str) and isinstance(s.final_output, str)
        assert events.count("raw_response_event") > 6  # the streamed runs really streamed

        s_plain, s_stream = kv.session_for(session="oa-plain"), kv.session_for(session="oa-stream")
        assert s_plain.conversation_id != s_stream.conversation_id
        assert [t.stream for t in s_plain.turns] == [False] * 5
        assert [t.stream for t in s_stream.turns] == [True] * 3
        keys = [_assert_conversation(stack, s_plain, 5), _assert_conversation(stack, s_stream, 3)]
        runs = {run.name: run for run in s_plain.tool_runs}
        assert runs["slow_lookup"].duration_s > stack.lease_ttl_s
        assert runs["slow_lookup"].heartbeats >= 2 and runs["slow_lookup"].heartbeat_failures == 0
        assert [run.name for run in s_stream.tool_runs] == ["quick"]
        assert not any(transport.plans.values())  # every planned model call was made
        await kv.aclose()  # releases both conversations' KV
        for session, key in zip((s_plain, s_stream), keys, strict=True):
            assert session.released
            _assert_released(stack, session.conversation_id, key)
        await client.close()

    asyncio.run(main())
