"""The app (:mod:`kvtether.router.app`): /health, /metrics, /v1/models, and its lifespan."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvtether import protocol as p
from kvtether.router import app as router_app
from kvtether.router.settings import RouterSettings
from tests.support.router_harness import Harness, make_router, metric_value


async def test_health_ok(h: Harness) -> None:
    r = await h.client.get("/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok"
    assert body["backends"] == {"prefill-0": True, "decode-0": True}
    assert body["protocol_version"] == p.PROTOCOL_VERSION


@pytest.mark.parametrize("how", ["down", "unhealthy"])
async def test_health_degraded_without_decode(h: Harness, how: str) -> None:
    setattr(h.d, how, True)
    r = await h.client.get("/health")
    assert r.status_code == 503
    assert r.json()["status"] == "degraded"
    assert r.json()["backends"]["decode-0"] is False
    setattr(h.d, how, False)
    assert (await h.client.get("/health")).status_code == 200


async def test_models_relayed_from_vllm(h: Harness) -> None:
    r = await h.client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["tiny"]
    assert body["data"][0]["max_model_len"] == h.p.max_model_len


async def test_models_503_when_no_prefill(h: Harness) -> None:
    h.p.down = True
    r = await h.client.get("/v1/models")
    assert r.status_code == 503
    assert r.json()["error"]["message"]


async def test_metrics_after_turns() -> None:
    async with make_router(control=True, n_decode=2) as h:
        a = h.conversation("m1")
        b = h.conversation("m2")
        turns = [await a.say("one"), await a.say("two"), await a.say("three"),
                 await b.say("one"), await h.chat([{"role": "user", "content": "anon"}])]
        await h.client.post("/v1/sessions/m1/heartbeat", json={})
        await h.client.delete("/v1/sessions/m2")
        r = await h.client.get("/metrics")
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain")
        text = r.text

        def m(name: str, labels: str = "") -> float:
            return metric_value(text, name, labels)

        assert m("kvtether_turns_total", 'outcome="miss:first_turn"') == 2
        assert m("kvtether_turns_total", 'outcome="fired"') == 2
        assert m("kvtether_turns_total", 'outcome="miss:no_conversation_id"') == 1
        assert m("kvtether_reuse_fired_total") == 2
        assert m("kvtether_reuse_miss_total", 'cause="first_turn"') == 2
        assert m("kvtether_reuse_miss_total", 'cause="no_conversation_id"') == 1
        assert m("kvtether_reused_tokens_total") == sum(t.reused for t in turns)
        assert m("kvtether_prompt_tokens_total") == sum(
            int(t.headers[p.HEADER_PROMPT_TOKENS]) for t in turns)
        assert m("kvtether_conversations") == 2
        assert m("kvtether_active_leases") == 1  # m1 holds KV; m2 was released
        status = (await h.client.get("/v1/sessions/m1")).json()
        inst = status["decode_instance"]
        assert m("kvtether_retained_tokens", f'instance="{inst}"') == status["retained_tokens"]
        assert m("kvtether_lease_events_total", 'event="renewed"') == 1
        assert m("kvtether_lease_events_total", 'event="released"') == 1
        assert m("kvtether_heartbeat_seconds_count") == 1
        assert m("kvtether_prefill_leg_seconds_count") == 5


async def test_ttft_observed_for_streamed_turns(hc: Harness) -> None:
    a = hc.conversation("ttft")
    await a.say("one", stream=True)
    await a.say("two", stream=True)
    assert await hc.metric("kvtether_ttft_seconds_count") == 2


async def test_metrics_count_errors(h: Harness) -> None:
    await h.post("/v1/chat/completions", b"{bad")
    h.p.fail_next("500")
    await h.post("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": "x"}]})
    assert await h.metric("kvtether_request_errors_total", 'status="400"') == 1
    assert await h.metric("kvtether_request_errors_total", 'status="500"') == 1


async def test_shutdown_lets_the_router_s_tasks_finish_then_cancels_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(router_app, "_DRAIN_S", 0.2)
    settings = RouterSettings(prefill_urls=["http://p0"], decode_urls=["http://d0"])
    app = router_app.create_app(
        settings, transport=httpx.MockTransport(lambda _: httpx.Response(503)))
    finished, hanging = asyncio.Event(), asyncio.Event()

    async def release() -> None:
        await asyncio.sleep(0.01)
        finished.set()

    async with app.router.lifespan_context(app):
        tasks = app.state.deps.tasks
        quick = tasks.start(release())
        stuck = tasks.start(hanging.wait())
    assert finished.is_set() and quick.done() and not quick.cancelled()
    assert stuck.cancelled() and len(tasks) == 0
