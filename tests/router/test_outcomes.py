"""Per-turn reuse outcomes: fired when the turn reused all it could, a miss when KV was lost.

``reusable`` is the common prefix of the prompt and what the previous finished turn built;
``reused`` what P did not compute; eligible turns (reusable >= the threshold) fire when less
than max(threshold, block) of the reusable tokens were recomputed.
"""

from __future__ import annotations

from kvtether import protocol as p
from kvtether.protocol import _kv_params as kv_keys
from tests.support.fake_vllm import BLOCK_SIZE
from tests.support.router_harness import Harness, Turn, make_router

THRESHOLD = 16


def reusable(t: Turn) -> int:
    return int(t.headers[p.HEADER_REUSABLE_TOKENS])


async def test_below_threshold_remainder_after_a_local_hit_fired() -> None:
    """P's own prefix cache covers all but a few tokens of what D holds: P skips the pull
    (below kv_recompute_threshold) and recomputes those few; nothing reusable was lost."""
    async with make_router(fake={"kvtether_connector": True}) as h:
        a = h.conversation("local")
        t1 = await a.say("one")
        held = h.d.responses[-1]["kv_transfer_params"]["remote_num_tokens"]
        h.p.local_hit_tokens = lambda prompt: held - 10
        t2 = await a.say("two")
        assert h.p.responses[-1]["kv_transfer_params"][kv_keys.KV_PARAM_PULL] == "below_threshold"
        assert t2.outcome == "fired"
        assert t2.reused == held - 10
        # Everything turn 1 built (its prompt and answer) is repeated by turn 2's prompt; all
        # of it had KV but the answer's last token, which no engine computed.
        assert reusable(t2) == t1.usage["prompt_tokens"] + t1.usage["completion_tokens"] - 1
        assert 0 < reusable(t2) - t2.reused < THRESHOLD
        h.assert_kv_correct()


async def test_everything_from_prefill_cache_fired_even_without_a_handle(hc: Harness) -> None:
    """The KV on D is gone (released), but P's prefix cache still holds all of it."""
    a = hc.conversation("gone-but-cached")
    await a.say("one")
    assert (await hc.client.delete("/v1/sessions/gone-but-cached")).status_code == 200
    hc.p.local_hit_tokens = lambda prompt: len(prompt) - 1
    t = await a.say("two")
    assert hc.p.prefill_handles[-1] is None
    assert t.outcome == "fired" and t.reused >= reusable(t) > THRESHOLD


async def test_released_kv_is_an_eligible_miss_that_says_why(hc: Harness) -> None:
    a = hc.conversation("rel")
    await a.say("one")
    await hc.client.delete("/v1/sessions/rel")
    t = await a.say("two")
    assert t.outcome == "miss:released"
    assert reusable(t) > THRESHOLD and t.reused == 0


async def test_the_last_sequence_is_remembered_after_every_kind_of_loss() -> None:
    """Evicted, expired, not retained: the next turn still knows what it could have reused."""
    async with make_router(control=True, max_retained_tokens=10) as h:  # evicts every turn
        a = h.conversation("evict")
        t1 = await a.say("one")
        t2 = await a.say("two")
        assert t2.outcome == "miss:evicted"
        assert reusable(t2) == t1.usage["prompt_tokens"] + t1.usage["completion_tokens"] - 1
        status = (await h.client.get("/v1/sessions/evict")).json()
        assert [t["reusable_tokens"] for t in status["turns"]] == [0, reusable(t2)]
        assert [t["outcome"] for t in status["turns"]] == ["miss:first_turn", "miss:evicted"]


async def test_a_short_conversation_is_not_eligible() -> None:
    async with make_router(kv_recompute_threshold_tokens=10_000) as h:
        a = h.conversation("short", system="short")
        await a.say("hi")
        t = await a.say("again")
        assert t.outcome == "miss:below_threshold"
        assert 0 < reusable(t) < 10_000
        assert await h.metric("kvtether_reuse_eligible_total") == 0


async def test_an_early_prefix_break_is_not_eligible() -> None:
    # One sequence per conversation: the rewritten history replaces the old one.
    async with make_router(max_branches=1) as h:
        a = h.conversation("early")
        await a.say("one " * 40)
        a.messages[0]["content"] = "A different system prompt from the very first token."
        t = await a.say("two")
        assert t.outcome == "miss:prefix_break"
        assert reusable(t) < THRESHOLD
        assert t.headers[p.HEADER_SALVAGED_TOKENS] == "0"


