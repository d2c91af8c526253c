"""``tether``: requests carry their LangGraph thread; the model's output is unchanged;
Chat Completions only."""

from __future__ import annotations

import threading

import httpx
import pytest
from kvtether.protocol import HEADER_CONVERSATION_ID
from kvtether.session import Session, SessionPool
from langchain_core.messages import HumanMessage
from langchain_core.runnables import RunnableLambda

from kvtether_langgraph import ResponsesAPIUnsupportedError, is_tethered, tether

from lg_support import chat_model
from tests.support.fake_router import FakeRouter

CID = HEADER_CONVERSATION_ID.lower()


def sent_ids(router: FakeRouter) -> list[str]:
    return [r.headers[CID] for r in router.requests_to("/chat/completions")]


def test_each_thread_gets_its_own_conversation_id_even_interleaved(
    router: FakeRouter, pool: SessionPool
) -> None:
    model = tether(chat_model(router), pool)
    node = RunnableLambda(lambda text: model.invoke([HumanMessage(text)]).content)
    barrier = threading.Barrier(2)

    def run(thread_id: str) -> None:
        for _ in range(3):
            barrier.wait()
            node.invoke("hi", {"configurable": {"thread_id": thread_id}})

    workers = [threading.Thread(target=run, args=(t,)) for t in ("a", "b")]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    ids = sent_ids(router)
    expected = {t: Session.from_thread_id(t).conversation_id for t in ("a", "b")}
    assert sorted(ids) == sorted([expected["a"]] * 3 + [expected["b"]] * 3)
    assert [t.outcome for t in pool.get("a").turns] == ["miss:first_turn", "fired", "fired"]


def test_original_model_is_left_as_it_was(router: FakeRouter, pool: SessionPool) -> None:
    plain = chat_model(router)
    tethered = tether(plain, pool)
    assert is_tethered(tethered) and not is_tethered(plain)
    assert tether(tethered, pool) is tethered
    plain.invoke("hi")
    assert CID not in router.requests_to("/chat/completions")[0].headers


@pytest.mark.parametrize(
    "kwargs",
    [{"use_responses_api": True}, {"reasoning": {"effort": "low"}}],
    ids=["explicit", "inferred"],
)
def test_responses_api_is_refused_with_a_clear_error(
    router: FakeRouter, pool: SessionPool, kwargs: dict[str, object]
) -> None:
    with pytest.raises(ResponsesAPIUnsupportedError, match="Chat Completions .* only.*use_responses_api=False"):
        tether(chat_model(router, **kwargs), pool)


def test_never_switches_to_responses_api_on_its_own(router: FakeRouter, pool: SessionPool) -> None:
    # A built-in (non-function) tool switches a plain ChatOpenAI to /responses per request.
    builtin = {"type": "web_search_preview"}
    plain = chat_model(router)
    assert plain._use_responses_api(plain.bind_tools([builtin]).kwargs)  # type: ignore[attr-defined]
    tethered = tether(plain, pool)
    tethered.bind_tools([builtin]).invoke("hi", {"configurable": {"thread_id": "t"}})
    assert [r.path for r in router.received] == ["/v1/chat/completions"]


@pytest.mark.parametrize("call", ["invoke", "stream", "batch", "ainvoke", "astream"])
async def test_a_thread_id_given_to_the_model_itself_picks_its_session(
    router: FakeRouter, pool: SessionPool, call: str
) -> None:
    # Its own async HTTP client: langchain-openai shares one default client across event
    # loops, and each async test has its own loop.
    model = tether(chat_model(router, http_async_client=httpx.AsyncClient()), pool)
    config = {"configurable": {"thread_id": "A"}}
    msgs = [HumanMessage("hi")]
    if call == "invoke":
        model.invoke(msgs, config=config)
    elif call == "stream":
        list(model.stream(msgs, config=config))
    elif call == "batch":
        model.batch([msgs], config=config)
    elif call == "ainvoke":
        await model.ainvoke(msgs, config=config)
    else:
        [c async for c in model.astream(msgs, config=config)]
    assert sent_ids(router) == [Session.from_thread_id("A").conversation_id]
    assert pool.default.turns == []  # not the shared default session
