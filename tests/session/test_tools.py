"""Tools and steps: timing, heartbeats while tools run, and nothing left running afterwards."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from openai import AsyncOpenAI, OpenAI

from kvtether.protocol import HeartbeatRequest, Phase
from kvtether.session import AsyncSession, EventKind, Session, SessionSettings
from tests.support.fake_router import FakeRouter, heartbeat_threads
from tests.support.waiting import await_for, wait_for

MESSAGES: Any = [{"role": "user", "content": "fix the failing test"}]


def first_turn(client: OpenAI) -> None:
    client.chat.completions.create(model="fake", messages=MESSAGES)


def heartbeats(router: FakeRouter) -> list[HeartbeatRequest]:
    return [HeartbeatRequest.model_validate(r.body) for r in router.requests_to("/heartbeat")]


def beats_at_least(router: FakeRouter, n: int) -> Callable[[], bool]:
    return lambda: len(router.requests_to("/heartbeat")) >= n


def test_heartbeats_renew_the_lease_while_a_tool_runs(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    first_turn(client)
    with session.tool_call("grep", eta_s=5, args={"pattern": "TODO"}) as run:
        wait_for(beats_at_least(router, 3))  # one at start, then every 0.05 s

    beats = heartbeats(router)
    assert all(b.phase is Phase.TOOL_RUNNING and b.tool_name == "grep" for b in beats)
    assert beats[0].expected_duration_s == pytest.approx(5, abs=0.1)
    assert all(b.next_prompt_tokens for b in beats)
    assert run.heartbeats == len(beats) and run.ok and run.duration_s > 0.1
    (turn,) = session.turns
    assert turn.tools == ["grep"] and turn.tool_time_s == pytest.approx(run.duration_s)


def test_no_heartbeat_before_a_turn_created_a_lease(router: FakeRouter, session: Session) -> None:
    with session.tool_call("setup"):
        time.sleep(0.1)
    assert router.requests_to("/heartbeat") == []
    assert session.tool_runs[0].after_turn == 0


def test_heartbeat_interval_is_capped_at_a_third_of_the_lease_left(
    router: FakeRouter, client: OpenAI, session: Session
) -> None:
    slow = Session(
        router.url,
        conversation_id=session.conversation_id,
        settings=SessionSettings(heartbeat_interval_s=60),
    )
    wrapped = slow.wrap(client)
    router.lease_remaining_s = 0.15  # → one heartbeat every 0.05 s despite the 60 s setting
    first_turn(wrapped)
    with slow.tool_call("build"):
        wait_for(beats_at_least(router, 3), timeout_s=20)  # 60 s apart would time out
    slow.close()


def test_decorated_sync_tool_keeps_its_signature_and_result(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    @session.tool
    def bash(command: str, timeout_s: float = 10) -> str:
        """Run a command."""
        wait_for(beats_at_least(router, 1))
        return f"ran {command}"

    first_turn(client)
    assert bash("pytest -x") == "ran pytest -x"
    assert bash.__name__ == "bash" and bash.__doc__ == "Run a command."
    (run,) = session.tool_runs
    assert (run.name, run.key, run.ok) == ("bash", "bash:pytest", True)
    assert heartbeats(router)[0].tool_name == "bash"


def test_named_tool_with_eta_and_generators(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    @session.tool(name="tail_log", eta_s=2)
    def lines(n: int) -> Iterator[str]:
        wait_for(beats_at_least(router, 1))
        for i in range(n):
            time.sleep(0.03)
            yield f"line {i}"

    first_turn(client)
    assert list(lines(3)) == ["line 0", "line 1", "line 2"]
    (run,) = session.tool_runs
    assert run.name == "tail_log" and run.eta_s == 2 and run.duration_s >= 0.09
    assert heartbeats(router)[0].expected_duration_s == pytest.approx(2, abs=0.1)


def test_a_raising_tool_raises_and_leaves_no_heartbeat_thread(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    @session.tool
    def flaky() -> None:
        time.sleep(0.05)
        raise ValueError("disk full")

    first_turn(client)
    with pytest.raises(ValueError, match="disk full"):
        flaky()
    assert heartbeat_threads() == []
    (run,) = session.tool_runs
    assert not run.ok and run.error == "ValueError"
    assert session.turns[0].tools == ["flaky"]  # failed tools still took time


def test_steps_number_the_requests_made_in_them(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    @session.step
    def step() -> None:
        first_turn(client)

    step()
    step()
    first_turn(client)
    assert [t.step for t in session.turns] == [1, 2, None]


def test_router_down_during_a_tool_never_reaches_the_tool(
    router: FakeRouter, client: OpenAI, caplog: pytest.LogCaptureFixture, dead_url: str
) -> None:
    s = Session(
        dead_url, settings=SessionSettings(heartbeat_interval_s=0.02, request_timeout_s=0.5)
    )
    wrapped = s.wrap(client)  # the model server is up, the session API is not
    first_turn(wrapped)
    with caplog.at_level(logging.DEBUG, logger="kvtether"), s.tool_call("grep") as run:
        wait_for(lambda: run.heartbeat_failures >= 2)  # retried with backoff
    assert run.ok and run.heartbeats == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "heartbeat" in warnings[0].getMessage()  # logged once
    assert [e.kind for e in s.events] == [EventKind.HEARTBEAT_FAILED]
    s.close()  # never raises on a dead router
    assert not s.released and s.events[-1].kind is EventKind.RELEASE_FAILED


def test_a_slow_router_does_not_hold_up_the_tool(
    router: FakeRouter, client: OpenAI, session: Session
) -> None:
    s = Session(
        router.url, settings=SessionSettings(heartbeat_interval_s=0.05, request_timeout_s=3)
    )
    first_turn(s.wrap(client))
    router.heartbeat_delay_s = 5  # each heartbeat hangs until the 3 s timeout
    with s.tool_call("grep") as run:
        wait_for(beats_at_least(router, 1))
    assert heartbeat_threads() != []  # the tool ended while its heartbeat still hung
    wait_for(lambda: heartbeat_threads() == [])  # the hung heartbeat ends on its own
    assert run.heartbeats == 0 and run.heartbeat_failures == 1
    router.heartbeat_delay_s = 0
    s.close()


def test_a_heartbeat_waits_for_a_loaded_router_up_to_its_interval(
    router: FakeRouter, client: OpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    # A renewal waits for decode's next engine step; on a loaded decode that can take longer
    # than request_timeout_s. The heartbeat runs beside the tool, so it waits up to its
    # interval rather than failing and backing off (16 conversations on a saturated stack
    # logged such timeouts).
    s = Session(
        router.url, settings=SessionSettings(heartbeat_interval_s=0.6, request_timeout_s=0.1)
    )
    first_turn(s.wrap(client))
    router.heartbeat_delay_s = 0.3  # 3x request_timeout_s, half the interval
    with caplog.at_level(logging.WARNING, logger="kvtether"), s.tool_call("pytest") as run:
        wait_for(lambda: run.heartbeats >= 2, timeout_s=10)
    assert run.heartbeat_failures == 0
    assert not [r for r in caplog.records if "heartbeat" in r.getMessage()]
    router.heartbeat_delay_s = 0
    s.close()


@pytest.mark.parametrize("status", [404, 409], ids=["unknown", "policy_without_leases"])
def test_unknown_session_stops_heartbeats_quietly(
    router: FakeRouter, session: Session, client: OpenAI, status: int
) -> None:
    first_turn(client)
    router.heartbeat_status = status
    with session.tool_call("grep") as run:
        wait_for(lambda: heartbeat_threads() == [])  # stopped by itself after one 404
    assert len(router.requests_to("/heartbeat")) == 1 and run.heartbeat_failures == 0
    assert [e.kind for e in session.events] == [EventKind.LEASE_NOT_FOUND]
    with session.tool_call("grep"):
        assert heartbeat_threads() == []  # no lease: no more heartbeats
    assert len(router.requests_to("/heartbeat")) == 1


def test_kv_gone_is_recorded_and_stops_heartbeats(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    first_turn(client)
    router.conversations[session.conversation_id].state = "gone"
    with session.tool_call("grep"):
        wait_for(lambda: heartbeat_threads() == [])  # stopped by itself after the 410
    assert session.kv_gone and len(router.requests_to("/heartbeat")) == 1
    assert session.events[-1].kind is EventKind.KV_GONE
    first_turn(client)  # a new turn creates a new lease
    assert not session.kv_gone


@pytest.fixture
async def async_pair(
    router: FakeRouter, asession: AsyncSession, aclient: AsyncOpenAI
) -> tuple[AsyncSession, AsyncOpenAI]:
    await aclient.chat.completions.create(model="fake", messages=MESSAGES)  # type: ignore[arg-type]
    return asession, aclient


def other_tasks() -> set[asyncio.Task[Any]]:
    return asyncio.all_tasks() - {asyncio.current_task()}  # type: ignore[operator]


async def test_async_tool_heartbeats_from_a_task(
    router: FakeRouter, async_pair: tuple[AsyncSession, AsyncOpenAI]
) -> None:
    session, _ = async_pair

    @session.tool
    async def fetch(url: str) -> int:
        await await_for(beats_at_least(router, 2))
        return 200

    assert await fetch("https://example.com") == 200
    assert heartbeat_threads() == []  # beats came from a task, not a thread
    assert not [t for t in other_tasks() if t.get_name().startswith("kvtether")]
    assert session.tool_runs[0].key == "fetch:https://example.com"


async def test_cancelled_async_tool_stops_its_heartbeat_task(
    router: FakeRouter, async_pair: tuple[AsyncSession, AsyncOpenAI]
) -> None:
    session, _ = async_pair

    @session.tool
    async def long_job() -> None:
        await asyncio.sleep(30)

    task = asyncio.create_task(long_job())
    await await_for(lambda: session.tool_runs and session.tool_runs[0].heartbeats >= 1)
    assert [t for t in other_tasks() if t.get_name().startswith("kvtether")]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not [t for t in other_tasks() if t.get_name().startswith("kvtether")]
    (run,) = session.tool_runs
    assert run.error == "CancelledError" and run.heartbeats >= 1


async def test_async_generator_tool_and_async_step(
    router: FakeRouter, async_pair: tuple[AsyncSession, AsyncOpenAI]
) -> None:
    session, client = async_pair

    @session.tool
    async def search(query: str) -> AsyncIterator[str]:
        for i in range(3):
            await asyncio.sleep(0.02)
            yield f"{query} hit {i}"

    @session.step
    async def step() -> list[str]:
        await client.chat.completions.create(model="fake", messages=MESSAGES)  # type: ignore
        return [hit async for hit in search("cache")]

    assert await step() == ["cache hit 0", "cache hit 1", "cache hit 2"]
    assert [t.step for t in session.turns] == [None, 1]
    assert session.tool_runs[0].duration_s >= 0.06 and session.tool_runs[0].ok


async def test_sync_tool_in_async_session_uses_a_thread(
    router: FakeRouter, async_pair: tuple[AsyncSession, AsyncOpenAI]
) -> None:
    session, _ = async_pair

    @session.tool
    def blocking() -> str:
        # Blocks the event loop: only a thread can keep beating meanwhile.
        wait_for(beats_at_least(router, 2))
        return "done"

    assert blocking() == "done"
    assert heartbeat_threads() == []


async def test_async_with_tool_call_on_a_sync_session(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    first_turn(client)
    async with session.tool_call("sleep"):
        await await_for(beats_at_least(router, 2))
    assert heartbeat_threads() == []


def test_generator_tool_closed_early_is_not_a_failure(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    @session.tool
    def numbers() -> Iterator[int]:
        yield from range(100)

    first_turn(client)
    gen = numbers()
    assert next(gen) == 0
    gen.close()
    (run,) = session.tool_runs
    assert run.ok and heartbeat_threads() == []
