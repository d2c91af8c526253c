"""The HTTP control channel against a simulated engine loop (no vLLM).

``FakeEngine`` steps like vLLM's engine core with the kvtether scheduler: drain queued
operations into ``reqs_to_send``, let the worker overwrite its deadlines (upstream's
``start_load_kv``), reap expired ones (``_reap_expired_send_leases``) and report them freed
(``finished_sending`` -> ``update_connector_output``).
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvtether.connector._control import ControlServer, lease_reply, render_metrics
from kvtether.connector._leases import (
    Gone,
    LeaseTable,
    NotFound,
    Published,
    Released,
    Releasing,
    Renewed,
    TooLateToRenew,
)
from kvtether.protocol import (
    ConnectorStatus,
    HandleResponse,
    LeaseInfo,
    LeaseList,
    LeaseState,
    PrefixCacheAnswer,
)
from tests.support.waiting import wait_for


class FakeEngine:
    def __init__(self, table: LeaseTable) -> None:
        self.table = table
        self.worker_deadlines: dict[str, float] = {}
        self.consumed: set[str] = set()  # P notified "done reading"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def finish_turn(self, key: str, rid: str, ttl_s: float, tokens: int = 64) -> None:
        handle = {"remote_block_ids": [[7, 8]], "remote_num_tokens": tokens,
                  "remote_engine_id": "D"}
        opened = self.table.open(key, rid, handle, retained_blocks=2, retained_tokens=tokens,
                                 ttl_s=ttl_s)
        self.worker_deadlines.update(opened.updates)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.worker_deadlines.update(self.table.drain())
            now = time.perf_counter()
            freed = {r for r, d in self.worker_deadlines.items() if now >= d} | self.consumed
            for rid in freed:
                self.worker_deadlines.pop(rid, None)
            self.consumed -= freed
            if freed:
                self.table.on_freed(freed)

    def __enter__(self) -> FakeEngine:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def status_of(table: LeaseTable) -> ConnectorStatus:
    return ConnectorStatus(
        engine_id="engine-d", vllm_version="0.32.0", block_size=32, default_lease_ttl_s=30,
        max_lease_ttl_s=3600, totals=table.totals(), counters=table.counters(),
        unix_time=time.time(), perf_counter=time.perf_counter(),
    )


@pytest.fixture
def stack() -> Iterator[tuple[httpx.Client, FakeEngine]]:
    table = LeaseTable(op_timeout_s=5.0)
    server = ControlServer(table, lambda: status_of(table), "127.0.0.1", 0)
    server.start()
    with FakeEngine(table) as engine, httpx.Client(
        base_url=f"http://127.0.0.1:{server.port}/kvtether/v1", timeout=10
    ) as client:
        yield client, engine
    server.close()


def test_handle_long_poll_renew_and_release(stack: tuple[httpx.Client, FakeEngine]) -> None:
    client, engine = stack
    threading.Timer(0.2, engine.finish_turn, args=("conv-1/t1", "req-1", 30.0)).start()
    # Published only after the request went out: a 200 means the long poll waited for it.
    got = client.get("/handles/conv-1%2Ft1", params={"wait_s": 5})
    assert got.status_code == 200, got.text
    handle = HandleResponse.model_validate(got.json())
    assert handle.kv_transfer_params["remote_engine_id"] == "D"

    renewed = client.post("/leases/conv-1%2Ft1/renew", json={"ttl_s": 120})
    assert renewed.status_code == 200, renewed.text
    info = LeaseInfo.model_validate(renewed.json())
    assert 119 < info.remaining_s <= 120
    # Answered at once; the worker learns the deadline (plus the slack) at the next step.
    worker_deadline = info.remote_blocks_expiry_time + engine.table.worker_slack_s
    wait_for(lambda: engine.worker_deadlines.get("req-1") == worker_deadline, timeout_s=5,
             message="the renewed deadline to reach the worker")
    again = HandleResponse.model_validate(client.get("/handles/conv-1%2Ft1").json())
    assert again.kv_transfer_params["remote_blocks_expiry_time"] == info.remote_blocks_expiry_time

    released = client.delete("/leases/conv-1%2Ft1")  # answers once the blocks are freed
    assert released.status_code == 200 and released.json()["state"] == "released"
    assert "req-1" not in engine.worker_deadlines
    assert client.get("/handles/conv-1%2Ft1").status_code == 410


def test_a_release_that_does_not_wait_answers_once_applied(
    stack: tuple[httpx.Client, FakeEngine],
) -> None:
    """``wait_s=0`` (what the router sends): answered once the engine loop applied it, 202 if
    the worker has not freed the blocks yet (this fake frees them in the same step, so either
    answer); they end up freed all the same."""
    client, engine = stack
    engine.finish_turn("quick", "r-quick", ttl_s=30)
    released = client.delete("/leases/quick", params={"wait_s": 0})
    assert released.status_code in (200, 202), released.text
    assert released.json()["state"] in ("releasing", "released")
    wait_for(lambda: client.get("/leases/quick").json()["state"] == "released",
             timeout_s=10, interval_s=0.02, message="lease released")
    assert client.delete("/leases/quick", params={"wait_s": "soon"}).status_code == 400


def test_expiry_and_consumption_are_visible(stack: tuple[httpx.Client, FakeEngine]) -> None:
    client, engine = stack
    engine.finish_turn("short", "r-short", ttl_s=0.3)
    engine.finish_turn("read", "r-read", ttl_s=30)
    engine.consumed.add("r-read")
    wait_for(lambda: not client.get("/status").json()["totals"]["retained_tokens"],
             timeout_s=10, interval_s=0.05, message="no retained tokens")
    listing = LeaseList.model_validate(client.get("/leases").json())
    states = {x.key: x.state.value for x in listing.recently_ended}
    assert states == {"short": "expired", "read": "consumed"}
    assert listing.totals.retained_tokens == 0
    status = client.get("/status").json()
    assert status["counters"]["leases_expired"] == 1
    assert status["counters"]["leases_consumed"] == 1
    assert abs(status["perf_counter"] - time.perf_counter()) < 1
    metrics = client.get("/metrics")
    assert 'kvtether_connector_leases_expired_total{engine_id="engine-d"} 1' in metrics.text
    assert metrics.headers["content-type"].startswith("text/plain")


def test_bad_requests_get_clear_errors(stack: tuple[httpx.Client, FakeEngine]) -> None:
    client, engine = stack
    engine.finish_turn("k", "r", ttl_s=30)
    bad = client.post("/leases/k/renew", json={"ttl_s": -1})
    assert bad.status_code == 400 and "ttl_s" in bad.json()["error"]["message"]
    assert client.post("/leases/k/renew", json={"ttl": 5}).status_code == 400
    assert client.get("/handles/k", params={"wait_s": "soon"}).status_code == 400
    assert client.get("/nothing").status_code == 404
    assert client.delete("/leases/unknown").status_code == 404
    assert client.get("/handles/unknown", params={"wait_s": 0.1}).status_code == 404


def test_prefix_cache_lookups_answer_from_the_engine_or_say_they_cannot() -> None:
    table = LeaseTable(op_timeout_s=5.0)
    asked: list[list[int]] = []

    def lookup(token_ids: list[int]) -> PrefixCacheAnswer:
        asked.append(token_ids)
        return PrefixCacheAnswer(cached_tokens=len(token_ids) // 16 * 16, block_size=16)

    with_lookup = ControlServer(table, lambda: status_of(table), "127.0.0.1", 0,
                                prefix_cache=lookup)
    without = ControlServer(table, lambda: status_of(table), "127.0.0.1", 0)
    for server in (with_lookup, without):
        server.start()
    try:
        url = f"http://127.0.0.1:{with_lookup.port}/kvtether/v1/prefix-cache"
        r = httpx.post(url, json={"token_ids": list(range(40))})
        assert r.status_code == 200
        assert PrefixCacheAnswer.model_validate(r.json()).cached_tokens == 32
        assert asked == [list(range(40))]
        for bad in ({"token_ids": "1 2 3"}, {"tokens": [1]}, {"token_ids": [1], "x": 1}):
            r = httpx.post(url, json=bad)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert len(asked) == 1
        r = httpx.post(f"http://127.0.0.1:{without.port}/kvtether/v1/prefix-cache",
                       json={"token_ids": [1, 2]})
        assert r.status_code == 501 and r.json()["error"]["code"] == "not_supported"
        assert "--scheduler-cls" in r.json()["error"]["message"]
    finally:
        with_lookup.close()
        without.close()


def test_render_metrics_has_gauges_and_counters() -> None:
    table = LeaseTable()
    table.open("k", "r", {}, retained_blocks=3, retained_tokens=90, ttl_s=10)
    text = render_metrics(status_of(table))
    assert 'kvtether_connector_active_leases{engine_id="engine-d"} 1' in text
    assert 'kvtether_connector_retained_tokens{engine_id="engine-d"} 90' in text
    assert "# TYPE kvtether_connector_leases_created_total counter" in text


SECRET = "s3cret-token"


@pytest.fixture
def guarded() -> Iterator[tuple[str, FakeEngine]]:
    """A control server that requires ``SECRET`` and takes bodies up to 1 KiB."""
    table = LeaseTable(op_timeout_s=5.0)
    server = ControlServer(table, lambda: status_of(table), "127.0.0.1", 0, secret=SECRET,
                           max_body_bytes=1024)
    server.start()
    with FakeEngine(table) as engine:
        yield f"http://127.0.0.1:{server.port}/kvtether/v1", engine
    server.close()


def test_every_route_needs_the_secret(guarded: tuple[str, FakeEngine]) -> None:
    url, engine = guarded
    engine.finish_turn("k", "r", ttl_s=30)
    calls = [("GET", "/status"), ("GET", "/metrics"), ("GET", "/leases"), ("GET", "/leases/k"),
             ("POST", "/leases/k/renew"), ("DELETE", "/leases/k"), ("GET", "/handles/k"),
             ("POST", "/prefix-cache"), ("GET", "/nothing")]
    for auth in (None, "Bearer wrong", f"Basic {SECRET}", SECRET, f"Bearer {SECRET}x"):
        headers = {"Authorization": auth} if auth else {}
        with httpx.Client(base_url=url, timeout=10, headers=headers) as client:
            for method, path in calls:
                r = client.request(method, path, json={"ttl_s": 1})
                assert r.status_code == 401, (auth, method, path, r.text)
                error = r.json()["error"]
                assert error["type"] == "authentication_error"
                assert error["code"] == "invalid_control_secret"
                assert "KVTETHER_CONTROL_SECRET" in error["message"]
                assert r.headers["connection"] == "close"
    untouched = engine.table.lease("k")  # not renewed, not released
    assert isinstance(untouched, LeaseInfo) and untouched.renewals == 0
    assert engine.table.totals().active_leases == 1
    with httpx.Client(base_url=url, timeout=10,
                      headers={"Authorization": f"Bearer {SECRET}"}) as client:
        assert client.get("/status").status_code == 200
        renewed = client.post("/leases/k/renew", json={"ttl_s": 120})
        assert renewed.status_code == 200 and renewed.json()["remaining_s"] > 100
        assert client.delete("/leases/k").json()["state"] == "released"


def test_large_bodies_get_413_and_the_connection_stays_usable(
    guarded: tuple[str, FakeEngine],
) -> None:
    url, engine = guarded
    engine.finish_turn("k", "r", ttl_s=30)
    with httpx.Client(base_url=url, timeout=10,
                      headers={"Authorization": f"Bearer {SECRET}"}) as client:
        big = client.post("/leases/k/renew", content=b'{"ttl_s": 5' + b" " * 2000 + b"}",
                          headers={"content-type": "application/json"})
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        # A body on a GET is read and ignored, so the next request on the connection parses.
        assert client.request("GET", "/leases/k", content=b"x" * 500).status_code == 200
        assert client.get("/status").status_code == 200

        def chunked():
            yield b'{"ttl_s": 5}'

        assert client.post("/leases/k/renew", content=chunked()).status_code == 411
        assert client.put("/leases/k").status_code == 404  # JSON, not http.server's 501
        assert client.post("/leases/k/renew", json={"ttl_s": 60}).status_code == 200


def test_replies_are_sent_without_waiting_for_the_client_s_ack(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A reply is two writes (headers, body); with Nagle's algorithm on, the body would wait for
    # the client's delayed ACK of the headers (up to 40 ms on Linux).
    import socket

    from kvtether.connector import _control

    nodelay: list[int] = []
    setup = _control._Handler.setup

    def recording_setup(self: _control._Handler) -> None:
        setup(self)
        nodelay.append(self.connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    monkeypatch.setattr(_control._Handler, "setup", recording_setup)
    table = LeaseTable(op_timeout_s=5.0)
    server = ControlServer(table, lambda: status_of(table), "127.0.0.1", 0)
    server.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}/kvtether/v1") as client:
            assert client.get("/status").status_code == 200
            assert client.delete("/leases/none", params={"wait_s": 0}).status_code == 404
    finally:
        server.close()
    assert nodelay and all(nodelay)


def test_settings_keep_an_open_channel_on_loopback() -> None:
    from kvtether.connector._settings import ConnectorSettings
    from kvtether.errors import ConfigError

    plain = ConnectorSettings.from_extra_config({"kvtether_control_port": 5900}, env={})
    assert plain.control_host == "127.0.0.1" and plain.control_secret is None
    with pytest.raises(ConfigError, match="KVTETHER_CONTROL_SECRET"):
        ConnectorSettings.from_extra_config(
            {"kvtether_control_port": 5900, "kvtether_control_host": "0.0.0.0"}, env={})
    open_wide = ConnectorSettings.from_extra_config(
        {"kvtether_control_port": 5900, "kvtether_control_host": "0.0.0.0"},
        env={"KVTETHER_CONTROL_SECRET": "x"})
    assert open_wide.control_secret is not None
    assert open_wide.control_secret.get_secret_value() == "x"
    assert "x" not in repr(open_wide.control_secret)


def _info(state: LeaseState = LeaseState.ACTIVE) -> LeaseInfo:
    return LeaseInfo(key="conv/t1", request_id="r1", state=state, retained_blocks=2,
                     retained_tokens=64, deadline_unix_s=2e9, remaining_s=30.0,
                     remote_blocks_expiry_time=1030.0, renewals=0, created_unix_s=2e9 - 30,
                     ended_unix_s=None)


def test_lease_results_map_to_http_status_and_body() -> None:
    info = _info()
    assert lease_reply(info).status == 200
    assert lease_reply(Renewed(info)).body == info.model_dump(mode="json")
    assert lease_reply(Released(info)).status == 200
    releasing = lease_reply(Releasing(_info(LeaseState.RELEASING)))
    assert releasing.status == 202 and releasing.body["state"] == "releasing"

    published = lease_reply(Published("conv/t1", info, {"remote_block_ids": ([1, 2],)}))
    body = HandleResponse.model_validate(published.body)
    assert published.status == 200 and body.key == "conv/t1"
    assert body.kv_transfer_params["remote_block_ids"] == [[1, 2]]  # JSON, as sent

    gone = lease_reply(Gone(LeaseState.EXPIRED, _info(LeaseState.RELEASING)))
    assert gone.status == 410
    assert gone.body["error"] == {"message": "lease 'conv/t1' is expired",
                                  "type": "kvtether_lease_error", "param": None,
                                  "code": "expired"}
    assert gone.body["lease"]["state"] == "releasing"

    late = lease_reply(TooLateToRenew(0.25, info))
    assert late.status == 410 and late.body["error"]["code"] == "expiring"
    assert "expires in 0.250s" in late.body["error"]["message"]
    assert late.body["lease"]["key"] == "conv/t1"


def test_a_missing_lease_and_a_missing_handle_say_which() -> None:
    lease = lease_reply(NotFound("k"))
    handle = lease_reply(NotFound("k"), missing="handle")
    assert lease.status == handle.status == 404
    assert lease.body["error"]["message"] == "no lease 'k'"
    assert handle.body["error"]["message"] == "no handle published under 'k'"
    assert lease.body["error"]["code"] == "not_found" and "lease" not in lease.body


def test_connections_over_the_cap_get_503_and_a_freed_slot_serves_again() -> None:
    table = LeaseTable()
    server = ControlServer(table, lambda: status_of(table), "127.0.0.1", 0, max_connections=2)
    server.start()
    url = f"http://127.0.0.1:{server.port}/kvtether/v1"
    holders = [httpx.Client(base_url=url, timeout=10) for _ in range(2)]
    try:
        for client in holders:  # each keeps its connection (and its slot) open
            assert client.get("/status").status_code == 200
        with httpx.Client(base_url=url, timeout=10) as extra:
            refused = extra.get("/status")
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "too_many_connections"
        assert refused.headers["connection"] == "close"
        assert holders[0].get("/leases").status_code == 200  # the open ones still serve

        holders.pop().close()

        def served() -> bool:
            with httpx.Client(base_url=url, timeout=10) as client:
                return client.get("/status").status_code == 200

        wait_for(served, timeout_s=5, message="the freed slot to serve a new connection")
    finally:
        for client in holders:
            client.close()
        server.close()


def test_a_long_poll_holds_its_slot_until_answered() -> None:
    table = LeaseTable()
    server = ControlServer(table, lambda: status_of(table), "127.0.0.1", 0, max_connections=1)
    server.start()
    url = f"http://127.0.0.1:{server.port}/kvtether/v1"
    answers: list[int] = []
    try:
        with httpx.Client(base_url=url, timeout=10) as poller:
            waiter = threading.Thread(target=lambda: answers.append(
                poller.get("/handles/k", params={"wait_s": 5}).status_code))
            waiter.start()
            wait_for(lambda: busy(url), timeout_s=5, message="the long poll to take the slot")
            FakeEngine(table).finish_turn("k", "r1", ttl_s=30)
            waiter.join(timeout=10)
        assert answers == [200]
    finally:
        server.close()


def busy(url: str) -> bool:
    with httpx.Client(base_url=url, timeout=10) as client:
        return client.get("/status").status_code == 503


# --- bad input: random methods, keys, queries, headers and bodies ------------------------------
# Every answer is below 500, every 4xx is OpenAI-style JSON naming nothing internal, nothing
# happens to a lease without the secret, and the server still answers afterwards.

FUZZ_SECRET = "control-fuzz-secret"
GOOD = f"Bearer {FUZZ_SECRET}".encode()
FUZZ = settings(max_examples=250, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
_INTERNAL = re.compile(r"Traceback|File \"|\.py\b|/src/kvtether|\b[A-Z]\w*(Error|Exception)\(|"
                       r"object at 0x")


@pytest.fixture(scope="module")
def control() -> Iterator[tuple[str, FakeEngine]]:
    table = LeaseTable(op_timeout_s=2.0)
    server = ControlServer(table, lambda: status_of(table), "127.0.0.1", 0, secret=FUZZ_SECRET,
                           max_body_bytes=4096,
                           prefix_cache=lambda ids: PrefixCacheAnswer(
                               cached_tokens=len(ids) // 16 * 16, block_size=16))
    server.start()
    with FakeEngine(table) as engine:
        engine.finish_turn("held", "r-held", ttl_s=3600)
        yield f"127.0.0.1:{server.port}", engine
    server.close()


_header_bytes = st.binary(max_size=200).map(
    lambda b: b.replace(b"\r", b"").replace(b"\n", b"").replace(b"\0", b"").strip())
_keys = st.one_of(st.sampled_from(["held", "k", "unknown"]), st.text(max_size=200))
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner,
                                                                max_size=3),
    max_leaves=8,
)
_bodies = st.one_of(
    st.none(), st.binary(max_size=300), _json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({}, optional={"ttl_s": _json_values | st.floats(0, 10)}).map(
        lambda d: json.dumps(d).encode()),
    st.fixed_dictionaries({}, optional={"token_ids": _json_values | st.lists(st.integers())}).map(
        lambda d: json.dumps(d).encode()),
    st.just(b"x" * 5000),  # over the limit
)
def _long_wait(text: str) -> bool:
    try:
        return float(text) > 0.05  # a real long-poll: examples would wait for nothing
    except ValueError:
        return False


_wait = st.one_of(st.none(), st.sampled_from(["0", "0.01", "-1", "nan", "-inf", "soon", ""]),
                  st.text(max_size=20).filter(lambda t: not _long_wait(t)))


def raw_request(hostport: str, method: str, target: str, headers: list[tuple[bytes, bytes]],
                body: bytes | None) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request on its own socket, bytes as given (no client-side validation)."""
    host, port = hostport.split(":")
    lines = [f"{method} {target} HTTP/1.1".encode(), f"Host: {hostport}".encode()]
    lines += [name + b": " + value for name, value in headers]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}".encode())
    lines.append(b"Connection: close")
    payload = b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(payload)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    raw = b"".join(chunks)
    head, _, content = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split()[1])
    hdrs = {k.strip().lower(): v.strip() for k, _, v in
            (line.partition(":") for line in header_lines)}
    return status, hdrs, content


