"""``Session`` and ``AsyncSession``: hand-written twins over ``BaseSession``.

They differ only in how they talk to the router's session API (heartbeat, release, status):
``Session`` with a blocking ``httpx.Client`` and heartbeat threads, ``AsyncSession`` with an
``httpx.AsyncClient`` and heartbeat tasks (threads still serve sync tools, which would block
the event loop a task runs on). Everything else is in ``BaseSession`` and ``SessionState``.
"""

from __future__ import annotations

from types import TracebackType
from typing import TypeVar

import httpx

from kvtether.protocol import SessionStatus
from kvtether.session._base import BaseSession
from kvtether.session._heartbeat import Beat, HeartbeatPlan, TaskHeartbeat
from kvtether.session._http import AsyncClientSlot, client_options
from kvtether.session._settings import SessionSettings

__all__ = ["Session", "AsyncSession"]

S = TypeVar("S", bound=BaseSession)

# A failed release: no answer, or the client was already closed (RuntimeError).
_RELEASE_ERRORS = (httpx.HTTPError, RuntimeError)


def _failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Session(BaseSession):
    """One agent conversation, tethered to its KV on a kvtether router (sync I/O).

    ``base_url`` is the router's root (``http://host:8000`` or ``.../v1``); when omitted it is
    taken from the first client passed to ``wrap()``. ``conversation_id`` defaults to a new
    random id; use ``Session.from_thread_id(thread_id)`` to derive a stable one.
    ``http_client``: an ``httpx.Client`` for the session API calls (kept open on ``close()``).
    ``api_key``: the router's API key, sent on heartbeats, status and release (default: env
    ``KVTETHER_API_KEY``, else the ``api_key`` of the first client passed to ``wrap()``).
    Its constructor is ``BaseSession``'s.
    """

    def status(self) -> SessionStatus:
        """Where the conversation's KV is and its lease, as the router sees it.

        Raises ``SessionNotFoundError``, ``SessionGoneError`` or ``RouterUnavailableError``.
        """
        url = self._status_url()
        try:
            response = self._http.get_once(url, self._state.auth_headers())
        except httpx.HTTPError as exc:
            raise self._state.unavailable(exc) from exc
        return self._state.parse_status(response)

    def close(self) -> None:
        """Release the conversation's KV on the router. Never raises; safe to call twice."""
        if (url := self._state.release_url()) is not None:
            try:
                response = self._http.get().delete(url, headers=self._state.auth_headers())
            except _RELEASE_ERRORS as exc:
                self._state.release_answered(None, _failure(exc))
            else:
                self._state.release_answered(response.status_code, f"HTTP {response.status_code}")
        self._http.close()

    def __enter__(self: S) -> S:
        return self

    def __exit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncSession(BaseSession):
    """The async twin of ``Session``: ``async with AsyncSession(...)``, ``await aclose()``."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        conversation_id: str | None = None,
        settings: SessionSettings | None = None,
        http_client: httpx.AsyncClient | None = None,
        api_key: str | None = None,
        parent_id: str | None = None,
    ) -> None:
        super().__init__(base_url, conversation_id=conversation_id, settings=settings,
                         api_key=api_key, parent_id=parent_id)
        state = self._state
        self._ahttp = AsyncClientSlot(
            lambda: client_options(state.base_url, state.settings.request_timeout_s), http_client
        )

    def _start_heartbeat(self, plan: HeartbeatPlan, in_task: bool) -> Beat:
        if in_task:
            return TaskHeartbeat(plan, self._ahttp.get, self._heartbeat_name())
        return super()._start_heartbeat(plan, in_task)

    async def status(self) -> SessionStatus:
        """See ``Session.status``."""
        url = self._status_url()
        try:
            response = await self._ahttp.get_once(url, self._state.auth_headers())
        except httpx.HTTPError as exc:
            raise self._state.unavailable(exc) from exc
        return self._state.parse_status(response)

    async def aclose(self) -> None:
        """Release the conversation's KV on the router. Never raises; safe to call twice."""
        if (url := self._state.release_url()) is not None:
            try:
                response = await self._ahttp.get().delete(url, headers=self._state.auth_headers())
            except _RELEASE_ERRORS as exc:
                self._state.release_answered(None, _failure(exc))
            else:
                self._state.release_answered(response.status_code, f"HTTP {response.status_code}")
        await self._ahttp.aclose()
        self._http.close()  # the heartbeat threads' client

    async def __aenter__(self: S) -> S:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
