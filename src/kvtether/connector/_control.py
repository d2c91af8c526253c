"""The control channel: a small HTTP server inside vLLM's engine-core process.

Why HTTP on a thread of its own, in the engine-core process:

* The lease table must live where vLLM decides block lifetimes: the scheduler-side connector,
  which runs in the engine-core process. Deadlines are stamped there with
  ``time.perf_counter()``, and vLLM's NIXL handshake listener (same process) echoes that clock
  to prefill instances, so a deadline read here is directly comparable with what prefill checks.
* vLLM's API server runs in another process and offers no hook to add routes that reach the
  engine core; a second port owned by the connector needs no vLLM change.
* The engine loop must never block on the network, so requests are served by the standard
  library's HTTP server (no new dependency inside vLLM), a thread per connection, and hand
  operations to the loop through :class:`~kvtether.connector._leases.LeaseTable`, which the
  loop drains once per step. Reads (status, listings, handle long-polls) never wait for the
  loop.
* The threads are bounded: at most ``max_connections`` connections are served at once (a
  long poll holds its connection up to ``MAX_WAIT_S``); one more is answered 503
  ``too_many_connections`` and closed, so clients cannot grow the engine-core process's
  threads without limit. A connection idle (or stalled mid-request) for ``IDLE_TIMEOUT_S`` is
  closed, so an idle keep-alive client does not hold a slot forever.

Routes and bodies are the wire contract in :mod:`kvtether.protocol` (``CONTROL_API_PREFIX``).

What it trusts: with a secret (``KVTETHER_CONTROL_SECRET``, which ``kvtether stack up``
generates and gives to the router too) every request must carry ``Authorization: Bearer
<secret>``, or it gets 401 and the connection is closed before its body is read. Without one it
serves only a loopback address (see ``ConnectorSettings``). Bodies over
``kvtether_control_max_body_bytes`` get 413; every error is OpenAI-style JSON.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

from pydantic import ValidationError

from kvtether.connector._leases import (
    Gone,
    HandleResult,
    LeaseTable,
    NotFound,
    Published,
    Released,
    ReleaseResult,
    Releasing,
    Renewed,
    RenewResult,
    TooLateToRenew,
)
from kvtether.connector._settings import ConnectorSettings
from kvtether.errors import ConfigError
from kvtether.protocol import (
    CONTROL_API_PREFIX,
    ConnectorStatus,
    HandleResponse,
    LeaseInfo,
    LeaseRenewRequest,
    PrefixCacheAnswer,
    PrefixCacheQuery,
    error_body,
)
from kvtether._validation import first_field_error

__all__ = [
    "ControlServer", "MAX_CONNECTIONS", "MAX_WAIT_S", "Reply", "lease_reply", "render_metrics",
    "start_control_server",
]

logger = logging.getLogger(__name__)

_M = TypeVar("_M", LeaseRenewRequest, PrefixCacheQuery)

MAX_WAIT_S = 60.0
MAX_CONNECTIONS = 256
IDLE_TIMEOUT_S = 120.0  # longer than any long poll: a client waiting for an answer is never cut
_MAX_BODY_BYTES = 2 * 1024 * 1024
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found",
                405: "invalid_request_error", 411: "invalid_request_error",
                413: "invalid_request_error", 414: "invalid_request_error"}


@dataclass(frozen=True)
class Reply:
    """An HTTP answer: status code and JSON body."""

    status: int
    body: dict[str, Any]


def lease_reply(
    result: LeaseInfo | RenewResult | ReleaseResult | HandleResult, *, missing: str = "lease"
) -> Reply:
    """The HTTP answer to a lease table's result (``missing``: what a 404 says is absent)."""
    match result:
        case LeaseInfo():
            return Reply(200, result.model_dump(mode="json"))
        case Renewed(info) | Released(info):
            return Reply(200, info.model_dump(mode="json"))
        case Releasing(info):
            return Reply(202, info.model_dump(mode="json"))
        case Published(key, info, params):
            body = HandleResponse(key=key, lease=info, kv_transfer_params=params)
            return Reply(200, body.model_dump(mode="json"))
        case Gone(state, info):
            return _lease_error(410, f"lease {info.key!r} is {state.value}", state.value, info)
        case TooLateToRenew(remaining_s, info):
            return _lease_error(410, f"lease {info.key!r} expires in {remaining_s:.3f}s, too "
                                "late to renew", "expiring", info)
        case NotFound(key):
            what = "handle published under" if missing == "handle" else "lease"
            return _lease_error(404, f"no {what} {key!r}", "not_found")
    raise TypeError(f"not a lease table result: {result!r}")


def _lease_error(status: int, message: str, code: str, info: LeaseInfo | None = None) -> Reply:
    body = error_body(message, "kvtether_lease_error", code=code)
    if info is not None:
        body["lease"] = info.model_dump(mode="json")
    return Reply(status, body)


