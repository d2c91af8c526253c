"""A greedy streamed chat turn's first token comes from prefill's answer, before decode's first
step; decode's copy of it is dropped, and the client's stream is what decode alone would send."""

from __future__ import annotations

import pytest

from kvtether import protocol as p
from tests.support.router_harness import make_router
from tests.support.waiting import await_for


def _text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in chunks if c.get("choices"))


def _token_ids(chunks: list[dict]) -> list[int]:
    return [t for c in chunks if c.get("choices") for t in c["choices"][0].get("token_ids") or []]


@pytest.mark.parametrize("token_ids", [False, True])
async def test_the_first_token_comes_from_prefill_and_the_stream_is_unchanged(
    token_ids: bool,
) -> None:
    extra = {"temperature": 0, "return_token_ids": True} if token_ids else {"temperature": 0}
    async with make_router(control=True) as h, \
            make_router(control=True, relay_prefill_token=False) as plain:
        a, b = h.conversation("relay"), plain.conversation("relay")
        for word in ("one", "two", "three"):
            t = await a.say(word, stream=True, **extra)
            ref = await b.say(word, stream=True, **extra)
            assert t.chunks is not None and ref.chunks is not None
            assert _text(t.chunks) == _text(ref.chunks) != ""
            assert [c["choices"][0].get("finish_reason") for c in t.chunks if c.get("choices")] \
                == [c["choices"][0].get("finish_reason") for c in ref.chunks if c.get("choices")]
            assert t.chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert len({c["id"] for c in t.chunks}) == 1  # one id, as from one vLLM
            if token_ids:
                assert _token_ids(t.chunks) == _token_ids(ref.chunks)
                assert t.chunks[0]["prompt_token_ids"] == ref.chunks[0]["prompt_token_ids"]
            else:
                assert _token_ids(t.chunks) == []
            # Prefill's token went first: decode's own role chunk and first token were dropped.
            d_sent = h.d.stream_chunks[-1]
            first_word = d_sent[1]["choices"][0]["delta"]["content"]
            assert t.chunks[1]["choices"][0]["delta"]["content"] == first_word
            assert not any(c is d_sent[0] for c in t.chunks)
        assert t.outcome == "fired"
        assert await h.metric("kvtether_first_token_from_prefill_total") == 3
        assert await plain.metric("kvtether_first_token_from_prefill_total") == 0
        assert (await h.client.get("/v1/sessions/relay")).json()["turns"][-1]["ttft_s"] > 0
        h.assert_kv_correct()


async def test_a_first_token_decode_disagrees_with_ends_the_stream_with_an_error() -> None:
    async with make_router(control=True) as h:
        a = h.conversation("disagree")
        await a.say("one", stream=True, temperature=0)
        h.d.fail_next("other_first_token")
        t = await h.chat(a.messages + [{"role": "user", "content": "two"}], "disagree",
                         stream=True, temperature=0)
        assert t.status == 200 and t.chunks is not None
        assert t.chunks[-1]["error"]["code"] == "upstream_error"
        assert "data: [DONE]" not in t.lines
        assert await h.metric("kvtether_first_token_mismatch_total") == 1
        # The failed turn's KV on decode is released in the background.
        await await_for(lambda: h.d.held_leases() == [], message="the failed turn's KV freed")
        # The next turn is served.
        assert (await a.say("three", stream=True, temperature=0)).status == 200


async def test_a_sampled_turn_streams_decode_s_chunks_as_they_are() -> None:
    async with make_router(control=True) as h:
        a = h.conversation("sampled")
        await a.say("one", stream=True)
        t = await a.say("two", stream=True)
        assert t.chunks is not None
        sent = [c for c in h.d.stream_chunks[-1] if c.get("choices")]
        got = [c for c in t.chunks if c.get("choices")]
        assert [c["choices"][0]["delta"] for c in got] == [c["choices"][0]["delta"] for c in sent]
        assert t.headers[p.HEADER_REUSE] == "fired"
