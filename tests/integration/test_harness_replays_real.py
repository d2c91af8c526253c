"""What Claude Code, Codex and OpenCode really send through a tool loop, two parallel subagents
and a resume (tests/fixtures/harnesses, recorded by scripts/record-harness-traffic.py against a
scripted stand-in model, since CPU models rarely call tools), replayed on the real `cpu-agents`
stack with each earlier answer replaced by what the stack answered (tests/support/
harness_replay.py): every request is answered, every turn after each agent's first fires with
the whole previous sequence reused, and every answer equals the colocated reference's.

The harnesses set no temperature (the server's default decides: greedy for the `agents`
model, by its generation config), so the replay sends ``temperature: 0`` on every request, to
the stack and to the reference alike. That each replayed prompt extends the previous one and
its answer token for token, as vLLM renders them, is checked without vLLM running in
tests/test_harness_recordings.py.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import httpx
import pytest

from tests.support.harness_replay import ReplayedTurn, fixture_paths, load_fixture, replay_sync

pytestmark = pytest.mark.vllm


def _release(base_url: str, conversations: set[str]) -> None:
    for cid in conversations:
        httpx.delete(f"{base_url}/v1/sessions/{cid}", timeout=60)


@pytest.mark.parametrize("path", fixture_paths(), ids=lambda p: p.stem)
def test_a_recorded_harness_session_replays_on_the_stack(agents_stack, agents_reference,
                                                          path: Path) -> None:
    fixture = load_fixture(path)
    turns: list[ReplayedTurn] = []
    try:
        turns = replay_sync(fixture, agents_stack.base_url, agents_reference.base_url,
                            model=agents_stack.model, temperature=0.0)
        for t in turns:
            assert (t.status, t.error) == (200, None), (fixture.name, t.index, t.agent, t.error)
            assert (t.reference_status, t.reference_error) == (200, None), (t.index, t)
        by_agent: dict[str, list[ReplayedTurn]] = {}
        for t in turns:
            by_agent.setdefault(t.agent, []).append(t)
        for agent, agent_turns in by_agent.items():
            for prev, t in itertools.pairwise(agent_turns):
                where = (fixture.name, agent, t.index)
                assert prev.index in t.substituted, where  # the stack's answer in its history
                assert t.reuse == "fired", (*where, t.reuse, t.reused_tokens, t.reusable_tokens)
                # The prefix check found the prompt extending what decode held: all of the
                # previous prompt and of what it generated (less its last token).
                assert t.salvaged_tokens is None, (*where, t.salvaged_tokens)
                assert prev.prompt_tokens is not None and prev.output_tokens is not None, where
                assert t.reusable_tokens is not None and t.reused_tokens is not None, where
                assert t.reusable_tokens >= prev.prompt_tokens + prev.output_tokens - 1, (
                    *where, t.reusable_tokens, prev.prompt_tokens, prev.output_tokens)
                assert t.reused_tokens > 0, where
        # Greedy (temperature 0): token for token what a colocated vLLM answers, also on the
        # chat turns decode computed itself from the router's token ids (cpu-agents' local
        # prefill; Messages and Responses turns always go through prefill, which the router
        # cannot tokenize for).
        diverged = [(t.index, t.agent, t.text, t.reference_text) for t in turns
                    if t.text != t.reference_text]
        assert not diverged, (fixture.name, diverged)
    finally:
        _release(agents_stack.base_url, {t.conversation_id for t in turns if t.conversation_id})


LONG_TOOL_LEASE_TTL_S = 4.0
LONG_TOOL_S = 16.0  # each tool runs 4x the router's lease_ttl_s


@pytest.mark.parametrize("harness", ["claude", "codex", "opencode"])
def test_tools_that_outlast_the_lease_keep_the_kv_without_heartbeats(agents_stack, harness):
    """A harness's tool loop whose tools each run 4x `lease_ttl_s`, and nothing sent while
    they run: the router sized each lease from the answer's tool calls (held as for a person
    until it has seen one run, then from what the tool took), so every later turn fires."""
    from tests.support.stacks import serve_router

    fixture = load_fixture(next(p for p in fixture_paths()
                                if p.stem == f"{harness}-tool-loop"))
    turns: list[ReplayedTurn] = []
    with serve_router(agents_stack, lease_ttl_s=LONG_TOOL_LEASE_TTL_S) as url:
        try:
            turns = replay_sync(fixture, url, model=agents_stack.model,
                                tool_gap_s=LONG_TOOL_S)
            assert all(t.status == 200 for t in turns), [(t.index, t.error) for t in turns]
            main = [t for t in turns if t.agent == "main"]
            assert len(main) >= 3
            assert [t.reuse for t in main[1:]] == ["fired"] * (len(main) - 1), main
            status = httpx.get(f"{url}/v1/sessions/{main[-1].conversation_id}",
                               timeout=60).json()
            assert status["lease_basis"] in ("tool_calls", "person"), status
        finally:
            _release(url, {t.conversation_id for t in turns if t.conversation_id})
