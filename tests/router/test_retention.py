"""Retained KV (:mod:`kvtether.router.retention`): counted per instance and tenant, kept
under the budget, released when a conversation is dropped or its lease lapses."""

from __future__ import annotations

from kvtether.protocol import _kv_params as kv_keys
from kvtether.router._deps import RouterDeps
from kvtether.router.backends import BackendPool
from kvtether.router.conversations import InMemoryConversationStore
from kvtether.router.leases import LeaseClient
from kvtether.router.metrics import RouterMetrics
from kvtether.router.retention import Retention
from kvtether.router.settings import RouterSettings
from tests.router.clock import ManualClock
from tests.router.kv import NOW, conv, retained
from tests.support.router_harness import make_router


def test_take_and_restore_keep_the_counts_in_step() -> None:
    settings = RouterSettings(prefill_urls=["http://p0"], decode_urls=["http://d0"])
    deps = RouterDeps(settings, BackendPool(settings), InMemoryConversationStore(),
                      LeaseClient(), RouterMetrics(), ManualClock(NOW))
    retention = Retention(deps)
    decode = deps.pool.decode[0]
    c = conv()
    held = retained(100)
    retention.retain(c, decode, held.params, held.token_ids, "k", 60.0)
    assert decode.retained_tokens == 100 and retention.tenant_retained_tokens("") == 100
    assert c.retained is not None and c.retained.lease_deadline_unix_s == NOW + 60.0
    taken = retention.take(c)
    assert taken is not None and c.retained is None
    assert decode.retained_tokens == 0 and retention.tenant_retained_tokens("") == 0
    retention.restore(c, taken)
    assert c.retained is taken and decode.retained_tokens == 100
    assert retention.tenant_retained_tokens("") == 100


async def test_evicted_conversation_releases_its_kv() -> None:
    async with make_router(control=True, max_conversations=1) as h:
        a, b = h.conversation("old"), h.conversation("new")
        await a.say("one")
        old_key = h.d.decode_params[-1][kv_keys.KV_PARAM_HANDLE_KEY]
        await b.say("one")
        assert (await h.client.get("/v1/sessions/old")).status_code == 404
        assert old_key in h.d.releases
        assert await h.metric("kvtether_active_leases") == 1


async def test_budget_evicts_to_stay_under_cap() -> None:
    async with make_router(control=True) as h:
        a, b = h.conversation("a"), h.conversation("b")
        await a.say("one")
        held = h.d.held_leases()[0].num_tokens
        # Room for one conversation's KV only.
        h.app.state.runner.s.max_retained_tokens = held + 20
        await b.say("one")
        a_key = h.d.decode_params[0][kv_keys.KV_PARAM_HANDLE_KEY]
        assert h.d.releases == [a_key]
        assert [r.lease_key for r in h.d.held_leases()] == [
            h.d.decode_params[-1][kv_keys.KV_PARAM_HANDLE_KEY]]
        status = (await h.client.get("/v1/sessions/a")).json()
        assert status["lease_state"] == "evicted"
        hb = await h.client.post("/v1/sessions/a/heartbeat", json={})
        assert hb.status_code == 410 and hb.json()["error"]["code"] == "lease_evicted"
        t = await a.say("two")
        assert t.outcome == "miss:evicted"
        assert await h.metric("kvtether_lease_events_total", 'event="evicted"') >= 1
        h.assert_kv_correct()


async def test_budget_evicts_idle_sessions_first() -> None:
    async with make_router(control=True) as h:
        busy, idle, new = h.conversation("busy"), h.conversation("idle"), h.conversation("new")
        await busy.say("one", kvtether_hints={"phase": "tool_running"})
        await idle.say("one", kvtether_hints={"phase": "idle"})
        per_conv = max(r.num_tokens for r in h.d.held_leases())
        h.app.state.runner.s.max_retained_tokens = 2 * per_conv + 20
        await new.say("one")
        states = {cid: (await h.client.get(f"/v1/sessions/{cid}")).json()["lease_state"]
                  for cid in ("busy", "idle", "new")}
        assert states == {"busy": "active", "idle": "evicted", "new": "active"}


async def test_reaper_expires_idle_leases() -> None:
    clock = ManualClock()
    async with make_router(control=True, lease_ttl_s=30.0, clock=clock) as h:
        a = h.conversation("reap", hints={})  # a kvtether client: its lease is lease_ttl_s
        await a.say("first")
        await a.say("second")
        assert len(h.d.held_leases()) == 1
        await h.app.state.retention.reap_expired()
        assert h.d.releases == []  # not yet
        # What the lifespan's reaper task does every second, once the deadline has passed.
        clock.advance(31.0)
        await h.app.state.retention.reap_expired()
        status = (await h.client.get("/v1/sessions/reap")).json()
        assert status["lease_state"] == "expired"
        assert len(h.d.releases) == 1  # the router told D to free it
