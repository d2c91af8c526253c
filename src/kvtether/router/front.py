"""A round-robin front for router replicas that share a conversation store.

``kvtether stack up --routers N --store ...`` runs it on the stack's public port; outside the
stack, any HTTP load balancer does the same job (a Kubernetes Service, a gateway). Each request
goes to the next replica in turn, passed through as is (method, path, query, body, every header
but hop-by-hop ones, so ``Authorization`` and all ``X-KVTether-*`` / ``X-Conversation-Id``
reach the replica) and its answer streamed back as it comes, with ``X-KVTether-Router`` naming
the replica. A replica that refuses the connection is skipped for a few seconds and the request
goes to the next one: nothing was sent, so nothing can run twice. Once a request has been sent,
a failure is the client's to retry (a turn is not idempotent): 502 before any answer, a cut
stream after. ``GET /health`` is the front's own: 200 while any replica answers its
``/health``, else 503.

Run alone: ``kvtether front --upstream-urls '["http://127.0.0.1:8001", "http://127.0.0.1:8002"]'``
(the one way to serve it; :func:`serve_front` from code).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvtether import protocol as p

if TYPE_CHECKING:  # the app's imports wait until one is built: `kvtether --help` needs none
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse

logger = logging.getLogger(__name__)

__all__ = ["FrontSettings", "create_front_app", "serve_front", "main"]

# RFC 9110 7.6.1: meaningful for one connection only, never forwarded. Host and the body's
# length are set again for the replica's connection.
_HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"transfer-encoding", b"upgrade",
})
_NOT_FORWARDED = _HOP_BY_HOP | {b"host", b"content-length"}
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


class FrontSettings(BaseSettings):
    """The front's settings: flags of ``kvtether front``, env ``KVTETHER_FRONT_*``."""

    model_config = SettingsConfigDict(env_prefix="KVTETHER_FRONT_", extra="forbid")

    host: str = Field(default="127.0.0.1", description="interface to listen on")
    port: int = Field(default=8000, ge=1, le=65535, description="port to listen on")
    upstream_urls: list[str] = Field(
        min_length=1, description="base URLs of the router replicas, taken in turn"
    )
    connect_timeout_s: float = Field(
        default=5.0, gt=0, description="a replica that does not accept within this is skipped"
    )
    upstream_timeout_s: float = Field(
        default=600.0, gt=0, description="longest wait for a replica's next bytes"
    )
    down_backoff_s: float = Field(
        default=2.0, ge=0, description="a replica that refused a connection is skipped this long"
    )
    max_request_body_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1024,
        description="larger request bodies are refused with 413 (the front holds each body "
        "until a replica accepts it)",
    )

    @field_validator("upstream_urls")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} is not an http(s) URL")
        return [u.rstrip("/") for u in urls]


@dataclass(eq=False)
class _Replica:
    name: str
    url: str
    down_until_monotonic_s: float = 0.0

    @property
    def available(self) -> bool:
        return time.monotonic() >= self.down_until_monotonic_s


class _RoundRobin:
    """The replicas to try for one request: every one, starting with the next in turn, those
    recently refused last (still tried: better a late try than a refusal)."""

    def __init__(self, replicas: list[_Replica]) -> None:
        self.replicas = replicas
        self._next = 0

    def order(self) -> list[_Replica]:
        k = self._next % len(self.replicas)
        self._next += 1
        rotated = self.replicas[k:] + self.replicas[:k]
        return [r for r in rotated if r.available] + [r for r in rotated if not r.available]


