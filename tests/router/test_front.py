"""The round-robin front over real sockets: fake router replicas, the front under uvicorn."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvtether import protocol as p
from kvtether.router.front import FrontSettings, create_front_app
from tests.support.servers import HOST, bind_loopback, port_of, refused_url, serve_app

# A fake replica holds its second SSE chunk until the test has read the first; if the front
# buffered the answer the test would never get there, and the replica gives up after this.
GATE_TIMEOUT_S = 30.0


class FakeReplica:
    """A router replica: echoes what it received, streams on request, counts requests."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.requests: list[dict[str, Any]] = []
        self.gate = threading.Event()
        self.app = Starlette(routes=[
            Route("/health", self.health),
            Route("/v1/stream", self.stream, methods=["POST"]),
            Route("/{path:path}", self.echo, methods=["GET", "POST", "DELETE"]),
        ])

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def echo(self, request: Request) -> Response:
        body = await request.body()
        seen = {"replica": self.name, "method": request.method, "path": request.url.path,
                "query": request.url.query, "headers": dict(request.headers),
                "body": body.decode()}
        self.requests.append(seen)
        if request.url.path == "/v1/missing":
            return JSONResponse(p.error_body("no such thing", "not_found_error"), 404)
        return JSONResponse(seen, headers={p.HEADER_REUSE: "fired", "Set-Cookie": "a=1"})

    async def stream(self, request: Request) -> Response:
        self.requests.append({"replica": self.name, "path": request.url.path})

        async def events():  # noqa: ANN202
            import asyncio

            yield b"data: {\"n\": 1}\n\n"
            opened = await asyncio.to_thread(self.gate.wait, GATE_TIMEOUT_S)
            yield b"data: {\"n\": 2}\n\n" if opened else b"data: {\"n\": \"late\"}\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def _serve(app: Any) -> contextlib.AbstractContextManager[str]:
    return serve_app(lambda _port: app)


@contextlib.contextmanager
def _front(upstreams: list[str], **settings: Any) -> Iterator[httpx.Client]:
    app = create_front_app(FrontSettings(upstream_urls=upstreams, **settings))
    with _serve(app) as url, httpx.Client(base_url=url, timeout=60, trust_env=False) as client:
        yield client


_HALF_A_STREAM = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                  b"transfer-encoding: chunked\r\n\r\n"
                  b"10\r\ndata: {\"n\": 1}\n\n\r\n")


@contextlib.contextmanager
def _silent_server(reply: bytes = b"") -> Iterator[str]:
    """Accepts a connection, reads the request, sends ``reply`` (default: nothing), closes."""
    sock = bind_loopback()
    stop = threading.Event()

    def run() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            with conn:
                conn.recv(65536)
                conn.sendall(reply)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield f"http://{HOST}:{port_of(sock)}"
    finally:
        stop.set()
        thread.join(5)
        sock.close()


@pytest.fixture
def replicas() -> Iterator[tuple[list[FakeReplica], list[str]]]:
    fakes = [FakeReplica("a"), FakeReplica("b")]
    with _serve(fakes[0].app) as a, _serve(fakes[1].app) as b:
        yield fakes, [a, b]


def test_requests_alternate_and_pass_through_unchanged(replicas) -> None:  # noqa: ANN001
    fakes, urls = replicas
    headers = {"Authorization": "Bearer k1", p.HEADER_CONVERSATION_ID: "c1",
               p.HEADER_HINTS: '{"phase": "tool_running"}', "X-KVTether-Anything": "x"}
    with _front(urls) as front:
        answers = [front.post("/v1/chat/completions?x=1", json={"i": i}, headers=headers)
                   for i in range(4)]
    assert [a.status_code for a in answers] == [200] * 4
    assert [a.json()["replica"] for a in answers] == ["a", "b", "a", "b"]
    assert [a.headers[p.HEADER_ROUTER] for a in answers] == ["router-0", "router-1"] * 2
    for i, a in enumerate(answers):
        seen = a.json()
        assert (seen["method"], seen["path"], seen["query"]) == ("POST", "/v1/chat/completions",
                                                                 "x=1")
        assert json.loads(seen["body"]) == {"i": i}
        for name, value in headers.items():
            assert seen["headers"][name.lower()] == value
        assert a.headers[p.HEADER_REUSE] == "fired"
        assert a.headers["set-cookie"] == "a=1"
    assert len(fakes[0].requests) == len(fakes[1].requests) == 2


