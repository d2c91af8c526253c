"""Leases for clients that cannot heartbeat (coding-agent harnesses): sized from how each
answer the router relays ends, for every API, streamed and not (router.tool_leases).

The agents here talk as Claude Code (Messages), Codex (Responses) and OpenCode (chat) do: their
own session headers, no hints, no heartbeats; the fake engines answer with tool calls
(``call_tools``) running the command a test picks (``tool_arguments``).
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from kvtether import protocol as p
from kvtether.protocol import _kv_params as kv_keys
from kvtether.router import RouterSettings
from kvtether.router.answers import AnswerEnd
from kvtether.router.conversations import Conversation
from kvtether.router.tool_leases import TOOL_GAP_FACTOR, size_after_answer
from tests.support.router_harness import SYSTEM_PROMPT, Harness, Turn, make_router

from .clock import ManualClock

# (API, session header): what each harness sends.
HARNESSES = {
    "chat": ("/v1/chat/completions", "x-session-id"),  # OpenCode
    "responses": ("/v1/responses", "session_id"),  # Codex
    "messages": ("/v1/messages", "X-Claude-Code-Session-Id"),  # Claude Code
}
FAKE = {"kvtether_connector": True}  # prefill checks the prompts the router cannot tokenize
CASES = [pytest.param(api, stream, id=f"{api}-{'stream' if stream else 'json'}")
         for api in HARNESSES for stream in (False, True)]


class HarnessAgent:
    """A coding agent's conversation in its API's own shape: a tool the model calls runs, its
    result goes back with the history; no hints, no heartbeats."""

    def __init__(self, h: Harness, api: str, cid: str, *, stream: bool,
                 hints: dict[str, Any] | None = None) -> None:
        self.h, self.api, self.cid, self.stream, self.hints = h, api, cid, stream, hints
        self.history: list[dict[str, Any]] = []
        self.calls: list[str] = []  # ids of the last answer's tool calls

    async def send(self, text: str | None = None) -> Turn:
        """The next request: the person's ``text``, or else the last tool calls' results."""
        if text is not None:
            self.history.append({"role": "user", "content": text})
        else:
            self._results()
        path, header = HARNESSES[self.api]
        body = self._body()
        if self.stream:
            body["stream"] = True
        if self.hints is not None:
            body[p.BODY_HINTS] = self.hints
        turn = await self.h.post(path, body, headers={header: self.cid})
        assert turn.status == 200, turn.response.text[:500]
        self._answer(turn)
        return turn

    async def status(self) -> p.SessionStatus:
        r = await self.h.client.get(f"/v1/sessions/{self.cid}")
        return p.SessionStatus.model_validate(r.json())

    def _body(self) -> dict[str, Any]:
        if self.api == "chat":
            return {"model": "tiny", "max_tokens": 40,
                    "messages": [{"role": "system", "content": SYSTEM_PROMPT}, *self.history],
                    "tools": [{"type": "function", "function": {
                        "name": "bash", "parameters": {"type": "object"}}}]}
        if self.api == "responses":
            return {"model": "tiny", "max_output_tokens": 40, "instructions": SYSTEM_PROMPT,
                    "input": self.history, "store": False,
                    "tools": [{"type": "function", "name": "shell", "parameters": {}}]}
        return {"model": "tiny", "max_tokens": 40, "system": SYSTEM_PROMPT,
                "messages": self.history,
                "tools": [{"name": "Bash", "input_schema": {"type": "object"}}]}

    def _answer(self, turn: Turn) -> None:
        if self.api == "chat":
            message = turn.assistant_message()
            self.history.append(message)
            self.calls = [c["id"] for c in message.get("tool_calls") or []]
        elif self.api == "responses":
            events = turn.chunks or []
            output = (turn.body["output"] if turn.body is not None else next(
                e["response"]["output"] for e in events if e["type"] == "response.completed"))
            self.history += output
            self.calls = [i["call_id"] for i in output if i["type"] == "function_call"]
        else:
            content = turn.body["content"] if turn.body is not None else _blocks(turn.chunks)
            self.history.append({"role": "assistant", "content": content})
            self.calls = [b["id"] for b in content if b["type"] == "tool_use"]

    def _results(self) -> None:
        assert self.calls, "no tool call to answer"
        if self.api == "chat":
            self.history += [{"role": "tool", "tool_call_id": c, "content": "3 passed"}
                             for c in self.calls]
        elif self.api == "responses":
            self.history += [{"type": "function_call_output", "call_id": c,
                              "output": "3 passed"} for c in self.calls]
        else:
            self.history.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": c, "content": "3 passed"}
                for c in self.calls]})


def _blocks(events: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """A streamed Messages answer's content blocks."""
    blocks: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    for e in events or []:
        if e["type"] == "content_block_start":
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            d = e["delta"]
            if d["type"] == "text_delta":
                blocks[e["index"]]["text"] += d["text"]
            elif d["type"] == "input_json_delta":
                partial[e["index"]] = partial.get(e["index"], "") + d["partial_json"]
    for i, text in partial.items():
        blocks[i]["input"] = json.loads(text)
    return blocks