@FUZZ
@given(method=st.sampled_from(["GET", "POST", "DELETE", "PUT", "PATCH", "OPTIONS"]),
       route=st.sampled_from(["/kvtether/v1/status", "/kvtether/v1/metrics",
                              "/kvtether/v1/leases", "/kvtether/v1/leases/{}",
                              "/kvtether/v1/leases/{}/renew", "/kvtether/v1/handles/{}",
                              "/kvtether/v1/prefix-cache",
                              "/kvtether/v1/{}", "/{}", "/kvtether/v1"]),
       key=_keys, wait=_wait,
       auth=st.one_of(st.just(GOOD), st.just(GOOD), st.just(GOOD), st.none(), _header_bytes,
                      st.sampled_from([b"Bearer", b"Bearer wrong", FUZZ_SECRET.encode(),
                                       GOOD + b"x", b"Basic " + FUZZ_SECRET.encode()])),
       extra=st.lists(st.tuples(st.sampled_from([b"content-type", b"x-anything", b"accept"]),
                                _header_bytes), max_size=3),
       body=_bodies)
def test_every_control_route(control: Any, method: str, route: str, key: str, wait: str | None,
                             auth: bytes | None, extra: list, body: bytes | None) -> None:
    hostport, engine = control
    target = route.format(quote(key, safe=""))
    if wait is not None:
        target += "?wait_s=" + quote(wait, safe="")
    headers = list(extra) + ([(b"Authorization", auth)] if auth is not None else [])
    before = (engine.table.counters(), engine.table.totals())
    status, hdrs, content = raw_request(hostport, method, target, headers, body)
    event(f"HTTP {status}")
    assert status < 500, (status, content[:300])
    if status >= 400:
        assert hdrs["content-type"] == "application/json"
        error = json.loads(content)["error"]
        assert error["message"] and error["type"]
        message = error["message"].replace(repr(key), "").replace(key, "")
        message = message.replace(repr(wait), "") if wait else message
        assert not _INTERNAL.search(message), message
    if auth != GOOD:
        assert status in (400, 401), status  # refused before anything else
        assert (engine.table.counters(), engine.table.totals()) == before  # and nothing done
    status, _, _ = raw_request(hostport, "GET", "/kvtether/v1/status", [(b"Authorization", GOOD)],
                               None)
    assert status == 200


def test_a_request_line_or_headers_http_server_refuses_are_json(control: Any) -> None:
    hostport, _ = control
    host, port = hostport.split(":")
    for payload in (b"GARBAGE\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n",
                    b"GET /" + b"x" * 70000 + b" HTTP/1.1\r\n\r\n"):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(payload)
            raw = b"".join(iter(lambda: s.recv(65536), b""))
        if raw.startswith(b"HTTP/"):
            head, _, content = raw.partition(b"\r\n\r\n")
            assert head.split()[1].startswith(b"4"), head
        else:  # an HTTP/0.9-style request line gets a bare body, as HTTP/0.9 has no headers
            content = raw
        assert json.loads(content)["error"]["message"]
