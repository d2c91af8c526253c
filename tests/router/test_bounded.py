"""Bounded memory: the conversation table never passes its cap, turn history keeps the last N."""

from __future__ import annotations

import pytest

from kvtether import protocol as p
from kvtether.router.conversations import ConversationTableFullError, InMemoryConversationStore
from tests.support.router_harness import make_router


def test_full_table_drops_the_oldest_idle_conversation_past_one_in_flight() -> None:
    dropped: list[str] = []
    store = InMemoryConversationStore(3, on_drop=lambda c: dropped.append(c.conversation_id))
    a, _, _ = (store.get_or_create(x) for x in "abc")
    # The oldest has a turn in flight: the next oldest goes instead (it used to stop there,
    # and the table grew past its cap).
    a.lock._locked = True  # type: ignore[attr-defined]
    for x in "defg":
        store.get_or_create(x)
        assert len(store) == 3
    assert dropped == ["b", "c", "d", "e"]
    assert [c.conversation_id for c in store.values()] == ["a", "f", "g"]


def test_a_table_whose_every_conversation_is_mid_turn_refuses_a_new_one() -> None:
    store = InMemoryConversationStore(2)
    for x in "ab":
        store.get_or_create(x).lock._locked = True  # type: ignore[attr-defined]
    with pytest.raises(ConversationTableFullError):
        store.get_or_create("c")
    assert len(store) == 2


async def test_table_full_of_turns_in_flight_answers_a_retryable_503() -> None:
    async with make_router(control=True, max_conversations=1) as h:
        await h.conversation("busy").say("one")
        conv = h.app.state.store.get("busy")
        await conv.lock.acquire()
        try:
            r = await h.client.post("/v1/chat/completions", headers={
                p.HEADER_CONVERSATION_ID: "new"}, json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        finally:
            conv.lock.release()
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "conversation_table_full"
        assert (await h.conversation("new").say("one")).status == 200  # busy is idle again
        assert len(h.app.state.store) == 1


async def test_turn_history_keeps_the_last_records_and_totals_of_all() -> None:
    async with make_router(control=True, max_turn_records=3) as h:
        a = h.conversation("long")
        outcomes = [(await a.say(f"step {i}")).outcome for i in range(5)]
        st = (await h.client.get("/v1/sessions/long")).json()
        assert [t["turn"] for t in st["turns"]] == [3, 4, 5]
        assert st["turn_count"] == 5
        assert st["fired_turns"] == outcomes.count("fired") == 4
        assert st["prompt_tokens_total"] > sum(t["prompt_tokens"] for t in st["turns"])
        assert st["reused_tokens_total"] >= sum(t["reused_tokens"] for t in st["turns"])
        assert (await a.say("again")).headers[p.HEADER_TURN] == "6"
