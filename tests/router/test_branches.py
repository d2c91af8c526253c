"""Several live sequences in one conversation (fake instances, the in-memory and Redis stores):
parallel turns of one id run at once on sibling branches, each turn goes to the branch it
extends, a sequence that diverges early keeps the old branch's KV, and the session API covers
every branch. On real vLLM: tests/integration/test_apis_real.py."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest

from kvtether import protocol as p
from tests.support.redis_server import RedisServer, redis_port
from tests.support.router_harness import Harness, make_router

SUPERVISOR = "You are the supervisor. Split the work and merge the results. " * 3
WORKER = "You are worker {n}. Do exactly the task you are given and report back. " * 3


@asynccontextmanager
async def router(store: str, redis_url: str | None, **settings) -> AsyncIterator[Harness]:
    if store == "redis":
        settings.update(store=redis_url, store_key_prefix=f"b{uuid.uuid4().hex[:8]}:")
    async with make_router(control=True, fake={"delay_s": 0.05}, **settings) as h:
        yield h


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer.running(redis_port(7), tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> tuple[str, str | None]:
    if request.param == "memory":
        return "memory", None
    return "redis", request.getfixturevalue("redis_server").url


async def test_parallel_subagents_under_one_id_each_keep_their_branch(store) -> None:
    async with router(*store) as h:
        agents = [h.conversation("thread", system=WORKER.format(n=i)) for i in range(3)]
        for round_ in range(3):
            turns = await asyncio.gather(*(a.say(f"round {round_} task {i} " * 3)
                                           for i, a in enumerate(agents)))
            assert all(t.status == 200 for t in turns)  # never 409: they run side by side
            if round_ == 0:
                assert {t.outcome for t in turns} <= {"miss:first_turn", "miss:prefix_break"}
            else:
                # Each turn found the branch its own sequence is on.
                assert [t.outcome for t in turns] == ["fired"] * 3
        assert h.d.max_inflight >= 2
        status = (await h.client.get("/v1/sessions/thread")).json()
        branches = [status] + status["branches"]
        assert len(branches) == 3 and all(b["turn_count"] == 3 for b in branches)
        assert sum(b["retained_tokens"] > 0 for b in branches) == 3
        h.assert_kv_correct()
        # DELETE releases every branch.
        r = await h.client.delete("/v1/sessions/thread")
        assert r.status_code == 200 and r.json()["retained_tokens_freed"] > 0
        status = (await h.client.get("/v1/sessions/thread")).json()
        assert all(b["retained_tokens"] == 0 for b in [status] + status["branches"])


async def test_an_early_divergence_opens_a_branch_and_keeps_the_old_kv(store) -> None:
    async with router(*store) as h:
        main = h.conversation("retry", system=SUPERVISOR)
        for i in range(2):
            assert (await main.say(f"step {i} " * 5)).status == 200
        # A different system prompt under the same id (a subagent, a harness's side request):
        # it shares nothing with the main sequence, so its branch starts afresh.
        other = h.conversation("retry", system=WORKER.format(n=9))
        t = await other.say("a side task")
        assert t.outcome == "miss:first_turn" and t.reused == 0
        # The main sequence was not consumed: its next turn still reads all of it.
        t = await main.say("step 2")
        assert t.outcome == "fired"
        t = await other.say("more of the side task")
        assert t.outcome == "fired"
        h.assert_kv_correct()


async def test_a_retry_near_the_end_stays_on_its_branch_and_salvages(store) -> None:
    async with router(*store) as h:
        a = h.conversation("near", system=SUPERVISOR)
        for i in range(2):
            await a.say(f"turn {i}: " + " ".join(f"w{j}" for j in range(30)))
        a.messages[-1]["content"] = "(elided)"  # the client rewrites its last answer
        t = await a.say("next")
        assert t.outcome == "fired" and int(t.headers[p.HEADER_SALVAGED_TOKENS]) > 0
        status = (await h.client.get("/v1/sessions/near")).json()
        assert status["branches"] == [] and status["turn_count"] == 3


async def test_when_every_branch_is_busy_a_turn_waits_its_turn() -> None:
    async with make_router(control=True, fake={"delay_s": 0.2}, max_branches=2) as h:
        agents = [h.conversation("two", system=WORKER.format(n=i)) for i in range(3)]
        turns = await asyncio.gather(*(a.say("go " * 4) for a in agents))
        assert all(t.status == 200 for t in turns)
        assert h.d.max_inflight == 2
        status = (await h.client.get("/v1/sessions/two")).json()
        assert len(status["branches"]) == 1
        assert status["turn_count"] + status["branches"][0]["turn_count"] == 3


async def test_heartbeat_renews_every_branch() -> None:
    async with make_router(control=True) as h:
        agents = [h.conversation("hb", system=WORKER.format(n=i)) for i in range(2)]
        for a in agents:
            await a.say("go " * 4)
        r = await h.client.post("/v1/sessions/hb/heartbeat", json={"lease_extension_s": 300})
        assert r.status_code == 200
        assert len({key for key, _ in h.d.renewals}) == 2  # both branches' leases


async def test_a_side_request_first_stays_on_its_own_branch(store) -> None:
    # OpenCode's first request in a session is a title request (its own system prompt, no
    # tools) under the agent's session id; the agent's turns follow.
    async with router(*store) as h:
        title = h.conversation("oc-1", system="Generate a short title for this conversation.")
        assert (await title.say("fix the failing test")).outcome == "miss:first_turn"
        agent = h.conversation("oc-1", system=SUPERVISOR)
        outcomes = [(await agent.say(f"step {i} " * 8)).outcome for i in range(3)]
        assert outcomes == ["miss:first_turn", "fired", "fired"]
        status = (await h.client.get("/v1/sessions/oc-1")).json()
        assert [t["outcome"] for t in status["turns"]] == ["miss:first_turn"]
        (branch,) = status["branches"]
        assert [t["outcome"] for t in branch["turns"]] == outcomes
        assert status["main_branch"] == branch["conversation_id"]
        h.assert_kv_correct()


async def test_a_compacted_history_supersedes_the_old_sequence(store) -> None:
    # A harness compacting its context: the same system prompt, then a summary in place of
    # the turns it replaces, under the same id. The old sequence's KV is freed at once (no
    # heartbeat keeps it), and the conversation holds one sequence again.
    async with router(*store) as h:
        agent = h.conversation("compact", system=SUPERVISOR * 2)
        for i in range(6):
            await agent.say(f"step {i}: " + " ".join(f"w{j}" for j in range(40)))
        before = (await h.client.get("/v1/sessions/compact")).json()
        agent.messages[1:] = [{"role": "user", "content": "summary of the work so far"}]
        t = await agent.say("continue from the summary")
        assert t.outcome == "miss:prefix_break" and t.status == 200
        for _ in range(50):  # the release runs beside the turn
            status = (await h.client.get("/v1/sessions/compact")).json()
            if status["lease_state"] == "released":
                break
            await asyncio.sleep(0.05)
        assert status["lease_state"] == "released" and status["retained_tokens"] == 0
        (branch,) = status["branches"]
        assert 0 < branch["retained_tokens"] < before["retained_tokens"]
        assert (await agent.say("next step")).outcome == "fired"
        h.assert_kv_correct()
