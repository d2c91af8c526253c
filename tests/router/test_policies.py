"""The reuse policies (:mod:`kvtether.router.policies`): ``kvtether``, and the baselines
``upstream`` (vLLM 0.32's own proxy + NixlConnector) and ``off`` (one-way).

The baselines must do what vLLM ships and nothing more; their outcome headers are
observations with the same definitions as under ``kvtether``.
"""

from __future__ import annotations

import pytest

from kvtether import protocol as p
from kvtether.protocol import _kv_params as kv_keys
from kvtether.router._deps import RouterDeps
from kvtether.router.backends import BackendPool
from kvtether.router.conversations import InMemoryConversationStore
from kvtether.router.leases import LeaseClient
from kvtether.router.metrics import RouterMetrics
from kvtether.router.policies import Policy, make_policy
from kvtether.router.retention import Retention
from kvtether.router.settings import RouterSettings
from tests.router.clock import ManualClock
from tests.router.kv import BS, NOW, conv, retained
from tests.support.router_harness import make_router


def policy(name: str) -> Policy:
    settings = RouterSettings(prefill_urls=["http://p0"], decode_urls=["http://d0"],
                              reuse_policy=name, kv_block_size_tokens=BS,
                              kv_recompute_threshold_tokens=16)
    deps = RouterDeps(settings, BackendPool(settings), InMemoryConversationStore(),
                      LeaseClient(), RouterMetrics(), ManualClock(NOW))
    return make_policy(deps, Retention(deps))


# ---------------------------------------------------------------- the plan, per policy
def test_kvtether_reads_only_what_the_prompt_repeats() -> None:
    kv = policy("kvtether")
    assert (kv.affinity, kv.leases, kv.checks_prefix) == (True, True, True)
    c = conv(retained(100))
    whole = kv.plan(c, list(range(130)), checked_by_prefill=False, safety_margin_s=6.0)
    assert whole.cause is None and whole.expected_reused_tokens == 100
    cut = kv.plan(c, list(range(40)) + [-1] * 80, checked_by_prefill=False, safety_margin_s=6.0)
    assert cut.cause is p.MissCause.PREFIX_BREAK and cut.handle["remote_num_tokens"] == 32
    late = conv(retained(100, deadline_in_s=5.0))
    assert kv.plan(late, list(range(130)), checked_by_prefill=False,
                   safety_margin_s=6.0).cause is p.MissCause.LEASE_EXPIRED


def test_upstream_forwards_the_last_handle_whatever_the_prompt() -> None:
    up = policy("upstream")
    assert (up.affinity, up.leases, up.checks_prefix) == (False, False, False)
    c = conv(retained(100, deadline_in_s=1.0))
    c.retained.params["kvtether_block_hashes"] = ["h"]
    pl = up.plan(c, [-1] * 120, checked_by_prefill=False, safety_margin_s=6.0)
    assert pl.cause is None and pl.expected_reused_tokens == 100
    assert "kvtether_block_hashes" not in pl.handle  # what vLLM's decode returns, no more
    assert up.plan(conv(), None, checked_by_prefill=False,
                   safety_margin_s=6.0).cause is p.MissCause.FIRST_TURN


def test_off_reads_nothing_and_says_why() -> None:
    off = policy("off")
    assert (off.affinity, off.leases, off.checks_prefix) == (False, False, False)
    pl = off.plan(conv(retained(100)), list(range(130)), checked_by_prefill=False,
                  safety_margin_s=6.0)
    assert (pl.handle, pl.cause) == (None, p.MissCause.NOT_RETAINED)
    gone = conv(gone_cause=p.MissCause.EVICTED)
    assert off.plan(gone, None, checked_by_prefill=False,
                    safety_margin_s=6.0).cause is p.MissCause.EVICTED


# ---------------------------------------------------------------- through the router


def reusable(t) -> int:  # noqa: ANN001
    return int(t.headers[p.HEADER_REUSABLE_TOKENS])


async def test_upstream_round_robins_decode_and_forwards_the_handle_unchecked() -> None:
    async with make_router(n_decode=2, reuse_policy="upstream") as h:
        a = h.conversation("up")
        turns = [await a.say(f"turn {i}") for i in range(4)]
        assert [t.outcome for t in turns] == ["miss:first_turn"] + ["fired"] * 3
        # No affinity: the decode instance alternates turn by turn.
        names = [t.headers[p.HEADER_DECODE_INSTANCE] for t in turns]
        assert names[0] != names[1] and names[0] == names[2] and names[1] == names[3]
        # Each turn's P got exactly the handle the previous turn's D returned.
        returned = [d.responses for d in h.decode]
        handles = [r["kv_transfer_params"] for rs in returned for r in rs]
        for fwd in h.p.prefill_handles[1:]:
            assert fwd in handles
        assert h.p.prefill_handles[0] is None
        # No extra round trip: no /tokenize, no control channel, no kvtether keys for D.
        assert h.p.tokenize_calls == 0
        assert all(d.control_calls == [] for d in h.decode)
        for d in h.decode:
            assert all(kv_keys.KV_PARAM_HANDLE_KEY not in kvp for kvp in d.decode_params)
        h.assert_kv_correct()


