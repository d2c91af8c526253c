"""``Session`` and ``AsyncSession``: hand-written twins over ``BaseSession``.

They differ only in how they talk to the router's session API (heartbeat, release, status):
``Session`` with a blocking ``httpx.Client`` and heartbeat threads, ``AsyncSession`` with an
``httpx.AsyncClient`` and heartbeat tasks (threads still serve sync tools, which would block
the event loop a task runs on).
"""

from __future__ import annotations

import functools
import ssl
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar, overload

import httpx

from kvtether.errors import ConfigError
from kvtether.protocol import SessionStatus
from kvtether.session._base import BaseSession
from kvtether.session._heartbeat import Beat, HeartbeatPlan, TaskHeartbeat, ThreadHeartbeat
from kvtether.session._lease import parse_status, session_url, unavailable
from kvtether.session._settings import SessionSettings
from kvtether.session._tools import StepScope, ToolCall, bound_arguments, decorate

__all__ = ["Session", "AsyncSession"]

F = TypeVar("F", bound=Callable[..., Any])
S = TypeVar("S", bound="_AgentHooks")


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    # Loading CA certificates takes 10-400 ms; pay it once per process, not per session.
    return httpx.create_ssl_context()


def _client_options(session: BaseSession) -> dict[str, Any]:
    https = (session.base_url or "").startswith("https:")
    # Plain-http routers (the usual case next to vLLM) need no certificates at all.
    return {
        "timeout": session._settings.request_timeout_s,
        "verify": _ssl_context() if https else False,
    }


def _no_base_url() -> ConfigError:
    return ConfigError(
        "this session has no base_url: pass Session(base_url=...) or wrap() a client first"
    )


class _AgentHooks(BaseSession):
    """The decorators and context managers agent code uses; identical in both twins."""

    def tool_call(self, name: str, *, eta_s: float | None = None, args: Any = None) -> ToolCall:
        """``with session.tool_call("grep", eta_s=5):`` (or ``async with``) around a tool run.

        ``eta_s``: your own estimate of the duration, if you have one. ``args``: the tool's
        arguments; the first word of the first string one refines duration predictions.
        """
        return ToolCall(self, name, eta_s=eta_s, args=args)

    @overload
    def tool(self, fn: F, /) -> F: ...

    @overload
    def tool(
        self, fn: None = None, /, *, name: str | None = None, eta_s: float | None = None
    ) -> Callable[[F], F]: ...

    def tool(
        self,
        fn: Callable[..., Any] | None = None,
        /,
        *,
        name: str | None = None,
        eta_s: float | None = None,
    ) -> Any:
        """Decorate a tool: each call runs as ``tool_call(name or fn.__name__, ...)``."""

        def decorator(f: Callable[..., Any]) -> Callable[..., Any]:
            arguments = bound_arguments(f)
            tool_name = name or f.__name__
            return decorate(
                f, lambda a, kw: ToolCall(self, tool_name, eta_s=eta_s, args=arguments(a, kw))
            )

        return decorator(fn) if fn is not None else decorator

    @overload
    def step(self, fn: F, /) -> F: ...

    @overload
    def step(self, fn: None = None, /) -> Callable[[F], F]: ...

    def step(self, fn: Callable[..., Any] | None = None, /) -> Any:
        """Decorate one iteration of the agent loop; its model requests carry its number."""

        def decorator(f: Callable[..., Any]) -> Callable[..., Any]:
            return decorate(f, lambda a, kw: StepScope(self))

        return decorator(fn) if fn is not None else decorator