def test_replica_errors_are_relayed_as_they_are(replicas) -> None:  # noqa: ANN001
    _, urls = replicas
    with _front(urls) as front:
        r = front.get("/v1/missing")
        deleted = front.delete("/v1/sessions/c1")
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "no such thing"
    assert (deleted.status_code, deleted.json()["method"]) == (200, "DELETE")


def test_a_stream_is_passed_on_as_it_comes(replicas) -> None:  # noqa: ANN001
    fakes, urls = replicas
    with _front(urls[:1]) as front, front.stream("POST", "/v1/stream", json={}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        assert next(lines) == 'data: {"n": 1}'
        fakes[0].gate.set()  # the second event exists only now
        rest = [line for line in lines if line]
    assert rest == ['data: {"n": 2}', "data: [DONE]"]


def test_a_refusing_replica_is_skipped(replicas) -> None:  # noqa: ANN001
    fakes, urls = replicas
    dead = refused_url()  # nothing listens: connection refused
    with _front([dead, urls[0]]) as front:
        answers = [front.post("/v1/chat/completions", json={"i": i}) for i in range(4)]
        health = front.get("/health")
    assert [a.status_code for a in answers] == [200] * 4
    assert {a.headers[p.HEADER_ROUTER] for a in answers} == {"router-1"}
    assert len(fakes[0].requests) == 4  # each request reached the live replica exactly once
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "replicas": {"router-0": False, "router-1": True}}


def test_no_replica_answers_503_openai_error() -> None:
    dead = [refused_url() for _ in range(2)]
    with _front(dead) as front:
        r = front.post("/v1/chat/completions", json={})
        health = front.get("/health")
    assert r.status_code == 503
    error = r.json()["error"]
    assert error["code"] == "upstream_unavailable"
    assert error["type"] == "service_unavailable_error"
    assert "no router replica is reachable" in error["message"]
    assert health.status_code == 503


def test_a_replica_that_fails_after_the_request_was_sent_is_not_retried(replicas) -> None:  # noqa: ANN001
    fakes, urls = replicas
    with _silent_server() as silent, _front([silent, urls[0]]) as front:
        r = front.post("/v1/chat/completions", json={"turn": 1})
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_unavailable"
    assert "router-0" in r.json()["error"]["message"]
    assert fakes[0].requests == []  # a turn is not idempotent: it never runs twice


def test_a_stream_broken_mid_answer_ends_with_an_error_event() -> None:
    with _silent_server(_HALF_A_STREAM) as half, _front([half]) as front:
        with front.stream("POST", "/v1/chat/completions", json={"stream": True}) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
    assert lines[0] == 'data: {"n": 1}'
    error = json.loads(lines[1].removeprefix("data: "))["error"]
    assert error["code"] == "upstream_unavailable" and "router-0" in error["message"]
    assert "data: [DONE]" not in lines


def test_oversized_body_is_refused_413(replicas) -> None:  # noqa: ANN001
    fakes, urls = replicas
    with _front(urls, max_request_body_bytes=2048) as front:
        r = front.post("/v1/chat/completions", content=b"x" * 4096)
    assert r.status_code == 413
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert fakes[0].requests == fakes[1].requests == []


def test_settings_refuse_bad_upstreams() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="upstream_urls"):
        FrontSettings(upstream_urls=[])
    with pytest.raises(ValidationError, match="not an http"):
        FrontSettings(upstream_urls=["redis://127.0.0.1:6379"])
    assert FrontSettings(upstream_urls=["http://h:1/"]).upstream_urls == ["http://h:1"]