class ControlServer:
    """Serves ``/kvtether/v1/...`` for one engine until :meth:`close`."""

    def __init__(
        self,
        table: LeaseTable,
        status: Callable[[], ConnectorStatus],
        host: str,
        port: int,
        *,
        secret: str | None = None,
        max_body_bytes: int = _MAX_BODY_BYTES,
        prefix_cache: Callable[[list[int]], PrefixCacheAnswer | None] = lambda ids: None,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self._httpd = _Server((host, port), _Handler, max_connections=max_connections)
        self._httpd.table = table
        self._httpd.status = status
        self._httpd.prefix_cache = prefix_cache
        self._httpd.secret = f"Bearer {secret}".encode() if secret else None
        self._httpd.max_body_bytes = max_body_bytes
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
            name="kvtether-control", daemon=True,
        )

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def start(self) -> None:
        self._thread.start()
        logger.info("kvtether control channel on http://%s:%d%s (%s)",
                    self._httpd.server_address[0], self.port, CONTROL_API_PREFIX,
                    "shared secret required" if self._httpd.secret else
                    "no secret: loopback only")

    def close(self) -> None:
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout=5)
        self._httpd.server_close()


def start_control_server(
    settings: ConnectorSettings,
    data_parallel_index: int,
    table: LeaseTable,
    status: Callable[[], ConnectorStatus],
    prefix_cache: Callable[[list[int]], PrefixCacheAnswer | None],
) -> ControlServer | None:
    """The engine's control channel, serving; ``None`` when no port is set."""
    if settings.control_port is None:
        return None
    # Like the NIXL side channel: one port per data-parallel rank.
    port = settings.control_port + data_parallel_index
    host = settings.control_host
    secret = settings.control_secret
    try:
        server = ControlServer(
            table, status, host, port,
            secret=secret.get_secret_value() if secret else None,
            max_body_bytes=settings.control_max_body_bytes,
            prefix_cache=prefix_cache,
        )
    except OSError as exc:
        raise ConfigError(
            f"kvtether control channel cannot listen on {host}:{port} ({exc}); "
            "set kv_connector_extra_config.kvtether_control_port to a free port"
        ) from exc
    server.start()
    return server