class Session(_AgentHooks):
    """One agent conversation, tethered to its KV on a kvtether router (sync I/O).

    ``base_url`` is the router's root (``http://host:8000`` or ``.../v1``); when omitted it is
    taken from the first client passed to ``wrap()``. ``conversation_id`` defaults to a new
    random id; use ``Session.from_thread_id(thread_id)`` to derive a stable one.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        conversation_id: str | None = None,
        settings: SessionSettings | None = None,
        http_client: httpx.Client | None = None,
    ) -> None:
        super().__init__(base_url, conversation_id=conversation_id, settings=settings)
        self._http = http_client
        self._owns_http = http_client is None
        self._http_lock = threading.Lock()

    def _client(self) -> httpx.Client:
        with self._http_lock:
            if self._http is None:
                self._http = httpx.Client(**_client_options(self))
            return self._http

    def _start_heartbeat(self, plan: HeartbeatPlan, *, in_task: bool) -> Beat:
        return ThreadHeartbeat(plan, self._client, f"kvtether-heartbeat-{self.conversation_id}")

    def status(self) -> SessionStatus:
        """Where the conversation's KV is and its lease, as the router sees it.

        Raises ``SessionNotFound``, ``SessionGone`` or ``RouterUnavailableError``.
        """
        url = session_url(self._lease)
        if url is None:
            raise _no_base_url()
        try:
            if self._http is not None:
                response = self._http.get(url)
            else:  # no client open (none yet, or after close()): leave none behind
                with httpx.Client(**_client_options(self)) as client:
                    response = client.get(url)
        except httpx.HTTPError as exc:
            raise unavailable(self._lease, exc) from exc
        return parse_status(self._lease, response)

    def close(self) -> None:
        """Release the conversation's KV on the router. Never raises; safe to call twice."""
        url = session_url(self._lease)
        if url is not None and self._lease.has_lease and not self._lease.released:
            try:
                response = self._client().delete(url)
            except (httpx.HTTPError, RuntimeError) as exc:
                self._released(None, f"{type(exc).__name__}: {exc}")
            else:
                self._released(response.status_code, f"HTTP {response.status_code}")
        with self._http_lock:
            if self._owns_http and self._http is not None:
                self._http.close()
                self._http = None

    def __enter__(self: S) -> S:
        return self

    def __exit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncSession(_AgentHooks):
    """The async twin of ``Session``: ``async with AsyncSession(...)``, ``await aclose()``."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        conversation_id: str | None = None,
        settings: SessionSettings | None = None,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(base_url, conversation_id=conversation_id, settings=settings)
        self._ahttp = http_client
        self._owns_ahttp = http_client is None
        self._http: httpx.Client | None = None  # only for heartbeats next to sync tools
        self._http_lock = threading.Lock()

    def _aclient(self) -> httpx.AsyncClient:
        if self._ahttp is None:
            self._ahttp = httpx.AsyncClient(**_client_options(self))
        return self._ahttp

    def _client(self) -> httpx.Client:
        with self._http_lock:
            if self._http is None:
                self._http = httpx.Client(**_client_options(self))
            return self._http

    def _start_heartbeat(self, plan: HeartbeatPlan, *, in_task: bool) -> Beat:
        name = f"kvtether-heartbeat-{self.conversation_id}"
        if in_task:
            return TaskHeartbeat(plan, self._aclient, name)
        return ThreadHeartbeat(plan, self._client, name)

    async def status(self) -> SessionStatus:
        """See ``Session.status``."""
        url = session_url(self._lease)
        if url is None:
            raise _no_base_url()
        try:
            if self._ahttp is not None:
                response = await self._ahttp.get(url)
            else:  # no client open (none yet, or after aclose()): leave none behind
                async with httpx.AsyncClient(**_client_options(self)) as client:
                    response = await client.get(url)
        except httpx.HTTPError as exc:
            raise unavailable(self._lease, exc) from exc
        return parse_status(self._lease, response)

    async def aclose(self) -> None:
        """Release the conversation's KV on the router. Never raises; safe to call twice."""
        url = session_url(self._lease)
        if url is not None and self._lease.has_lease and not self._lease.released:
            try:
                response = await self._aclient().delete(url)
            except (httpx.HTTPError, RuntimeError) as exc:
                self._released(None, f"{type(exc).__name__}: {exc}")
            else:
                self._released(response.status_code, f"HTTP {response.status_code}")
        if self._owns_ahttp and self._ahttp is not None:
            await self._ahttp.aclose()
            self._ahttp = None
        with self._http_lock:
            if self._http is not None:
                self._http.close()
                self._http = None

    async def __aenter__(self: S) -> S:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
