"""The HTTP clients a session uses for the router's session API (heartbeat, release, status).

A slot opens its client on first use, so a session that never calls the session API opens
none, and closes only a client it opened (a client the caller passed in stays the caller's).
"""

from __future__ import annotations

import functools
import ssl
import threading
from collections.abc import Callable
from typing import Any

import httpx

__all__ = ["ClientSlot", "AsyncClientSlot", "client_options"]

Options = Callable[[], dict[str, Any]]


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    # Loading CA certificates parses the whole bundle: pay it once per process, not per session.
    return httpx.create_ssl_context()


def client_options(base_url: str | None, timeout_s: float) -> dict[str, Any]:
    # Plain-http routers (the usual case next to vLLM) need no certificates at all.
    https = (base_url or "").startswith("https:")
    return {"timeout": timeout_s, "verify": _ssl_context() if https else False}


class ClientSlot:
    """A blocking ``httpx.Client``, opened on first use. Heartbeat threads share it: locked."""

    def __init__(self, options: Options, client: httpx.Client | None = None) -> None:
        self._options = options  # read when the client opens: base_url may come later
        self._client = client
        self._owned = client is None
        self._lock = threading.Lock()

    def get(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                self._client = httpx.Client(**self._options())
            return self._client

    def get_once(self, url: str, headers: dict[str, str] | None = None) -> httpx.Response:
        """GET on the open client, or on a temporary one, so a query leaves no client open."""
        with self._lock:
            client = self._client
        if client is not None:
            return client.get(url, headers=headers)
        with httpx.Client(**self._options()) as temporary:
            return temporary.get(url, headers=headers)

    def close(self) -> None:
        with self._lock:
            if self._owned and self._client is not None:
                self._client.close()
                self._client = None


class AsyncClientSlot:
    """The ``httpx.AsyncClient`` twin of ``ClientSlot``, used from one event loop."""

    def __init__(self, options: Options, client: httpx.AsyncClient | None = None) -> None:
        self._options = options
        self._client = client
        self._owned = client is None

    def get(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(**self._options())
        return self._client

    async def get_once(self, url: str, headers: dict[str, str] | None = None) -> httpx.Response:
        """See ``ClientSlot.get_once``."""
        if self._client is not None:
            return await self._client.get(url, headers=headers)
        async with httpx.AsyncClient(**self._options()) as temporary:
            return await temporary.get(url, headers=headers)

    async def aclose(self) -> None:
        if self._owned and self._client is not None:
            await self._client.aclose()
            self._client = None
