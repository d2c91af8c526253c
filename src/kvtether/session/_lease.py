"""The client's view of its lease on the router, and the session API's URLs and answers."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from urllib.parse import quote

import httpx

from kvtether.errors import (
    RouterUnavailableError,
    SessionError,
    SessionGoneError,
    SessionNotFoundError,
)
from kvtether.protocol import SessionStatus

__all__ = [
    "API_KEY_ENV", "LeaseState", "auth_headers", "session_url", "delete_at_exit", "parse_status",
    "unavailable",
]

# The router's API key when a session is given none (then: the wrapped client's).
API_KEY_ENV = "KVTETHER_API_KEY"

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LeaseState:
    """Plain fields; ``SessionState`` owns one and guards it with its lock."""

    conversation_id: str
    base_url: str | None
    timeout_s: float
    # A turn went through a kvtether router (it answered with X-KVTether-Reuse), so decode may
    # hold KV for this conversation. Heartbeats and release only make sense after that.
    has_lease: bool = False
    released: bool = False
    kv_gone: bool = False
    lease_remaining_s: float | None = None
    api_key: str | None = None  # sent as "Authorization: Bearer" on session API calls


def auth_headers(state: LeaseState) -> dict[str, str]:
    return {"Authorization": f"Bearer {state.api_key}"} if state.api_key else {}


def session_url(state: LeaseState, suffix: str = "") -> str | None:
    if state.base_url is None:
        return None
    return f"{state.base_url}/v1/sessions/{quote(state.conversation_id, safe='')}{suffix}"


def delete_at_exit(url: str, timeout_s: float, headers: dict[str, str] | None = None) -> bool:
    """Release from a finalizer: True if the router no longer holds the KV. Never raises."""
    try:
        # Plain-http routers need no CA certificates, which take long to load.
        verify = url.startswith("https:")
        with httpx.Client(timeout=timeout_s, verify=verify) as client:
            response = client.delete(url, headers=headers)
        return response.status_code in (200, 204, 404)
    except Exception:  # noqa: BLE001 - at interpreter exit anything may be half torn down
        return False


def parse_status(conversation_id: str, response: httpx.Response) -> SessionStatus:
    """``GET /v1/sessions/{id}`` response → ``SessionStatus``, or the matching exception."""
    cid = conversation_id
    if response.status_code == 200:
        return SessionStatus.model_validate_json(response.content)
    message = _error_message(response)
    if response.status_code == 404:
        raise SessionNotFoundError(
            f"the router holds no state for conversation {cid!r}: {message}",
            conversation_id=cid,
            status_code=404,
        )
    if response.status_code == 410:
        raise SessionGoneError(
            f"the KV of conversation {cid!r} is gone: {message}",
            conversation_id=cid,
            status_code=410,
        )
    raise SessionError(
        f"session status for {cid!r} failed with HTTP {response.status_code}: {message}",
        conversation_id=cid,
        status_code=response.status_code,
    )


def unavailable(base_url: str | None, exc: httpx.HTTPError) -> RouterUnavailableError:
    return RouterUnavailableError(
        f"the kvtether router at {base_url} did not answer ({type(exc).__name__}: {exc}); "
        "check that it runs and that base_url points at it"
    )


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200] or response.reason_phrase