async def test_upstream_reads_a_rewritten_history_whole_as_vllm_does() -> None:
    """No prefix check, no truncation: the baseline reads stale KV (what kvtether prevents)."""
    async with make_router(reuse_policy="upstream") as h:
        a = h.conversation("stale")
        await a.say("one " * 20)
        handle = h.d.responses[-1]["kv_transfer_params"]
        a.messages[-1]["content"] = "(edited answer)"
        await a.say("two")
        assert h.p.prefill_handles[-1]["remote_num_tokens"] == handle["remote_num_tokens"]
        assert h.p.prefill_handles[-1]["remote_block_ids"] == handle["remote_block_ids"]
        assert any("differs from its prompt" in v for v in h.cluster.violations)


async def test_upstream_has_no_handle_after_a_streamed_turn() -> None:
    async with make_router(control=True, reuse_policy="upstream") as h:
        a = h.conversation("stream")
        await a.say("one", stream=True)
        t = await a.say("two")
        assert h.p.prefill_handles[-1] is None
        assert t.outcome == "miss:not_retained" and reusable(t) > 0
        assert h.d.control_calls == []  # the handle was not fetched from the connector
        t3 = await a.say("three")  # the non-streamed turn 2 left one
        assert t3.outcome == "fired"


async def test_upstream_forwards_a_handle_near_expiry_and_p_declines_it() -> None:
    # vLLM's TTL is shorter than P's read margin: P refuses the read and recomputes.
    async with make_router(reuse_policy="upstream", fake={"decoder_kv_blocks_ttl_s": 3.0},
                           decoder_kv_blocks_ttl_s=3.0) as h:
        a = h.conversation("late")
        await a.say("one")
        t = await a.say("two")
        assert h.p.prefill_handles[-1] is not None
        assert t.status == 200 and t.outcome == "miss:transfer_failed" and t.reused == 0
        p_reads = [r for r in h.cluster.reads if r.reader == h.p.name]
        assert p_reads[-1].result == "refused_expiry"


@pytest.mark.parametrize("policy", ["upstream", "off"])
async def test_policies_without_leases_answer_409(policy: str) -> None:
    async with make_router(control=True, reuse_policy=policy) as h:
        await h.conversation("s").say("one")
        for r in (await h.client.post("/v1/sessions/s/heartbeat", json={}),
                  await h.client.delete("/v1/sessions/s")):
            assert r.status_code == 409
            err = r.json()["error"]
            assert err["code"] == "no_leases" and policy in err["message"]
        assert (await h.client.get("/v1/sessions/s")).status_code == 200


async def test_upstream_keeps_no_budget_and_reaps_nothing() -> None:
    async with make_router(reuse_policy="upstream", max_retained_tokens=1) as h:
        a = h.conversation("keep")
        await a.say("one")
        await h.app.state.retention.reap_expired(now_unix_s=1e12)
        assert h.app.state.store.get("keep").retained is not None
        assert (await a.say("two")).outcome == "fired"


async def test_off_never_forwards_a_handle() -> None:
    async with make_router(control=True, n_decode=2, reuse_policy="off") as h:
        a = h.conversation("off")
        turns = [await a.say(f"turn {i}") for i in range(3)]
        assert h.p.prefill_handles == [None, None, None]
        assert [t.outcome for t in turns] == ["miss:first_turn"] + ["miss:not_retained"] * 2
        assert all(reusable(t) > 0 and t.reused == 0 for t in turns[1:])
        assert all(kv_keys.KV_PARAM_HANDLE_KEY not in kvp for d in h.decode for kvp in d.decode_params)
        status = (await h.client.get("/v1/sessions/off")).json()
        assert status["retained_tokens"] == 0 and status["lease_state"] == "none"
        assert await h.metric("kvtether_active_leases") == 0


async def test_off_fires_when_prefill_cache_alone_covers_the_turn() -> None:
    """The outcome is an observation: P's own prefix cache can cover an off-policy turn."""
    async with make_router(reuse_policy="off") as h:
        a = h.conversation("cached")
        await a.say("one")
        h.p.local_hit_tokens = lambda prompt: len(prompt) - 1
        assert (await a.say("two")).outcome == "fired"


async def test_upstream_forwards_only_what_vllm_returns() -> None:
    """On a kvtether decode, the handle's kvtether fields (block hashes) stay behind: a
    kvtether prefill would check them, vLLM's does not."""
    async with make_router(reuse_policy="upstream", control=True) as h:
        a = h.conversation("bare")
        await a.say("one " * 20)
        await a.say("two")
        fwd = h.p.prefill_handles[-1]
        assert fwd is not None and fwd.get("remote_block_ids")
        assert not [k for k in fwd if k.startswith("kvtether_")]
