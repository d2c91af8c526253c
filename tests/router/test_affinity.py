"""Decode affinity: a conversation stays on the decode instance that holds its KV."""

from __future__ import annotations

import pytest

from kvtether import protocol as p
from tests.support.router_harness import make_router


@pytest.mark.parametrize("control", [False, True])
async def test_conversation_sticks_to_its_decode(control: bool) -> None:
    async with make_router(n_decode=2, n_prefill=2, control=control) as h:
        a = h.conversation("sticky")
        seen = set()
        for i in range(5):
            t = await a.say(f"turn {i}")
            seen.add(t.headers[p.HEADER_DECODE_INSTANCE])
            assert t.outcome == ("miss:first_turn" if i == 0 else "fired")
        assert len(seen) == 1
        name = seen.pop().replace("-", "")
        d = next(d for d in h.decode if d.name == name)
        other = next(d for d in h.decode if d.name != name)
        assert len(d.requests) == 5 and other.requests == []
        # Prefill legs are spread by load (ties round-robin), and reuse fires on either P.
        assert all(len(pf.requests) > 0 for pf in h.prefill)
        h.assert_kv_correct()


async def test_conversations_spread_over_decodes() -> None:
    async with make_router(n_decode=2) as h:
        agents = [h.conversation(f"c{i}") for i in range(4)]
        placement: dict[str, set[str]] = {}
        for round_ in range(3):
            for a in agents:
                t = await a.say(f"round {round_}")
                placement.setdefault(a.cid, set()).add(t.headers[p.HEADER_DECODE_INSTANCE])
                assert t.outcome == ("miss:first_turn" if round_ == 0 else "fired")
        assert all(len(v) == 1 for v in placement.values())
        used = [next(iter(v)) for v in placement.values()]
        assert used.count("decode-0") == 2 and used.count("decode-1") == 2
        h.assert_kv_correct()


async def test_dead_decode_known_down_moves_conversation() -> None:
    async with make_router(n_decode=2) as h:
        a = h.conversation("move")
        await a.say("one")
        t = await a.say("two")
        home = t.headers[p.HEADER_DECODE_INSTANCE]
        dead = h.decode[int(home[-1])]
        alive = h.decode[1 - int(home[-1])]
        dead.down = True
        health = await h.client.get("/health")  # the router notices
        assert health.json()["backends"][home] is False
        t3 = await a.say("three")
        assert t3.status == 200
        assert t3.outcome == "miss:decode_unavailable"
        assert t3.headers[p.HEADER_DECODE_INSTANCE] == f"decode-{alive.name[-1]}"
        assert alive.requests
        t4 = await a.say("four")
        assert t4.outcome == "fired"
        assert t4.headers[p.HEADER_DECODE_INSTANCE] == t3.headers[p.HEADER_DECODE_INSTANCE]
        status = (await h.client.get("/v1/sessions/move")).json()
        assert status["decode_instance"] == t4.headers[p.HEADER_DECODE_INSTANCE]
        h.assert_kv_correct()


async def test_dead_decode_not_yet_noticed_turn_still_succeeds() -> None:
    """D dies between turns and nothing has noticed: the turn is served by the other decode
    instance (P still holds this turn's KV, so any D can read it)."""
    async with make_router(n_decode=2) as h:
        a = h.conversation("move2")
        t = await a.say("one")
        home = t.headers[p.HEADER_DECODE_INSTANCE]
        h.decode[int(home[-1])].down = True
        t2 = await a.say("two")
        assert t2.status == 200
        assert t2.outcome.startswith("miss:")
        assert t2.headers[p.HEADER_DECODE_INSTANCE] != home
        t3 = await a.say("three")
        assert t3.outcome == "fired"
        assert t3.headers[p.HEADER_DECODE_INSTANCE] == t2.headers[p.HEADER_DECODE_INSTANCE]
        h.assert_kv_correct()


async def test_dead_decode_not_yet_noticed_reported_as_decode_unavailable() -> None:
    async with make_router(n_decode=2) as h:
        a = h.conversation("move3")
        t = await a.say("one")
        h.decode[int(t.headers[p.HEADER_DECODE_INSTANCE][-1])].down = True
        t2 = await a.say("two")
        assert t2.outcome == "miss:decode_unavailable"


async def test_no_handle_forwarded_for_a_decode_known_down() -> None:
    """P would stall on a NIXL handshake with a dead host before recomputing."""
    async with make_router(n_decode=2) as h:
        a = h.conversation("nofwd")
        t = await a.say("one")
        h.decode[int(t.headers[p.HEADER_DECODE_INSTANCE][-1])].down = True
        await h.client.get("/health")
        await a.say("two")
        assert h.p.prefill_handles[-1] is None


def test_new_conversations_alternate_decodes_when_prefill_picks_come_between() -> None:
    """Each turn picks a prefill, then a decode: equal loads must still spread new
    conversations over both decode instances (and both prefills)."""
    from kvtether.router.backends import BackendPool
    from kvtether.router.settings import RouterSettings

    pool = BackendPool(RouterSettings(prefill_urls=["http://p0", "http://p1"],
                                      decode_urls=["http://d0", "http://d1"]))
    prefills, decodes = [], []
    for _ in range(4):
        prefills.append(pool.pick_prefill().name)
        decodes.append(pool.pick_decode(None).name)
    assert sorted(decodes) == ["decode-0", "decode-0", "decode-1", "decode-1"]
    assert sorted(prefills) == ["prefill-0", "prefill-0", "prefill-1", "prefill-1"]
    # Load wins over rotation: with equal queues, the decode that retains less KV takes the
    # next conversation...
    pool.decode[0].retained_tokens = 500
    assert {pool.pick_decode(None).name for _ in range(3)} == {"decode-1"}
    # ... and a shorter queue wins over retaining less: a burst of new conversations spreads.
    pool.decode[1].inflight = 1
    assert {pool.pick_decode(None).name for _ in range(3)} == {"decode-0"}
    # A prefill instance is picked by the prompt tokens of its legs in flight, then by legs:
    # two short legs are less work than one long first turn.
    pool.prefill[0].inflight, pool.prefill[0].prompt_backlog_tokens = 2, 120
    pool.prefill[1].inflight, pool.prefill[1].prompt_backlog_tokens = 1, 700
    assert {pool.pick_prefill().name for _ in range(3)} == {"prefill-0"}
    pool.prefill[0].prompt_backlog_tokens = 700
    assert {pool.pick_prefill().name for _ in range(3)} == {"prefill-1"}
