"""``session.wrap(OpenAI(...))``: the OpenAI SDK's documented ``http_client`` hook.

The wrapped client is ``client.with_options(http_client=...)`` with an HTTP client whose
transport tags each chat/completions request and reads each response on its way to the SDK,
then hands the request to the *original* HTTP client. So proxies, TLS settings, connection
limits, auth and event hooks of the caller's client all still apply, and the connection pool
is shared. openai 2.x uses ``httpx``; openai 3.x uses ``httpx2`` (and also accepts ``httpx``):
the transport is built for whichever module the client's HTTP client comes from.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvtether.errors import ConfigError
from kvtether.protocol import HEADER_CONVERSATION_ID, HEADER_HINTS, HEADER_PARENT_CONVERSATION_ID
from kvtether.session._exchange import Endpoint, Exchange

if TYPE_CHECKING:
    from kvtether.session._state import SessionState

__all__ = ["wrap_client"]

_USAGE_OPTION = b'"stream_options":{"include_usage":true}'
_DROPPED_RESPONSE_HEADERS = frozenset({"content-encoding", "content-length"})
_RETRY_HEADER = "x-stainless-retry-count"  # set by the OpenAI SDK on its own retries


def _endpoint(request: Any) -> Endpoint | None:
    if request.method != "POST":
        return None
    path: str = request.url.path
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/completions"):
        return "completions"
    return None


def _with_usage(body_bytes: bytes, body: dict[str, Any]) -> bytes | None:
    """The body asking for a final usage chunk, or None if the caller already asked."""
    if "stream_options" not in body:
        # Splice instead of re-serializing: agent prompts run to megabytes.
        head = body_bytes.rstrip()[:-1].rstrip()
        return head + (b"," if not head.endswith(b"{") else b"") + _USAGE_OPTION + b"}"
    options = body["stream_options"]
    if isinstance(options, dict) and options.get("include_usage"):
        return None
    body["stream_options"] = {
        **(options if isinstance(options, dict) else {}),
        "include_usage": True,
    }
    return json.dumps(body, ensure_ascii=False).encode()


# Which session a request belongs to, asked once per chat/completions request.
PickState = Callable[[], "SessionState"]


def _prepare(pick: PickState, request: Any, mod: ModuleType) -> tuple[Any, Exchange] | None:
    """Tag a chat/completions request; None for anything the session does not follow."""
    endpoint = _endpoint(request)
    if endpoint is None:
        return None
    try:
        body_bytes: bytes = request.content
        body = json.loads(body_bytes)
    except (mod.RequestNotRead, ValueError):
        return None
    if not isinstance(body, dict):
        return None
    new_body = _with_usage(body_bytes, body) if body.get("stream") else None
    state = pick()
    retry = request.headers.get(_RETRY_HEADER, "0")
    ex = state.begin(
        endpoint,
        body,
        len(body_bytes),
        injected_usage=new_body is not None,
        retry=int(retry) if retry.isdigit() else 0,
    )
    if new_body is not None:
        headers = [(k, v) for k, v in request.headers.multi_items() if k != "content-length"]
        request = mod.Request(
            request.method,
            request.url,
            headers=headers,
            content=new_body,
            extensions=request.extensions,
        )
    request.headers[HEADER_CONVERSATION_ID] = state.conversation_id
    if state.parent_id is not None:
        request.headers[HEADER_PARENT_CONVERSATION_ID] = state.parent_id
    if ex.hints is not None and state.settings.send_hints:
        request.headers[HEADER_HINTS] = ex.hints.model_dump_json(exclude_none=True)
    return request, ex


def _response(mod: ModuleType, response: Any, stream: Any) -> Any:
    # The body is handed on decoded (the exchange must read it), so encoding headers go.
    headers = [
        (k, v)
        for k, v in response.headers.multi_items()
        if k.lower() not in _DROPPED_RESPONSE_HEADERS
    ]
    return mod.Response(
        response.status_code, headers=headers, stream=stream, extensions=response.extensions
    )


@functools.cache
def _streams(mod: ModuleType) -> tuple[type, type]:
    """Response body streams for ``httpx`` or ``httpx2`` that feed each chunk to the request's
    exchange on its way to the SDK, and end the exchange when the body ends or is closed."""

    class SyncStream(mod.SyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, response: Any, ex: Exchange) -> None:
            self._response, self._ex = response, ex
            # One iterator for the body, resumed by every iteration: SDKs read up to the end
            # of the SSE stream, then iterate again to drain the rest for connection reuse.
            self._chunks: Any = None

        def __iter__(self) -> Iterator[bytes]:
            if self._chunks is None:
                self._chunks = self._response.iter_bytes()
            try:
                for chunk in self._chunks:
                    if out := self._ex.feed(chunk):
                        yield out
                if tail := self._ex.flush():
                    yield tail
            except BaseException as exc:
                self._ex.end(completed=False, error=exc if isinstance(exc, Exception) else None)
                raise
            self._ex.end(completed=True)

        def close(self) -> None:
            try:
                self._response.close()
            finally:
                self._ex.end(completed=False)

    class AsyncStream(mod.AsyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, response: Any, ex: Exchange) -> None:
            self._response, self._ex = response, ex
            # One iterator for the body, resumed by every iteration: SDKs read up to the end
            # of the SSE stream, then iterate again to drain the rest for connection reuse.
            self._chunks: Any = None

        async def __aiter__(self) -> AsyncIterator[bytes]:
            if self._chunks is None:
                self._chunks = self._response.aiter_bytes()
            try:
                async for chunk in self._chunks:
                    if out := self._ex.feed(chunk):
                        yield out
                if tail := self._ex.flush():
                    yield tail
            except BaseException as exc:
                self._ex.end(completed=False, error=exc if isinstance(exc, Exception) else None)
                raise
            self._ex.end(completed=True)

        async def aclose(self) -> None:
            try:
                await self._response.aclose()
            finally:
                self._ex.end(completed=False)

    return SyncStream, AsyncStream


@functools.cache
def _transports(mod: ModuleType) -> tuple[type, type]:
    """Transport classes for ``httpx`` or ``httpx2`` (same API, distinct base classes)."""
    SyncStream, AsyncStream = _streams(mod)

    class SyncTransport(mod.BaseTransport):  # type: ignore[name-defined,misc]
        def __init__(self, pick: PickState, inner: Any, owner: object) -> None:
            self._pick, self.inner = pick, inner
            self._owner = owner  # see wrap_client

        def handle_request(self, request: Any) -> Any:
            prepared = _prepare(self._pick, request, mod)
            if prepared is None:
                return self.inner.send(request, stream=True)
            request, ex = prepared
            try:
                response = self.inner.send(request, stream=True)
            except BaseException as exc:
                ex.end(completed=False, error=exc)
                raise
            ex.on_headers(response.status_code, response.headers)
            return _response(mod, response, SyncStream(response, ex))

    class AsyncTransport(mod.AsyncBaseTransport):  # type: ignore[name-defined,misc]
        def __init__(self, pick: PickState, inner: Any, owner: object) -> None:
            self._pick, self.inner = pick, inner
            self._owner = owner  # see wrap_client

        async def handle_async_request(self, request: Any) -> Any:
            prepared = _prepare(self._pick, request, mod)
            if prepared is None:
                return await self.inner.send(request, stream=True)
            request, ex = prepared
            try:
                response = await self.inner.send(request, stream=True)
            except BaseException as exc:
                ex.end(completed=False, error=exc)
                raise
            ex.on_headers(response.status_code, response.headers)
            return _response(mod, response, AsyncStream(response, ex))

    return SyncTransport, AsyncTransport


def _http_module(http_client: Any) -> ModuleType | None:
    for name in ("httpx2", "httpx"):
        mod = sys.modules.get(name)
        if mod is not None and isinstance(http_client, (mod.Client, mod.AsyncClient)):
            return mod
    return None


def wrap_client(pick: PickState, client: Any, owner: object) -> Any:
    """``client`` with each chat/completions request reported into the state ``pick()`` returns
    for it (one session's, or the one a session pool resolves per request).

    ``owner`` (the session or pool) is only held: while the wrapped client is in use, its
    sessions must not be collected, or their exit finalizer would release the KV mid-conversation.
    """
    # openai 2.x and 3.x both keep their HTTP client in `_client`; `with_options` is public.
    inner: Any = getattr(client, "_client", None)
    mod = _http_module(inner)
    if mod is None or not callable(getattr(client, "with_options", None)):
        raise ConfigError(
            f"session.wrap() expects an openai.OpenAI or openai.AsyncOpenAI client, got "
            f"{type(client).__module__}.{type(client).__qualname__}"
        )
    # Wrapping a wrapped client re-targets it instead of tagging every request twice.
    inner = getattr(inner, "_kvtether_inner", inner)
    sync_transport, async_transport = _transports(mod)
    is_async = isinstance(inner, mod.AsyncClient)
    transport = (async_transport if is_async else sync_transport)(pick, inner, owner)
    outer = (mod.AsyncClient if is_async else mod.Client)(
        transport=transport,
        headers=inner.headers,
        timeout=inner.timeout,
        follow_redirects=False,  # the inner client follows redirects, as configured
        trust_env=False,  # proxies from the environment are the inner client's business
    )
    outer._kvtether_inner = inner
    return client.with_options(http_client=outer)