async def test_a_prompt_that_shares_nothing_is_a_first_turn(h: Harness) -> None:
    # Under the same id, a prompt that shares less than one block with every sequence of the
    # conversation (a harness's side request, a history rewritten from its first token) starts
    # a sequence of its own: nothing in the conversation was reusable.
    a = h.conversation("nothing")
    await a.say("one " * 40)
    a.messages[0]["content"] = "A different system prompt from the very first token."
    t = await a.say("two")
    assert t.outcome == "miss:first_turn" and t.reused == 0


async def test_a_salvaged_prefix_break_fired_and_says_what_it_salvaged(h: Harness) -> None:
    a = h.conversation("salvage")
    for i in range(2):
        await a.say(f"turn {i}: " + " ".join(f"word{j}" for j in range(30)))
    # The client rewrites the last answer (e.g. strips reasoning).
    a.messages[-1]["content"] = "(elided)"
    t = await a.say("next")
    salvaged = int(t.headers[p.HEADER_SALVAGED_TOKENS])
    assert salvaged > 0 and salvaged % BLOCK_SIZE == 0
    assert t.outcome == "fired" and t.reused == salvaged
    assert 0 <= reusable(t) - salvaged < BLOCK_SIZE
    h.assert_kv_correct()


async def test_a_failed_read_is_transfer_failed_and_counted(h: Harness) -> None:
    a = h.conversation("fail")
    await a.say("one")
    h.p.pull_failure = True
    t = await a.say("two")
    assert t.outcome == "miss:transfer_failed" and reusable(t) > t.reused == 0
    assert await h.metric("kvtether_reuse_eligible_total") == 1
    assert await h.metric("kvtether_reuse_fired_total") == 0
    assert await h.metric("kvtether_reusable_tokens_total") == reusable(t)


async def test_first_turn_and_no_conversation_id(h: Harness) -> None:
    t = await h.chat([{"role": "user", "content": "hello"}])
    assert t.outcome == "miss:no_conversation_id" and reusable(t) == 0
    t = await h.conversation("new").say("hello")
    assert t.outcome == "miss:first_turn" and reusable(t) == 0


def test_outcome_eligibility_follows_the_label() -> None:
    assert p.ReuseOutcome.hit(10, 12).eligible
    assert p.ReuseOutcome.miss(p.MissCause.RELEASED, 0, 100).eligible
    for cause in p.NOT_ELIGIBLE_CAUSES:
        assert not p.ReuseOutcome.miss(cause).eligible
    parsed = p.parse_reuse_header("fired", "10", "12")
    assert parsed == p.ReuseOutcome.hit(10, 12)


def _outcome(prompt: int, cached: int, previous: list[int] | None, *, handle: bool = True,
             cause: p.MissCause | None = None, decode_lost: bool = False,
             threshold: int = 16, block: int = 32) -> str:
    from kvtether.router.reuse import ReusePlan, reuse_outcome

    plan = ReusePlan({"h": 1} if handle else None, 0, cause)
    return reuse_outcome(
        plan, list(range(prompt)), cached, previous, conversation=True,
        decode_lost=decode_lost, block_size=block, recompute_threshold_tokens=threshold,
    ).label


def test_outcome_rules_at_their_boundaries() -> None:
    prev = list(range(101))  # reusable 100: the last token's KV was never computed
    # lost = reusable - reused against max(threshold, block) = 32
    assert _outcome(150, 69, prev) == "fired"  # lost 31
    assert _outcome(150, 68, prev) == "miss:transfer_failed"  # lost 32
    # A prefix cache of whole blocks after a turn that built 32k tokens (its last one without
    # KV): 32k - 1 held, (k - 1) blocks hit, 31 tokens lost.
    assert _outcome(150, 64, list(range(96))) == "fired"
    assert _outcome(150, 68, prev, handle=False, cause=p.MissCause.EVICTED) == "miss:evicted"
    assert _outcome(150, 0, prev, decode_lost=True) == "miss:decode_unavailable"
    assert _outcome(150, 0, prev, handle=False) == "miss:not_retained"
    # eligibility: reusable >= max(threshold, 1)
    assert _outcome(150, 0, list(range(16))) == "miss:below_threshold"  # reusable 15
    assert _outcome(150, 0, list(range(17)), handle=False) == "fired"  # lost 16 < a block
    assert _outcome(150, 0, list(range(17)), handle=False, block=16) == "miss:not_retained"
    assert _outcome(150, 0, list(range(15)) + [-1] * 50) == "miss:prefix_break"
    assert _outcome(150, 0, None) == "miss:first_turn"
    assert _outcome(150, 0, prev, threshold=0, block=1) == "miss:transfer_failed"
    assert _outcome(150, 0, [], threshold=0) == "miss:below_threshold"
