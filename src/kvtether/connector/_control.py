"""The control channel: a small HTTP server inside vLLM's engine-core process.

Why HTTP on a thread of its own, in the engine-core process:

* The lease table must live where vLLM decides block lifetimes: the scheduler-side connector,
  which runs in the engine-core process. Deadlines are stamped there with
  ``time.perf_counter()``, and vLLM's NIXL handshake listener (same process) echoes that clock
  to prefill instances, so a deadline read here is directly comparable with what prefill checks.
* vLLM's API server runs in another process and offers no hook to add routes that reach the
  engine core; a second port owned by the connector needs no vLLM change.
* The engine loop must never block on the network, so requests are served by the standard
  library's ``ThreadingHTTPServer`` (no new dependency inside vLLM) and hand operations to the
  loop through :class:`~kvtether.connector._leases.LeaseTable`, which the loop drains once per
  step. Reads (status, listings, handle long-polls) never wait for the loop.

Routes and bodies are the wire contract in :mod:`kvtether.protocol` (``CONTROL_API_PREFIX``).
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from pydantic import ValidationError

from kvtether.connector._leases import LeaseTable, Reply
from kvtether.protocol import (
    CONTROL_API_PREFIX,
    ConnectorStatus,
    LeaseRenewRequest,
    error_body,
    first_field_error,
)

__all__ = ["ControlServer", "render_metrics", "MAX_WAIT_S"]

logger = logging.getLogger(__name__)

MAX_WAIT_S = 60.0
_MAX_BODY_BYTES = 64 * 1024


class ControlServer:
    """Serves ``/kvtether/v1/...`` for one engine until :meth:`close`."""

    def __init__(
        self,
        table: LeaseTable,
        status: Callable[[], ConnectorStatus],
        host: str,
        port: int,
    ) -> None:
        self._httpd = _Server((host, port), _Handler)
        self._httpd.table = table
        self._httpd.status = status
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
            name="kvtether-control", daemon=True,
        )

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def start(self) -> None:
        self._thread.start()
        logger.info("kvtether control channel on http://%s:%d%s",
                    self._httpd.server_address[0], self.port, CONTROL_API_PREFIX)

    def close(self) -> None:
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout=5)
        self._httpd.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    table: LeaseTable
    status: Callable[[], ConnectorStatus]


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        logger.debug("control %s - " + format, self.address_string(), *args)

    def _dispatch(self, method: str) -> None:
        try:
            self._route(method)
        except _BadRequest as exc:
            self._json(Reply(400, error_body(str(exc), "invalid_request_error")))
        except Exception:  # keep the listener alive whatever a handler does
            logger.exception("kvtether control channel: %s %s failed", method, self.path)
            self._json(Reply(500, error_body("internal error", "server_error")))

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
                return self._json(table.lease(key))
            case "DELETE", ["leases", key]:
                return self._json(table.release(key))
            case "POST", ["leases", key, "renew"]:
                body = self._body(LeaseRenewRequest)
                return self._json(table.renew(key, body.ttl_s))
            case "GET", ["handles", key]:
                return self._json(table.handle(key, _wait_s(url.query)))
        return self._json(Reply(404, error_body(f"no route {method} {url.path}", "not_found")))

    def _body(self, model: type[LeaseRenewRequest]) -> LeaseRenewRequest:
        length = int(self.headers.get("Content-Length") or 0)
        if length > _MAX_BODY_BYTES:
            raise _BadRequest(f"body larger than {_MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(length) if length else b"{}"
        try:
            return model.model_validate_json(raw)
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
        self.end_headers()
        self.wfile.write(payload)


class _BadRequest(ValueError):
    pass


def _wait_s(query: str) -> float:
    values = parse_qs(query).get("wait_s")
    if not values:
        return 0.0
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