class _Server(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once; the next is refused."""

    daemon_threads = True
    allow_reuse_address = True
    table: LeaseTable
    status: Callable[[], ConnectorStatus]
    # The engine's prefix-cache lookup (None: this engine cannot answer); a read, off the loop.
    prefix_cache: Callable[[list[int]], PrefixCacheAnswer | None]
    secret: bytes | None  # the whole expected Authorization value
    max_body_bytes: int

    def __init__(self, address: tuple[str, int], handler: type[_Handler], *,
                 max_connections: int) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        super().__init__(address, handler)
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request: socket.socket) -> None:
        """503 on the listener's thread, without a handler thread: read what the client sent
        (closing over unread bytes would reset the connection before it reads the answer),
        answer, close."""
        body = json.dumps(error_body(
            f"the control channel serves at most {self.max_connections} connections at once; "
            "retry shortly", "server_error", code="too_many_connections")).encode()
        head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
        try:
            request.settimeout(0.05)
            try:
                request.recv(65536)
            except OSError:
                pass  # nothing sent yet
            request.sendall(head.encode() + body)
        except OSError:
            logger.debug("control channel: refusing a connection failed", exc_info=True)
        finally:
            self.shutdown_request(request)
        logger.warning("kvtether control channel: %d connections open; refused one more",
                       self.max_connections)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY on every connection. A reply goes out in two writes, the headers then the
    # body; with Nagle's algorithm the body would wait for the client to acknowledge the
    # headers, which a keep-alive client delays by up to 40 ms (delayed ACK), and the router
    # awaits some of these calls before a turn's decode request.
    disable_nagle_algorithm = True
    timeout = IDLE_TIMEOUT_S

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")

    def do_PUT(self) -> None:  # noqa: N802 - no such route, but a JSON 404, not http.server's 501
        self._dispatch("PUT")

    def do_PATCH(self) -> None:  # noqa: N802
        self._dispatch("PATCH")

    def do_OPTIONS(self) -> None:  # noqa: N802
        self._dispatch("OPTIONS")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        logger.debug("control %s - " + format, self.address_string(), *args)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (malformed request line, headers too long): JSON too."""
        self.close_connection = True
        text = message or self.responses.get(code, ("request refused",))[0]
        self._json(Reply(code, error_body(text, _ERROR_TYPES.get(code, "invalid_request_error"))))

    def _dispatch(self, method: str) -> None:
        self._raw = b""
        try:
            self._check_secret()
            self._raw = self._read_body()
            self._route(method)
        except _Refused as exc:
            if exc.close:  # never reopen a connection the client asked to close
                self.close_connection = True
            self._json(Reply(exc.status, error_body(
                str(exc), _ERROR_TYPES.get(exc.status, "invalid_request_error"), code=exc.code)))
        except Exception:  # keep the listener alive whatever a handler does
            logger.exception("kvtether control channel: %s %s failed", method, self.path)
            self._json(Reply(500, error_body("internal error", "server_error")))

    def _check_secret(self) -> None:
        expected = self.server.secret
        if expected is None:
            return
        given = (self.headers.get("Authorization") or "").strip().encode("latin-1", "replace")
        if not hmac.compare_digest(given, expected):
            # Its body is not read: close the connection instead of parsing the rest.
            raise _Refused(401, "missing or wrong control-channel secret: send 'Authorization: "
                                "Bearer <KVTETHER_CONTROL_SECRET>'", code="invalid_control_secret",
                           close=True)

    def _read_body(self) -> bytes:
        """The whole body, read before routing so a kept-alive connection stays in step."""
        if self.headers.get("Transfer-Encoding"):
            raise _Refused(411, "send the body with a Content-Length", close=True)
        length_text = (self.headers.get("Content-Length") or "0").strip()
        if not length_text.isdigit():
            raise _Refused(400, "Content-Length must be a non-negative integer", close=True)
        length = int(length_text)
        if length > self.server.max_body_bytes:
            raise _Refused(413, f"body larger than {self.server.max_body_bytes} bytes",
                           code="request_too_large", close=True)
        return self.rfile.read(length) if length else b""

    def _route(self, method: str) -> None:
        url = urlsplit(self.path)
        if not url.path.startswith(CONTROL_API_PREFIX + "/"):
            return self._json(Reply(404, error_body(f"no route {url.path}", "not_found")))
        parts = [unquote(p) for p in url.path[len(CONTROL_API_PREFIX) + 1 :].split("/")]
        table = self.server.table
        match method, parts:
            case "GET", ["status"]:
                return self._json(Reply(200, self.server.status().model_dump(mode="json")))
            case "GET", ["metrics"]:
                return self._text(render_metrics(self.server.status()))
            case "GET", ["leases"]:
                return self._json(Reply(200, table.leases().model_dump(mode="json")))
            case "GET", ["leases", key]:
                return self._json(lease_reply(table.lease(key)))
            case "DELETE", ["leases", key]:
                wait_s = _wait_s(url.query, default=None)
                return self._json(lease_reply(table.release(key, wait_s)))
            case "POST", ["leases", key, "renew"]:
                body = self._body(LeaseRenewRequest)
                return self._json(lease_reply(table.renew(key, body.ttl_s)))
            case "GET", ["handles", key]:
                result = table.handle(key, _wait_s(url.query))
                return self._json(lease_reply(result, missing="handle"))
            case "POST", ["prefix-cache"]:
                query = self._body(PrefixCacheQuery)
                answer = self.server.prefix_cache(query.token_ids)
                if answer is None:
                    return self._json(Reply(501, error_body(
                        "this engine cannot look up its prefix cache (it needs "
                        "--scheduler-cls kvtether.connector.scheduler.TetherScheduler or "
                        "IdleSleepScheduler, "
                        "prefix caching on, and one KV cache group)", "server_error",
                        code="not_supported")))
                return self._json(Reply(200, answer.model_dump(mode="json")))
        return self._json(Reply(404, error_body(f"no route {method} {url.path}", "not_found")))

    def _body(self, model: type[_M]) -> _M:
        try:
            return model.model_validate_json(self._raw or b"{}")
        except ValidationError as exc:
            raise _BadRequest(f"invalid body: {first_field_error(exc)}") from None

    def _json(self, reply: Reply) -> None:
        self._send(reply.status, json.dumps(reply.body).encode(), "application/json")

    def _text(self, text: str) -> None:
        self._send(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

    def _send(self, status: int, payload: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(payload)


class _Refused(Exception):
    """Answer with ``status`` and this message (OpenAI-style JSON)."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.close = close  # the rest of the request was not read: end the connection


class _BadRequest(_Refused):
    def __init__(self, message: str) -> None:
        super().__init__(400, message)


def _wait_s(query: str, default: float | None = 0.0) -> float | None:
    values = parse_qs(query).get("wait_s")
    if not values:
        return default
    try:
        wait = float(values[0])
    except ValueError:
        raise _BadRequest(f"wait_s must be a number of seconds, got {values[0]!r}") from None
    if not math.isfinite(wait) or wait < 0:
        raise _BadRequest(f"wait_s must be >= 0, got {values[0]!r}")
    return min(wait, MAX_WAIT_S)


_GAUGES = {
    "active_leases": "Leases on decode-held KV that are active.",
    "retained_blocks": "KV blocks held for leases (active or being released).",
    "retained_tokens": "Tokens of KV held for leases (active or being released).",
}


def render_metrics(status: ConnectorStatus) -> str:
    """Prometheus text exposition of a status snapshot."""
    label = f'{{engine_id="{status.engine_id}"}}'
    lines: list[str] = []
    totals = status.totals.model_dump()
    for name, help_text in _GAUGES.items():
        metric = f"kvtether_connector_{name}"
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge",
                  f"{metric}{label} {totals[name]}"]
    for name, value in sorted(status.counters.items()):
        metric = f"kvtether_connector_{name}_total"
        lines += [f"# TYPE {metric} counter", f"{metric}{label} {value}"]
    return "\n".join(lines) + "\n"
