"""The two calls a hook makes to the router's session API, and what came back.

Standard library only (``urllib``): a hook is a short process per harness event, and httpx
takes longer to import than the call itself takes on loopback. Nothing here raises: a router
that is down, slow or says no is an answer like any other (``Reply.status`` ``None``: no answer).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from kvtether.harness._settings import HookSettings

__all__ = ["Reply", "RouterClient", "TOOL_RUNNING"]

logger = logging.getLogger(__name__)

# kvtether.protocol.Phase.TOOL_RUNNING (the protocol package imports pydantic: see _settings).
TOOL_RUNNING = "tool_running"
_MAX_TOOL_NAME = 200  # HeartbeatRequest.tool_name's limit


@dataclass(frozen=True)
class Reply:
    status: int | None  # None: no answer (refused, timed out, not HTTP)
    body: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def final(self) -> bool:
        """The router answered no for good (404 unknown, 410 no KV held, 409 no leases, 401,
        400, ...): asking again cannot help. 5xx and no answer may pass."""
        return self.status is not None and 400 <= self.status < 500


class RouterClient:
    def __init__(self, settings: HookSettings) -> None:
        self.settings = settings

    def heartbeat(self, conversation_id: str, tool_name: str | None = None) -> Reply:
        """``POST /v1/sessions/{id}/heartbeat`` with phase ``tool_running``; the lease length
        is the router's own (``lease_ttl_s``)."""
        body: dict[str, Any] = {"phase": TOOL_RUNNING}
        if tool_name:
            body["tool_name"] = tool_name[:_MAX_TOOL_NAME]
        return self._call("POST", conversation_id, "/heartbeat", body)

    def release(self, conversation_id: str) -> Reply:
        """``DELETE /v1/sessions/{id}``: every branch of the conversation."""
        return self._call("DELETE", conversation_id, "", None)

    def _call(self, method: str, conversation_id: str, suffix: str,
              body: dict[str, Any] | None) -> Reply:
        import urllib.error
        import urllib.request

        url = f"{self.settings.router_url}/v1/sessions/{quote(conversation_id, safe='')}{suffix}"
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self.settings.api_key:
            headers["Authorization"] = f"Bearer {self.settings.api_key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.settings.request_timeout_s) as r:
                return Reply(r.status, _json(r.read()))
        except urllib.error.HTTPError as exc:
            with exc:
                return Reply(exc.code, _json(_read(exc)))
        except Exception as exc:  # refused, timed out, cut off, a URL that is not http(s)
            logger.debug("kvtether router %s: %s", self.settings.router_url, exc)
            return Reply(None)


def _read(exc: Any) -> bytes:
    try:
        return bytes(exc.read())
    except Exception:  # the error's body was cut off: its status says enough
        return b""


def _json(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