def runs(h: Harness, command: str | None) -> None:
    """The model's next answers call the shell with ``command`` (None: they answer the
    person)."""
    for inst in (*h.prefill, *h.decode):
        inst.call_tools = command is not None
        inst.tool_arguments = {"command": command} if command else None


async def lease_s(agent: HarnessAgent, now_unix_s: float) -> float:
    s = await agent.status()
    assert s.lease_state == "active" and s.lease_deadline_unix_s is not None
    return s.lease_deadline_unix_s - now_unix_s


# --------------------------------------------------------------------------- a person's turn
@pytest.mark.parametrize("api", ["completions", *HARNESSES])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_an_answer_handed_to_a_person_is_held_as_long_as_vllm_would(
        api: str, stream: bool) -> None:
    async with make_router(control=True, fake=FAKE) as h:
        s = h.settings
        if api == "completions":  # never tool calls
            t = await h.completion(SYSTEM_PROMPT, "person", stream=stream, max_tokens=20)
            assert t.status == 200
            status = p.SessionStatus.model_validate(
                (await h.client.get("/v1/sessions/person")).json())
            remaining = status.lease_deadline_unix_s - time.time()
        else:
            agent = HarnessAgent(h, api, "person", stream=stream)
            await agent.send("what does this repository do?")
            status = await agent.status()
            remaining = await lease_s(agent, time.time())
        assert status.lease_basis == "person"
        assert s.decoder_kv_blocks_ttl_s - 5 < remaining <= s.decoder_kv_blocks_ttl_s
        assert h.d.decode_params[-1][kv_keys.KV_PARAM_LEASE_TTL_S] == s.decoder_kv_blocks_ttl_s
        assert h.d.renewals == []  # decode was told so with the turn: no extra call


# --------------------------------------------------------------------------- tool calls
@pytest.mark.parametrize(("api", "stream"), CASES)
async def test_tool_calls_get_a_lease_from_what_the_conversations_tools_took(
        api: str, stream: bool) -> None:
    clock = ManualClock()
    async with make_router(control=True, fake=FAKE, clock=clock) as h:
        s = h.settings
        agent = HarnessAgent(h, api, f"tools-{api}", stream=stream)
        runs(h, "pytest -x")
        await agent.send("fix the failing test")
        status = await agent.status()
        # Nothing learned yet: held as for a person's reply (a first run may take minutes).
        assert status.lease_basis == "tool_calls"
        assert await lease_s(agent, clock.t) == pytest.approx(s.decoder_kv_blocks_ttl_s)
        clock.advance(40.0)  # the tests ran for 40 s
        t = await agent.send()
        assert t.outcome == "fired"
        # Its tests took 40 s: the next pytest is held for ~2x that, more than lease_ttl_s.
        longer = await lease_s(agent, clock.t)
        assert s.lease_ttl_s < longer <= 2 * 40.0 + s.lease_safety_margin_s
        clock.advance(40.0)
        assert (await agent.send()).outcome == "fired"
        assert await lease_s(agent, clock.t) > longer  # more sure of it now
        # Another command of the same tool leans on what the tool took.
        runs(h, "ls")
        clock.advance(40.0)
        await agent.send()
        assert s.lease_ttl_s < await lease_s(agent, clock.t)
        h.assert_kv_correct()


@pytest.mark.parametrize(("api", "stream"), CASES)
async def test_a_harness_loop_whose_tools_outlast_the_default_lease_keeps_its_kv(
        api: str, stream: bool) -> None:
    """A replayed coding-agent loop: every tool run takes 150 s (2.5x lease_ttl_s), then the
    person reads the result for 5 minutes. With no heartbeat, every turn after the first fires
    (without leases sized from the answer, every one would be lease_expired)."""
    clock = ManualClock()
    async with make_router(control=True, fake=FAKE, clock=clock) as h:
        retention = h.app.state.retention
        agent = HarnessAgent(h, api, f"loop-{api}", stream=stream)
        runs(h, "pytest -x")
        outcomes = [(await agent.send("make the test suite pass")).outcome]
        for _ in range(6):
            clock.advance(150.0)
            await retention.reap_expired()  # what the router's housekeeping does every second
            outcomes.append((await agent.send()).outcome)
        runs(h, None)  # the agent reports back
        clock.advance(150.0)
        await retention.reap_expired()
        outcomes.append((await agent.send()).outcome)
        assert outcomes == ["miss:first_turn"] + ["fired"] * 7
        # The person takes 5 minutes to answer: the KV is still there.
        assert (await agent.status()).lease_basis == "person"
        clock.advance(300.0)
        await retention.reap_expired()
        assert (await agent.send("thanks, now commit it")).outcome == "fired"
        h.assert_kv_correct()