def create_front_app(
    settings: FrontSettings, transport: httpx.AsyncBaseTransport | None = None
) -> Starlette:
    """The front as an ASGI app (``transport`` replaces the network to the replicas, for tests)."""
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from kvtether.router._errors import error_response

    replicas = [_Replica(f"router-{i}", url) for i, url in enumerate(settings.upstream_urls)]
    rotation = _RoundRobin(replicas)
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(settings.upstream_timeout_s, connect=settings.connect_timeout_s),
        # Idle connections go before the replicas' uvicorn closes them (5 s keep-alive): a
        # request sent on a connection being closed fails after it left (no retry possible).
        limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100,
                            keepalive_expiry=2.0),
        transport=transport,
        trust_env=False,
    )

    async def health(request: Request) -> Response:
        async def one(r: _Replica) -> bool:
            try:
                return (await client.get(f"{r.url}/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                return False

        states = await asyncio.gather(*(one(r) for r in replicas))
        up = dict(zip((r.name for r in replicas), states, strict=True))
        ok = any(states)
        return JSONResponse({"status": "ok" if ok else "unavailable", "replicas": up},
                            status_code=200 if ok else 503)

    async def forward(request: Request) -> Response:
        try:
            body = await _read_body(request, settings.max_request_body_bytes)
        except _BodyTooLarge:
            return error_response(
                413, f"request body exceeds {settings.max_request_body_bytes} bytes",
                code="request_too_large")
        except ClientDisconnect:
            return Response(status_code=400)
        target = request.scope.get("raw_path") or request.url.path.encode()
        if request.url.query:
            target += b"?" + request.url.query.encode()
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in _NOT_FORWARDED]
        for replica in rotation.order():
            upstream_request = client.build_request(
                request.method, replica.url + target.decode("latin-1"), headers=headers,
                content=body)
            try:
                upstream = await client.send(upstream_request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                # Nothing reached the replica: the next one may take the request.
                _mark_down(replica, settings.down_backoff_s, exc)
                continue
            except httpx.HTTPError as exc:
                logger.warning("router replica %s failed: %r", replica.name, exc)
                return error_response(
                    502, f"router replica {replica.name} failed before answering "
                    f"({type(exc).__name__}); retry the request", code="upstream_unavailable")
            replica.down_until_monotonic_s = 0.0
            return _relay(upstream, replica.name)
        return error_response(503, "no router replica is reachable; retry shortly",
                              code="upstream_unavailable")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    return Starlette(
        routes=[Route("/health", health, methods=["GET"]),
                Route("/{path:path}", forward, methods=_METHODS)],
        lifespan=lifespan,
    )


class _BodyTooLarge(Exception):
    pass


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _BodyTooLarge
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def _mark_down(replica: _Replica, backoff_s: float, exc: Exception) -> None:
    if replica.available:
        logger.warning("router replica %s (%s) refused: %r; trying the next", replica.name,
                       replica.url, exc)
    replica.down_until_monotonic_s = time.monotonic() + backoff_s


def _relay(upstream: httpx.Response, name: str) -> StreamingResponse:
    """The replica's answer, streamed back byte for byte (its encoding and length kept)."""
    from starlette.background import BackgroundTask
    from starlette.responses import StreamingResponse

    sse = upstream.headers.get("content-type", "").startswith("text/event-stream")

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            logger.warning("router replica %s failed mid-answer: %r", name, exc)
            if not sse:
                raise  # the client sees the connection cut short, not a truncated success
            # As the router does when a stream breaks: an error event, and no [DONE].
            error = p.error_body(f"router replica {name} failed mid-stream; retry the turn",
                                 "upstream_error", code="upstream_unavailable")
            # The blank line first ends an event the replica left half sent.
            yield f"\n\ndata: {json.dumps(error)}\n\n".encode()
        finally:
            await upstream.aclose()

    response = StreamingResponse(body(), status_code=upstream.status_code,
                                 background=BackgroundTask(upstream.aclose))
    response.raw_headers = [
        (k, v) for k, v in upstream.headers.raw if k.lower() not in _HOP_BY_HOP
    ] + [(p.HEADER_ROUTER.lower().encode(), name.encode())]
    return response


def serve_front(settings: FrontSettings) -> None:
    """Run the front in the foreground until interrupted."""
    import uvicorn

    from kvtether.router import SERVER_KEEP_ALIVE_S

    uvicorn.run(create_front_app(settings), host=settings.host, port=settings.port,
                log_level="warning", timeout_graceful_shutdown=5,
                timeout_keep_alive=SERVER_KEEP_ALIVE_S)
