"""Release at the end, status queries, router-down behaviour, and the report."""

from __future__ import annotations

import gc
from typing import Any

import openai
import pytest
from openai import OpenAI

from kvtether.errors import RouterUnavailableError, SessionNotFound
from kvtether.session import AsyncSession, EventKind, Session
from tests.support.fake_router import FAST, FakeRouter

MESSAGES = [{"role": "user", "content": "hello"}]


def turn(client: OpenAI) -> None:
    client.chat.completions.create(model="fake", messages=MESSAGES)  # type: ignore[arg-type]


def released_ids(router: FakeRouter) -> list[str]:
    return [r.path.rsplit("/", 1)[-1] for r in router.received if r.method == "DELETE"]


def test_context_exit_releases_the_lease(router: FakeRouter, base_client: OpenAI) -> None:
    with Session(router.url, settings=FAST) as session:
        turn(session.wrap(base_client))
    assert released_ids(router) == [session.conversation_id] and session.released
    assert router.conversations[session.conversation_id].state == "released"
    session.close()  # a second close sends nothing
    assert len(released_ids(router)) == 1


def test_a_router_without_leases_counts_as_released(
    router: FakeRouter, base_client: OpenAI
) -> None:
    router.delete_status = 409  # reuse policy upstream or off: nothing to release
    with Session(router.url, settings=FAST) as session:
        turn(session.wrap(base_client))
    assert session.released
    assert [e.kind.value for e in session.events] == ["released"]


def test_a_new_turn_after_close_is_released_again(router: FakeRouter, base_client: OpenAI) -> None:
    session = Session(router.url, settings=FAST)
    client = session.wrap(base_client)
    turn(client)
    session.close()
    turn(client)
    assert session.turns[1].outcome == "miss:released" and not session.released
    session.close()
    assert len(released_ids(router)) == 2


def test_a_forgotten_session_is_released_when_collected(
    router: FakeRouter, base_client: OpenAI
) -> None:
    session = Session(router.url, settings=FAST)
    turn(session.wrap(base_client))
    cid = session.conversation_id
    del session
    gc.collect()
    assert released_ids(router) == [cid]


def test_nothing_is_released_when_no_turn_ran(router: FakeRouter) -> None:
    Session(router.url, settings=FAST).close()
    assert router.received == []


def test_status_reports_the_router_view(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    with pytest.raises(SessionNotFound, match=session.conversation_id):
        session.status()
    turn(client)
    status = session.status()
    assert status.conversation_id == session.conversation_id and status.retained_tokens > 0


def test_status_on_a_dead_router_says_so(dead_url: str) -> None:
    with pytest.raises(RouterUnavailableError, match="did not answer"):
        Session(dead_url, settings=FAST).status()


def test_router_down_fails_requests_with_the_sdks_own_error(dead_url: str) -> None:
    session = Session(dead_url, settings=FAST)
    base = OpenAI(base_url=dead_url + "/v1", api_key="t", max_retries=0)
    with pytest.raises(openai.APIConnectionError):
        turn(session.wrap(base))
    (record,) = session.turns
    assert record.outcome == "error" and record.http_status is None
    assert session.events[0].kind is EventKind.REQUEST_FAILED
    session.close()  # nothing was retained; nothing to do, nothing raised
    assert "error:no answer" in session.report()
    base.close()


def test_close_on_a_router_that_died_meanwhile_never_raises(
    router: FakeRouter, base_client: OpenAI, dead_url: str
) -> None:
    # The turn goes through the live router (so there is a lease to release); the session
    # API is at a dead address, as if the router went away after the turn.
    session = Session(dead_url, settings=FAST)
    turn(session.wrap(base_client))
    assert session.turns[0].outcome == "miss:first_turn"
    session.close()
    assert not session.released and session.events[-1].kind is EventKind.RELEASE_FAILED


async def test_async_session_releases_on_exit(router: FakeRouter) -> None:
    base = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="t", max_retries=0)
    async with AsyncSession(router.url, settings=FAST) as session:
        await session.wrap(base).chat.completions.create(model="fake", messages=MESSAGES)
        assert (await session.status()).retained_tokens > 0
    assert released_ids(router) == [session.conversation_id]
    await base.close()


def test_report_shows_each_turn_and_the_totals(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    messages: list[Any] = [{"role": "user", "content": "hello"}]
    reply = client.chat.completions.create(model="fake", messages=messages)
    with session.tool_call("grep"):
        pass
    messages += [reply.choices[0].message.model_dump(), {"role": "user", "content": "more"}]
    client.chat.completions.create(
        model="fake",
        messages=messages,
    )
    lines = session.report().splitlines()
    assert session.conversation_id in lines[0] and lines[1].split()[:2] == ["turn", "outcome"]
    assert lines[2].split()[:2] == ["1", "miss:first_turn"] and "grep" in lines[2]
    assert lines[3].split()[:2] == ["2", "fired"] and lines[3].endswith("extends")
    assert lines[4].startswith("fired 1/1 eligible turns (100%), 2 in all")


def test_report_says_where_later_turns_time_went() -> None:
    from kvtether import protocol as p
    from kvtether.session._records import Turn
    from kvtether.session._report import format_report

    header = p.TurnTimings(router_wait_s=0.0, plan_s=0.1, prefill_leg_s=0.9,
                           prefill=p.EngineTimings(queue_s=0.3, read_s=0.02, engine_s=0.8),
                           ).header_value()
    timings = p.parse_timings_header(header + ";bogus;x=nan-ish")
    assert timings == {"router_wait": 0.0, "plan": 0.1, "prefill_leg": 0.9,
                       "prefill_queue": 0.3, "prefill_read": 0.02, "prefill_engine": 0.8}
    turns = [Turn(turn=1, endpoint="chat", stream=True, ttft_s=3.0, timings=timings)]
    turns += [Turn(turn=i, endpoint="chat", stream=True, ttft_s=1.5, timings=timings)
              for i in (2, 3)]
    last = format_report("c", None, turns).splitlines()[-1]
    assert last == ("where turn 2+ time went (median of 2): TTFT 1.50 s · waiting for the "
                    "conversation 0.00 s · tokenize 0.10 s · prefill 0.90 s (queue 0.30 s, "
                    "KV read 0.02 s) · decode to first token 0.50 s")
