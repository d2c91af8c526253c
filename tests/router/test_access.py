"""API keys, tenants and request size limits of the router (fake vLLM behind it)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from kvtether.protocol import _kv_params as kv_keys
from kvtether.errors import ConfigError
from kvtether.router import RouterSettings, create_app
from kvtether.router.access import KeyRing, read_key_file
from tests.support.router_harness import Harness, make_router

KEYS = "# tenants of this router\nalice key-alice-1\nalice key-alice-2  # rotated\nbob key-bob\n"


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.txt"
    path.write_text(KEYS)
    return path


@contextlib.asynccontextmanager
async def as_key(h: Harness, key: str | None) -> AsyncIterator[Harness]:
    """The same router, seen by a client that sends ``key`` (or no key)."""
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=h.app, raise_app_exceptions=False),
        base_url="http://router", headers=headers,
    ) as client:
        yield Harness(h.cluster, h.prefill, h.decode, h.settings, h.app, client, h.transport)


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["message"]
    return error


async def test_every_endpoint_but_health_and_metrics_needs_a_key(key_file: Path) -> None:
    async with make_router(control=True, api_key_file=key_file) as h:
        async with as_key(h, "key-alice-1") as alice:
            assert (await alice.conversation("c1").say("one")).status == 200
        calls = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                 ("GET", "/v1/models"), ("GET", "/v1/sessions/c1"),
                 ("POST", "/v1/sessions/c1/heartbeat"), ("DELETE", "/v1/sessions/c1"),
                 ("GET", "/no/such/route")]
        for key in (None, "wrong", "key-alice-1x", ""):
            async with as_key(h, key) as anyone:
                for method, path in calls:
                    r = await anyone.client.request(method, path, json={})
                    error = assert_openai_error(r, 401)
                    assert error["type"] == "authentication_error"
                    assert error["code"] == "invalid_api_key"
                    assert r.headers["www-authenticate"] == "Bearer"
                assert (await anyone.client.get("/health")).status_code == 200
                assert (await anyone.client.get("/metrics")).status_code == 200
        for scheme in ("Basic key-alice-1", "key-alice-1", "Bearer"):
            r = await h.client.get("/v1/models", headers={"Authorization": scheme})
            assert_openai_error(r, 401)
        # The conversation was not touched by any refused call.
        async with as_key(h, "key-alice-2") as alice:
            status = (await alice.client.get("/v1/sessions/c1")).json()
            assert status["lease_state"] == "active" and len(status["turns"]) == 1
        assert await h.metric("kvtether_request_errors_total", 'status="401"') >= 28


async def test_metrics_can_require_a_key() -> None:
    async with make_router(api_key="k", metrics_require_api_key=True) as h:
        assert_openai_error(await h.client.get("/metrics"), 401)
        assert (await h.client.get("/health")).status_code == 200
        async with as_key(h, "k") as ok:
            assert (await ok.client.get("/metrics")).status_code == 200


async def test_a_conversation_belongs_to_the_tenant_that_created_it(key_file: Path) -> None:
    async with make_router(control=True, api_key_file=key_file, api_key="key-ops") as h:
        async with as_key(h, "key-alice-1") as alice, as_key(h, "key-alice-2") as alice2, \
                as_key(h, "key-bob") as bob, as_key(h, "key-ops") as ops:
            mine = alice.conversation("shared-id")
            await mine.say("one")
            owner_key = h.d.decode_params[-1][kv_keys.KV_PARAM_HANDLE_KEY]
            # Any key of the same tenant sees it.
            assert (await alice2.client.get("/v1/sessions/shared-id")).status_code == 200
            for other in (bob, ops):
                unknown = await other.client.get("/v1/sessions/never-used")
                for method, path in [("GET", "/v1/sessions/shared-id"),
                                     ("POST", "/v1/sessions/shared-id/heartbeat"),
                                     ("DELETE", "/v1/sessions/shared-id")]:
                    r = await other.client.request(method, path, json={})
                    error = assert_openai_error(r, 404)
                    # Indistinguishable from an id nobody used (but for the id itself).
                    assert error == {**unknown.json()["error"], "message": error["message"]}
                    assert error["message"] == unknown.json()["error"]["message"].replace(
                        "never-used", "shared-id")
            # Bob's turn on the same id starts bob's own conversation: no read of alice's KV.
            handles_before = len([x for x in h.p.prefill_handles if x])
            theirs = bob.conversation("shared-id")
            t = await theirs.say("one")
            assert t.outcome == "miss:first_turn" and t.reused == 0
            assert len([x for x in h.p.prefill_handles if x]) == handles_before
            t = await theirs.say("two")
            assert t.outcome == "fired"
            assert owner_key not in h.d.releases  # alice's lease untouched by all of this
            t = await mine.say("two")
            assert t.outcome == "fired"
            assert len((await alice.client.get("/v1/sessions/shared-id")).json()["turns"]) == 2
            assert len((await bob.client.get("/v1/sessions/shared-id")).json()["turns"]) == 2
            assert (await bob.client.delete("/v1/sessions/shared-id")).status_code == 200
            status = (await alice.client.get("/v1/sessions/shared-id")).json()
            assert status["lease_state"] == "active"
        h.assert_kv_correct()


async def test_per_tenant_cap_releases_that_tenants_least_recently_used_kv(
    key_file: Path,
) -> None:
    async with make_router(control=True, api_key_file=key_file) as h:
        async with as_key(h, "key-alice-1") as alice, as_key(h, "key-bob") as bob:
            await bob.conversation("b1").say("one")
            a1, a2, a3 = (alice.conversation(c) for c in ("a1", "a2", "a3"))
            await a1.say("one")
            per_conv = max(r.num_tokens for r in h.d.held_leases())
            # Room for two of alice's conversations; bob's does not count against her.
            h.app.state.runner.s.max_retained_tokens_per_tenant = 2 * per_conv + 20
            await a2.say("one")
            await a1.say("two")  # a1 is now more recently used than a2
            await a3.say("one")
            states = {c: (await alice.client.get(f"/v1/sessions/{c}")).json()["lease_state"]
                      for c in ("a1", "a2", "a3")}
            assert states == {"a1": "active", "a2": "evicted", "a3": "active"}
            assert (await bob.client.get("/v1/sessions/b1")).json()["lease_state"] == "active"
            assert (await a2.say("two")).outcome == "miss:evicted"
            retention = h.app.state.retention
            assert retention.tenant_retained_tokens("alice") <= 2 * per_conv + 20
            # One turn alone over the cap holds nothing.
            h.app.state.runner.s.max_retained_tokens_per_tenant = 1
            await a1.say("three")
            assert (await alice.client.get("/v1/sessions/a1")).json()["lease_state"] == "evicted"
        h.assert_kv_correct()


async def test_without_keys_everything_is_open_as_before() -> None:
    async with make_router(control=True) as h:
        a = h.conversation("c")
        await a.say("one")
        r = await h.client.get("/v1/sessions/c", headers={"Authorization": "Bearer anything"})
        assert r.status_code == 200
        assert (await a.say("two")).outcome == "fired"


async def test_bodies_over_the_limit_get_413() -> None:
    async with make_router(max_request_body_bytes=4096) as h:
        big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]}
        r = await h.client.post("/v1/chat/completions", json=big)
        error = assert_openai_error(r, 413)
        assert error["code"] == "request_too_large" and "4096" in error["message"]

        async def chunks():  # no Content-Length: counted while read
            for _ in range(10):
                yield b"x" * 1000

        r = await h.client.post("/v1/chat/completions", content=chunks())
        assert_openai_error(r, 413)
        r = await h.client.post("/v1/sessions/c/heartbeat", content=b"{" + b" " * 5000 + b"}")
        assert_openai_error(r, 413)
        r = await h.client.post("/v1/completions", content=b"{}",
                                headers={"Content-Length": "-1"})
        assert_openai_error(r, 400)
        assert (await h.chat([{"role": "user", "content": "small"}], "c")).status == 200
        assert await h.metric("kvtether_request_errors_total", 'status="413"') == 3


async def test_unexpected_errors_say_nothing_internal(caplog: pytest.LogCaptureFixture) -> None:
    async with make_router() as h:
        async def boom(req):  # noqa: ANN001, ANN202
            raise RuntimeError("secret detail /srv/kvtether/internal.py")

        h.app.state.runner.run = boom
        r = await h.chat([{"role": "user", "content": "hi"}], "c")
        error = assert_openai_error(r.response, 500)
        assert "secret" not in r.response.text and "RuntimeError" not in r.response.text
        request_id = r.headers["x-request-id"]
        assert request_id in error["message"]
        assert any(request_id in rec.getMessage() and rec.exc_info for rec in caplog.records)


async def test_upstream_failures_name_no_exception() -> None:
    async with make_router() as h:
        h.p.down = True
        r = await h.chat([{"role": "user", "content": "hi"}], "c")
        assert r.status in (502, 503)
        assert "Error(" not in r.response.text and "Errno" not in r.response.text


def test_key_file_format(tmp_path: Path, key_file: Path) -> None:
    assert read_key_file(key_file) == {
        "key-alice-1": "alice", "key-alice-2": "alice", "key-bob": "bob"}
    ring = KeyRing.from_settings(RouterSettings(api_key_file=key_file, api_key="solo"))
    assert ring.tenant("Bearer key-bob") == "bob"
    assert ring.tenant("bearer  solo ") == "default"
    assert ring.tenant("Bearer nope") is None and ring.tenant(None) is None
    for text, problem in [("alice\n", "expected 'tenant key'"), ("a b c\n", "3 field"),
                          ("al/ice k\n", "tenant name"), ("a k\nb k\n", "already listed"),
                          ("# nothing\n", "lists no key")]:
        bad = tmp_path / "bad.txt"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=problem) as exc:
            read_key_file(bad)
        assert " k\n" not in str(exc.value)
    with pytest.raises(ConfigError, match="cannot read"):
        create_app(RouterSettings(api_key_file=tmp_path / "missing.txt"))


def test_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTETHER_ROUTER_API_KEY", "from-env")
    monkeypatch.setenv("KVTETHER_ROUTER_MAX_RETAINED_TOKENS_PER_TENANT", "5000")
    s = RouterSettings()
    assert s.api_key is not None and s.api_key.get_secret_value() == "from-env"
    assert "from-env" not in repr(s)
    assert s.max_retained_tokens_per_tenant == 5000
    assert KeyRing.from_settings(s).tenant("Bearer from-env") == "default"


@pytest.mark.parametrize("stream", [False, True])
async def test_router_sends_the_control_secret(stream: bool) -> None:
    async with make_router(control=True, fake={"control_secret": "cs"}, control_secret="cs") as h:
        a = h.conversation("c")
        await a.say("one", stream=stream)
        assert (await h.client.post("/v1/sessions/c/heartbeat", json={})).status_code == 200
        assert (await a.say("two", stream=stream)).outcome == "fired"
        assert (await h.client.delete("/v1/sessions/c")).status_code == 200
        assert h.d.releases and not h.d.held_leases()


async def test_the_lease_check_at_handoff_sends_the_control_secret() -> None:
    """A lease longer than --handoff-lease-s is checked, not renewed, before its handle goes
    to prefill: without the secret the check cannot see that D dropped the KV."""
    async with make_router(control=True, fake={"control_secret": "cs"}, control_secret="cs",
                           lease_ttl_s=300, handoff_lease_s=60) as h:
        a = h.conversation("c")
        await a.say("one")
        (held,) = h.d.held_leases()
        held.end("expired")  # behind the router's back
        t = await a.say("two")
        assert t.status == 200 and t.outcome == "miss:lease_expired"
        assert h.p.prefill_handles[-1] is None


async def test_a_wrong_control_secret_is_logged_and_no_turn_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with make_router(control=True, fake={"control_secret": "cs"},
                           control_secret="other") as h:
        a = h.conversation("c")
        await a.say("one", stream=True)  # D's handle cannot be fetched: not retained
        assert (await a.say("two", stream=True)).status == 200
        assert h.d.releases == []
        assert "KVTETHER_CONTROL_SECRET" in caplog.text
