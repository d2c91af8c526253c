"""Rewritten histories: the router never lets P read KV that does not match its prompt."""

from __future__ import annotations

import copy

import pytest

from kvtether import protocol as p
from kvtether.protocol._prefix import matching_prefix_tokens
from kvtether.protocol import _kv_params as kv_keys
from tests.support.fake_vllm import BLOCK_SIZE, Retention, render_chat
from tests.support.router_harness import Agent, Harness, make_router


def last_retention(h: Harness) -> Retention:
    kvp = h.d.responses[-1]["kv_transfer_params"]
    return h.cluster.retentions[(kvp["remote_engine_id"], kvp["remote_request_id"])]


def reusable(t) -> int:  # noqa: ANN001
    return int(t.headers[p.HEADER_REUSABLE_TOKENS])


def expected_salvage(r: Retention, messages: list[dict]) -> int:
    held = r.seq[: r.num_tokens]
    return matching_prefix_tokens(held, render_chat(messages), BLOCK_SIZE)


async def three_turns(h: Harness, cid: str) -> Agent:
    a = h.conversation(cid)
    for i in range(3):
        t = await a.say(f"turn {i}: " + " ".join(f"detail{i}x{j}" for j in range(25)))
        assert t.status == 200
    return a


async def test_edited_system_prompt_forwards_nothing(h: Harness) -> None:
    a = await three_turns(h, "sys")
    handles_before = len(h.p.prefill_handles)
    a.messages[0]["content"] = "You are a SLOPPY agent. " + a.messages[0]["content"]
    t = await a.say("continue")
    # It shares less than a block with the sequence: a sequence of its own (a new branch).
    assert t.outcome == "miss:first_turn"
    assert t.reused == 0
    assert len(h.p.prefill_handles) == handles_before + 1
    assert h.p.prefill_handles[-1] is None  # no handle: nothing of D's KV matches
    # The conversation is tethered again from here on.
    t2 = await a.say("and on")
    assert t2.outcome == "fired"
    h.assert_kv_correct()


@pytest.mark.parametrize("control", [False, True])
async def test_dropped_message_forwards_truncated_handle(control: bool) -> None:
    async with make_router(control=control) as h:
        a = await three_turns(h, "drop")
        r = last_retention(h)
        handle = h.d.responses[-1]["kv_transfer_params"]
        # Drop the second user message and its answer (a client trimming its history).
        del a.messages[3:5]
        a.messages.append({"role": "user", "content": "continue"})
        salvage = expected_salvage(r, a.messages)
        assert salvage >= 2 * BLOCK_SIZE  # the system prompt and first exchange still match
        t = await h.chat(list(a.messages), "drop")
        assert t.status == 200
        # All the matching prefix was read: nothing reusable was lost, so reuse fired.
        assert t.outcome == "fired"
        assert int(t.headers[p.HEADER_SALVAGED_TOKENS]) == salvage
        assert t.reused == salvage
        assert 0 <= reusable(t) - salvage < BLOCK_SIZE
        fwd = h.p.prefill_handles[-1]
        k = salvage // BLOCK_SIZE
        assert fwd["remote_block_ids"] == [r.block_ids[:k]]
        assert fwd["remote_num_tokens"] == salvage
        assert fwd["remote_request_id"] == r.request_id
        # Everything else of D's handle is forwarded unchanged, except a deadline that the
        # renewal at hand-off may have moved later.
        moved = ("remote_block_ids", "remote_num_tokens", "remote_blocks_expiry_time")
        rest = {key: v for key, v in fwd.items() if key not in moved}
        orig = {key: v for key, v in handle.items() if key not in moved}
        assert rest == orig
        assert fwd["remote_blocks_expiry_time"] >= handle["remote_blocks_expiry_time"]
        h.assert_kv_correct()


async def test_rewritten_last_answer_salvages_whole_blocks(h: Harness) -> None:
    """A client that strips or edits the assistant's answer (e.g. reasoning) breaks the
    prefix inside the last turn; only the whole blocks before the edit may be read."""
    a = await three_turns(h, "edit")
    r = last_retention(h)
    a.messages[-1]["content"] = "(answer elided)"
    a.messages.append({"role": "user", "content": "next"})
    salvage = expected_salvage(r, a.messages)
    t = await h.chat(list(a.messages), "edit")
    assert t.outcome == "fired"  # the whole-block prefix before the edit was read
    assert int(t.headers[p.HEADER_SALVAGED_TOKENS]) == salvage > 0
    assert t.reused == salvage and 0 <= reusable(t) - salvage < BLOCK_SIZE
    assert salvage % BLOCK_SIZE == 0
    assert h.p.prefill_handles[-1]["remote_num_tokens"] == salvage
    h.assert_kv_correct()


async def test_retry_of_the_same_turn_reads_only_matching_blocks(h: Harness) -> None:
    """Sending turn N again (a client retry) must not read D's KV of turn N's answer."""
    a = await three_turns(h, "retry")
    r = last_retention(h)
    retry = a.messages[:-1]  # the same request as the last turn
    t = await h.chat(copy.deepcopy(retry), "retry")
    assert t.status == 200
    assert t.outcome == "fired"  # everything the retry repeats, but its last block
    salvage = expected_salvage(r, retry)
    assert int(t.headers[p.HEADER_SALVAGED_TOKENS]) == salvage
    assert h.p.prefill_handles[-1]["remote_num_tokens"] == salvage < len(render_chat(retry))
    h.assert_kv_correct()


async def test_short_prefix_below_threshold_not_forwarded() -> None:
    async with make_router(kv_recompute_threshold_tokens=10_000) as h:
        a = h.conversation("thr", system="short")
        await a.say("hi")
        t = await a.say("again")
        assert t.outcome == "miss:below_threshold"
        assert h.p.prefill_handles[-1] is None
        h.assert_kv_correct()


async def test_unforwarded_handle_is_released_when_replaced() -> None:
    """A retained handle the turn does not forward (prefix break with nothing salvaged,
    below threshold, lease near expiry) is released on D, and its accounting undone (with one
    sequence per conversation; branches keep it: tests/router/test_branches.py)."""
    async with make_router(control=True, max_branches=1) as hc:
        await _unforwarded_handle_is_released(hc)


async def _unforwarded_handle_is_released(hc: Harness) -> None:
    a = await three_turns(hc, "leak")
    old_key = hc.d.decode_params[-1][kv_keys.KV_PARAM_HANDLE_KEY]
    a.messages[0]["content"] = "Completely different system prompt."
    t = await a.say("continue")
    assert t.outcome == "miss:prefix_break"
    assert await hc.metric("kvtether_active_leases") == 1
    assert len(hc.d.held_leases()) == 1
    assert old_key in hc.d.releases


async def test_completions_with_a_messages_field_are_checked_by_their_prompt(h: Harness) -> None:
    # Found by tests/router/test_fuzz.py: /v1/completions reads `prompt`; tokenizing the body's
    # `messages` instead checked the wrong prompt against D's KV, and P read KV that differed.
    a = h.conversation("mixed")
    await a.say("turn 0: " + " ".join(f"detail{j}" for j in range(40)))
    t = await h.post("/v1/completions", {
        "model": "tiny", "messages": a.messages, "max_tokens": 2,
        "prompt": "a different prompt entirely " * 10}, conv="mixed")
    assert t.status == 200 and t.outcome != "fired"
    h.assert_kv_correct()
