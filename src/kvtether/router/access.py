"""Who may call the router, as which tenant, and how large a request may be.

API keys come from ``--api-key`` (tenant ``default``) and ``--api-key-file`` (one
``tenant key`` pair per line; blank lines and ``#`` comments are skipped). With no key the
router serves one anonymous tenant and checks nothing. Each request's tenant is put in the
ASGI scope, where the routes read it (:func:`tenant_of`): conversations are keyed by
(tenant, conversation id), so another tenant's id is simply an unknown one.

:class:`AccessMiddleware` runs before routing: a missing or wrong key is a 401, a body over
``max_request_body_bytes`` a 413 (by ``Content-Length`` at once, or while a body without one
is read), both as OpenAI-style JSON.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Callable
from pathlib import Path

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvtether.errors import ConfigError
from kvtether.router._errors import RouterHTTPError, error_response, is_anthropic_path
from kvtether.router.settings import AccessSettings

__all__ = ["ANONYMOUS_TENANT", "DEFAULT_TENANT", "AccessMiddleware", "KeyRing", "tenant_of"]

ANONYMOUS_TENANT = ""  # the one tenant of a router without keys
DEFAULT_TENANT = "default"  # the tenant of --api-key
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}")
_SCOPE_KEY = "kvtether_tenant"
# Always open: load balancers and `stack up` probe it without credentials.
_OPEN_PATHS = frozenset({"/health"})


class KeyRing:
    """API key → tenant. Empty: no authentication."""

    def __init__(self, keys: dict[str, str] | None = None) -> None:
        self._keys = [(k.encode(), tenant) for k, tenant in (keys or {}).items()]

    @classmethod
    def from_settings(cls, settings: AccessSettings) -> KeyRing:
        keys: dict[str, str] = {}
        if settings.api_key_file is not None:
            keys.update(read_key_file(settings.api_key_file))
        if settings.api_key is not None:
            key = settings.api_key.get_secret_value().strip()
            if not key:
                raise ConfigError("--api-key is empty; give a key or leave it unset")
            if keys.get(key, DEFAULT_TENANT) != DEFAULT_TENANT:
                raise ConfigError("--api-key is also in --api-key-file under another tenant")
            keys[key] = DEFAULT_TENANT
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant of an ``Authorization: Bearer <key>`` header, or None if not a key."""
        if not self._keys:
            return ANONYMOUS_TENANT
        if not authorization:
            return None
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return None
        candidate = given.strip().encode("latin-1")  # the header's own bytes
        found = None
        for key, tenant in self._keys:  # compare with every key: time says nothing of which
            if hmac.compare_digest(key, candidate):
                found = tenant
        return found


def read_key_file(path: Path) -> dict[str, str]:
    """``tenant key`` lines → {key: tenant}. The messages never contain a key."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read --api-key-file {path}: {exc}") from None
    keys: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ConfigError(f"{path}:{n}: expected 'tenant key', got {len(parts)} field(s)")
        tenant, key = parts
        if not _TENANT_NAME.fullmatch(tenant):
            raise ConfigError(f"{path}:{n}: tenant name {tenant!r} is not valid "
                              "(letters, digits, '_', '.', '@', '-'; at most 128)")
        if key in keys:
            raise ConfigError(f"{path}:{n}: this key is already listed (line of tenant "
                              f"{keys[key]!r}); each key belongs to one tenant")
        keys[key] = tenant
    if not keys:
        raise ConfigError(f"--api-key-file {path} lists no key")
    return keys


def tenant_of(request: Request) -> str:
    """The tenant :class:`AccessMiddleware` authenticated this request as."""
    return request.scope.get(_SCOPE_KEY, ANONYMOUS_TENANT)


class AccessMiddleware:
    """Authenticates every request but ``/health`` (and ``/metrics`` unless configured) and
    bounds request bodies."""

    def __init__(
        self, app: ASGIApp, *, keys: KeyRing, settings: AccessSettings,
        on_error: Callable[[int], None] = lambda status: None,
    ) -> None:
        self.app = app
        self.keys = keys
        self.max_body = settings.max_request_body_bytes
        self.open_paths = set(_OPEN_PATHS)
        if not settings.metrics_require_api_key:
            self.open_paths.add("/metrics")
        self.on_error = on_error  # counts the refusals in the router's metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        tenant = self.keys.tenant(headers.get("authorization"))
        if tenant is None and "x-api-key" in headers:  # how Anthropic's SDKs send a key
            tenant = self.keys.tenant(f"Bearer {headers['x-api-key']}")
        anthropic = is_anthropic_path(scope.get("path"))
        if tenant is None and scope.get("path") not in self.open_paths:
            self.on_error(401)
            response = error_response(
                401, "missing or invalid API key: send 'Authorization: Bearer <key>' (or "
                     "'x-api-key: <key>') with a key this router was given (--api-key / "
                     "--api-key-file)",
                code="invalid_api_key", anthropic=anthropic,
            )
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        scope[_SCOPE_KEY] = tenant or ANONYMOUS_TENANT
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            status = 413 if length.isdigit() else 400
            self.on_error(status)
            message = (self._too_large() if status == 413
                       else "Content-Length must be a non-negative integer")
            await error_response(status, message, code="request_too_large" if status == 413
                                 else None, anthropic=anthropic)(scope, receive, send)
            return
        await self.app(scope, self._bounded(receive), send)

    def _too_large(self) -> str:
        return f"request body is larger than {self.max_body} bytes (--max-request-body-bytes)"

    def _bounded(self, receive: Receive) -> Receive:
        """``receive`` that refuses a body (sent without ``Content-Length``) past the limit."""
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    # Raised inside the route, so the router's error handlers answer it.
                    raise RouterHTTPError(413, self._too_large(), code="request_too_large")
            return message

        return bounded


def _headers(scope: Scope) -> dict[str, str]:
    # Latin-1, as HTTP header bytes are: any byte decodes, no request makes this fail.
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
