"""Bad input on the control channel: random methods, keys, queries, headers and bodies.

Every answer is below 500, every 4xx is OpenAI-style JSON naming nothing internal, nothing
happens to a lease without the secret, and the server still answers afterwards.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvtether.connector._control import ControlServer
from kvtether.connector._leases import LeaseTable
from kvtether.protocol import PrefixCacheAnswer

from .test_control import FakeEngine, status_of

SECRET = "control-fuzz-secret"
GOOD = f"Bearer {SECRET}".encode()
FUZZ = settings(max_examples=250, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
_INTERNAL = re.compile(r"Traceback|File \"|\.py\b|/src/kvtether|\b[A-Z]\w*(Error|Exception)\(|"
                       r"object at 0x")


@pytest.fixture(scope="module")
def control() -> Iterator[tuple[str, FakeEngine]]:
    table = LeaseTable(op_timeout_s=2.0)
    server = ControlServer(table, lambda: status_of(table), "127.0.0.1", 0, secret=SECRET,
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
                      st.sampled_from([b"Bearer", b"Bearer wrong", SECRET.encode(),
                                       GOOD + b"x", b"Basic " + SECRET.encode()])),
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