def test_parallel_tool_calls_are_held_for_the_longest() -> None:
    s = RouterSettings()
    conv = Conversation("parallel")
    for _ in range(3):
        conv.tool_gaps.observe(["Bash:pytest"], 100.0)
        conv.tool_gaps.observe(["Read"], 0.5)
    record = p.TurnRecord(turn=4, outcome="fired", started_unix_s=1000.0)
    alone = size_after_answer(s, conv, AnswerEnd(("Read",)), record, 1001.0)
    both = size_after_answer(s, conv, AnswerEnd(("Read", "Bash:pytest", "Grep")), record, 1001.0)
    assert alone.lease_s == s.lease_ttl_s
    assert both.basis == "tool_calls"
    assert both.lease_s == pytest.approx(
        TOOL_GAP_FACTOR * conv.tool_gaps.estimate_s("Bash:pytest") + s.lease_safety_margin_s)
    assert conv.awaiting_tools is not None
    assert conv.awaiting_tools.keys == ("Read", "Bash:pytest", "Grep")
    assert conv.phase == p.Phase.TOOL_RUNNING
    person = size_after_answer(s, conv, AnswerEnd(), record, 1001.0)
    assert (person.basis, person.lease_s) == ("person", s.decoder_kv_blocks_ttl_s)
    assert conv.awaiting_tools is None and conv.phase == p.Phase.IDLE


async def test_each_command_of_a_tool_is_learned_on_its_own() -> None:
    clock = ManualClock()
    async with make_router(control=True, fake=FAKE, clock=clock) as h:
        agent = HarnessAgent(h, "messages", "commands", stream=False)
        runs(h, "pytest")
        await agent.send("run the tests")
        clock.advance(200.0)
        runs(h, "ls")
        await agent.send()  # pytest took 200 s
        clock.advance(1.0)
        await agent.send()  # ls took 1 s
        held = await h.app.state.store.lock("commands", "", wait_s=1)
        try:
            gaps = held.conv.tool_gaps
            assert gaps.estimate_s("Bash:pytest") > 20 * gaps.estimate_s("Bash:ls")
        finally:
            await held.commit()


async def test_max_lease_s_bounds_it_and_decode_holds_what_the_router_promised() -> None:
    async with make_router(control=True, fake=FAKE, max_lease_s=400.0,
                           decoder_kv_blocks_ttl_s=100.0, lease_ttl_s=30.0) as h:
        agent = HarnessAgent(h, "chat", "bounded", stream=False)
        runs(h, "make release")
        await agent.send("cut a release")
        # The conversation has shown its releases take hours.
        held = await h.app.state.store.lock("bounded", "", wait_s=1)
        for _ in range(10):
            held.conv.tool_gaps.observe(["bash:make release"], 5 * 3600.0)
        held.conv.awaiting_tools = None  # (this release's own, short, gap is not learned)
        await held.commit()
        before = time.time()
        await agent.send()
        status = await agent.status()
        assert status.lease_basis == "tool_calls"
        # Decode was told 100 s with the turn (a person's lease here), then renewed to 400 s.
        assert h.d.decode_params[-1][kv_keys.KV_PARAM_LEASE_TTL_S] == 100.0
        assert h.d.renewals[-1] == (h.d.decode_params[-1][kv_keys.KV_PARAM_HANDLE_KEY], 400.0)
        (lease,) = h.d.held_leases()
        assert lease.lease_info().deadline_unix_s == pytest.approx(
            status.lease_deadline_unix_s, abs=0.5)
        assert before + 395 < status.lease_deadline_unix_s <= time.time() + 400.0
        # Decode's control channel does not answer: the router promises what decode was told.
        h.d.control_down = True
        before = time.time()
        await agent.send()
        status = await agent.status()
        assert status.lease_basis == "tool_calls"
        assert before + 95 < status.lease_deadline_unix_s <= time.time() + 100.0


# --------------------------------------------------------------------------- hinted clients
@pytest.mark.parametrize(("api", "stream"), CASES)
async def test_a_hinted_turn_keeps_its_lease_whatever_the_answer(api: str, stream: bool) -> None:
    """A kvtether client says when its next turn comes (and heartbeats while it waits): its
    leases are sized from its hints as they always were, tool calls or not."""
    clock = ManualClock()
    async with make_router(control=True, fake=FAKE, clock=clock) as h:
        s = h.settings
        agent = HarnessAgent(h, api, f"hinted-{api}", stream=stream, hints={})
        runs(h, "pytest -x")
        await agent.send("fix the failing test")
        clock.advance(200.0)
        await agent.send()  # 200 s after a tool call: nothing learned from it
        status = await agent.status()
        assert status.lease_basis == "default"
        assert await lease_s(agent, clock.t) == pytest.approx(s.lease_ttl_s)
        assert h.d.decode_params[-1][kv_keys.KV_PARAM_LEASE_TTL_S] == s.lease_ttl_s
        runs(h, None)
        agent.hints = {"next_turn_gap_s": 100}
        await agent.send()
        assert (await agent.status()).lease_basis == "hints"
        assert await lease_s(agent, clock.t) == pytest.approx(
            100 * 1.5 + s.lease_safety_margin_s)
        # Renewed only as ever: at hand-off, before a handle goes to prefill.
        assert {ttl for _, ttl in h.d.renewals} == {s.handoff_lease_s}
