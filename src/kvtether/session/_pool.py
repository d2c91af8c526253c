"""``SessionPool`` and ``AsyncSessionPool``: one session per conversation, picked per request.

Agent frameworks run many conversations through one model client (a LangGraph ``thread_id``,
an Agents SDK conversation): the pool keeps one ``Session`` per conversation key, derived with
``Session.from_thread_id(key)`` so a key always maps to the same conversation id, and a wrapped
client asks a resolver which key each request belongs to. Tools, which frameworks run in worker
threads, find their session from the ``tool_call_id`` the model's reply gave them.

Idle sessions leave the pool (least recently used beyond ``max_sessions``, or unused for
``idle_ttl_s``) *without* releasing their KV: the conversation may come back, and its new
session has the same id, so the router keeps the KV until the lease lapses. ``close()``
releases the KV of every session still pooled. The twins differ only in that I/O; they sit
beside their shared base so that they change together, which is why this module is over
400 lines.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Hashable
from types import TracebackType
from typing import Any, Generic, TypeVar

from cachetools import LRUCache, TTLCache

from kvtether.errors import ConfigError, MissingConversationKeyWarning
from kvtether.session._base import BaseSession
from kvtether.session._lease import API_KEY_ENV
from kvtether.session._prefix import warn_at_caller
from kvtether.session._records import ToolRun
from kvtether.session._session import AsyncSession, Session
from kvtether.session._settings import SessionSettings, normalize_base_url
from kvtether.session._tools import ToolCall

__all__ = ["BasePool", "SessionPool", "AsyncSessionPool", "Resolver"]

logger = logging.getLogger(__name__)

S = TypeVar("S", bound=BaseSession)
P = TypeVar("P", bound="BasePool[Any]")

# Returns the conversation key of the request being sent (a thread id), or None if it has none.
Resolver = Callable[[], "str | None"]

# Tool-call ids remembered per pooled session: enough for many tool rounds of parallel calls;
# the index must stay bounded in a long-running server.
_TOOL_CALL_IDS_PER_SESSION = 64


class _EvictingCache(TTLCache[str, S]):
    """A ``TTLCache`` that keeps what it dropped (idle, or least recently used), so the pool
    can let those sessions go once its lock is released."""

    def __init__(self, maxsize: int, ttl: float, timer: Callable[[], float]) -> None:
        super().__init__(maxsize, ttl, timer)
        self.dropped: list[S] = []

    def expire(self, time: float | None = None) -> list[tuple[str, S]]:
        expired: list[tuple[str, S]] = list(super().expire(time))
        self.dropped.extend(session for _, session in expired)
        return expired

    def popitem(self) -> tuple[str, S]:
        key, session = super().popitem()
        self.dropped.append(session)
        return key, session


class BasePool(Generic[S]):
    """What the twins share: the cache, the default session, the tool-call index, ``wrap``.

    ``base_url``: the router's root, or taken from the first client passed to ``wrap()``.
    ``max_sessions``: sessions kept beyond this leave the pool, least recently used first.
    ``idle_ttl_s``: a session unused this long leaves the pool (None: never for idleness).
    ``namespace``: passed to ``from_thread_id``. ``settings``: every session's.
    ``api_key``: the router's API key, for every session (default: env ``KVTETHER_API_KEY``,
    else the ``api_key`` of the first client passed to ``wrap()``).
    ``timer`` (monotonic seconds) measures idle time; tests pass a fake one instead of sleeping.
    """

    _session_cls: type[S]

    def __init__(
        self,
        base_url: str | None = None,
        *,
        max_sessions: int = 1024,
        idle_ttl_s: float | None = 900.0,
        namespace: str = "kvtether",
        settings: SessionSettings | None = None,
        timer: Callable[[], float] = time.monotonic,
        api_key: str | None = None,
    ) -> None:
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ConfigError(f"max_sessions must be an integer >= 1, got {max_sessions!r}")
        if idle_ttl_s is not None and not (idle_ttl_s > 0):
            raise ConfigError(
                f"idle_ttl_s must be > 0 seconds (or None: never evict for idleness), "
                f"got {idle_ttl_s!r}"
            )
        self._base_url = None if base_url is None else normalize_base_url(base_url)
        self._namespace = namespace
        self._session_kwargs: dict[str, Any] = {"settings": settings}
        self._api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self._lock = threading.Lock()
        ttl_s = math.inf if idle_ttl_s is None else idle_ttl_s
        self._sessions: _EvictingCache[S] = _EvictingCache(max_sessions, ttl_s, timer)
        # tool_call_id -> conversation key (None: the default session).
        self._tool_calls: LRUCache[str, str | None] = LRUCache(
            max_sessions * _TOOL_CALL_IDS_PER_SESSION
        )
        self._default: S | None = None
        # Tool runs begun through begin_tool() / abegin_tool(), by the caller's run id.
        self._tool_runs: dict[Hashable, tuple[str, ToolCall, bool]] = {}
        self._warned_missing_key = False
        # Async twin only: sessions let go whose async client still needs closing on the loop.
        self._closing: list[S] = []
        self._closing_lock = threading.Lock()
        self._close_tasks: set[asyncio.Task[None]] = set()

    # --- sessions ---------------------------------------------------------------------------
    def get(self, key: str | None) -> S:
        """The session of conversation ``key`` (created on first use, the same object while it
        stays pooled). ``None``: the default session, with a warning the first time."""
        if key is None:
            self._warn_missing_key()
            return self.default
        key = str(key)  # a LangGraph thread id may be a UUID or an int
        with self._lock:
            self._sessions.expire()
            session = self._sessions.get(key)
            if session is None:
                session = self._new_session(key)
            # Set again even when present: that restarts its idle time.
            self._sessions[key] = session
            dropped = self._take_dropped()
        self._let_go(dropped)
        return session

    @property
    def default(self) -> S:
        """The session of requests that come with no conversation key (never evicted)."""
        with self._lock:
            if self._default is None:
                self._default = self._new_session(None)
            return self._default

    def session_for_tool_call(self, tool_call_id: str) -> S | None:
        """The session whose model reply asked for this tool call, or None if no pooled
        session's reply had that id. A session evicted since comes back (same conversation)."""
        with self._lock:
            if tool_call_id not in self._tool_calls:
                return None
            key = self._tool_calls[tool_call_id]
        return self.default if key is None else self.get(key)

    # --- tool runs reported by callbacks (framework hooks) ------------------------------------
    def session_for_tool(self, tool_call_id: str | None = None, key: str | None = None) -> S | None:
        """The session a tool run belongs to: the one whose model reply asked for
        ``tool_call_id``, else the session of conversation ``key``; None when neither is
        known (such a run is not followed)."""
        if tool_call_id:
            session = self.session_for_tool_call(tool_call_id)
            if session is not None:
                return session
        return None if key is None else self.get(key)

    def begin_tool(
        self, run_id: Hashable, name: str, *, tool_call_id: str | None = None,
        key: str | None = None, args: Any = None, eta_s: float | None = None,
    ) -> ToolRun | None:
        """A tool run starts (from sync code; its heartbeats run in a thread): find its session
        (:meth:`session_for_tool`), time it and keep its conversation's KV alive until
        :meth:`end_tool` with the same ``run_id``. None: no session is known for it."""
        call = self._tool_call(run_id, name, tool_call_id, key, args, eta_s, in_task=False)
        return None if call is None else call.begin()

    def end_tool(self, run_id: Hashable, error: BaseException | None = None) -> ToolRun | None:
        """The run begun as ``run_id`` ended (``error``: what it raised); None if unknown."""
        with self._lock:
            entry = self._tool_runs.get(run_id)
            if entry is not None and entry[2]:
                raise ConfigError(f"tool run {run_id!r} began with abegin_tool(): end it with "
                                  "aend_tool()")
            self._tool_runs.pop(run_id, None)
        if entry is None:
            return None
        entry[1].end(error)
        return entry[1].run

    async def abegin_tool(
        self, run_id: Hashable, name: str, *, tool_call_id: str | None = None,
        key: str | None = None, args: Any = None, eta_s: float | None = None,
    ) -> ToolRun | None:
        """:meth:`begin_tool` from a coroutine: the heartbeats run in an asyncio task."""
        call = self._tool_call(run_id, name, tool_call_id, key, args, eta_s, in_task=True)
        return None if call is None else await call.abegin()

    async def aend_tool(
        self, run_id: Hashable, error: BaseException | None = None
    ) -> ToolRun | None:
        """:meth:`end_tool` for a run begun with either method, from a coroutine."""
        entry = self._take_tool_run(run_id)
        if entry is None:
            return None
        _, call, in_task = entry
        if in_task:
            await call.aend(error)
        else:
            call.end(error)
        return call.run

    def open_tool_runs(self, conversation_id: str | None = None) -> list[Hashable]:
        """Run ids of the tool runs begun and not ended (of one conversation, if given)."""
        with self._lock:
            return [run_id for run_id, (cid, _, _) in self._tool_runs.items()
                    if conversation_id is None or cid == conversation_id]

    def _tool_call(
        self, run_id: Hashable, name: str, tool_call_id: str | None, key: str | None,
        args: Any, eta_s: float | None, *, in_task: bool,
    ) -> ToolCall | None:
        session = self.session_for_tool(tool_call_id, key)
        if session is None:
            return None
        call = session.tool_call(name, eta_s=eta_s, args=args)
        with self._lock:
            if run_id in self._tool_runs:
                raise ConfigError(f"tool run {run_id!r} has begun already; end it first")
            self._tool_runs[run_id] = (session.conversation_id, call, in_task)
        return call

    def _take_tool_run(self, run_id: Hashable) -> tuple[str, ToolCall, bool] | None:
        with self._lock:
            return self._tool_runs.pop(run_id, None)

    def _take_tool_runs(self) -> list[tuple[str, ToolCall, bool]]:
        with self._lock:
            runs, self._tool_runs = list(self._tool_runs.values()), {}
        return runs

    def __len__(self) -> int:
        """How many keyed sessions are pooled (the default session not counted)."""
        with self._lock:
            self._sessions.expire()
            dropped = self._take_dropped()
            count = len(self._sessions)
        self._let_go(dropped)
        return count

    def wrap(self, client: Any, resolver: Resolver) -> Any:
        """A copy of an ``openai.OpenAI`` / ``AsyncOpenAI`` client whose every chat and
        completion request goes to ``get(resolver())``: the resolver runs in the code sending
        the request (a context variable, a thread-local), so one client serves every thread."""
        from kvtether.session._openai import wrap_client

        if not callable(resolver):
            raise ConfigError(
                f"pool.wrap(client, resolver) needs a callable that returns the request's "
                f"conversation key (e.g. a thread id) or None, got {type(resolver).__name__}"
            )
        if self._base_url is None and getattr(client, "base_url", None) is not None:
            self._adopt_base_url(normalize_base_url(str(client.base_url)))
        if isinstance(getattr(client, "api_key", None), str) and client.api_key:
            self._adopt_api_key(client.api_key)
        return wrap_client(lambda: self.get(resolver())._state, client, owner=self)

    # --- internals --------------------------------------------------------------------------
    def _new_session(self, key: str | None) -> S:
        """Called with the lock held."""
        cls = self._session_cls
        if key is None:
            session = cls(self._base_url, api_key=self._api_key, **self._session_kwargs)
        else:
            session = cls.from_thread_id(
                key, namespace=self._namespace, base_url=self._base_url, api_key=self._api_key,
                **self._session_kwargs,
            )
        session._state.listen_for_tool_calls(functools.partial(self._saw_tool_calls, key))
        return session

    def _saw_tool_calls(self, key: str | None, tool_call_ids: list[str]) -> None:
        with self._lock:
            for tool_call_id in tool_call_ids:
                self._tool_calls[tool_call_id] = key

    def _adopt_api_key(self, api_key: str) -> None:
        with self._lock:
            if self._api_key is None:
                self._api_key = api_key
            api_key = self._api_key
            pooled = list(self._sessions.values())
            if self._default is not None:
                pooled.append(self._default)
        for session in pooled:
            session._state.adopt_api_key(api_key)

    def _adopt_base_url(self, base_url: str) -> None:
        with self._lock:
            if self._base_url is None:
                self._base_url = base_url
            pooled = list(self._sessions.values())
            if self._default is not None:
                pooled.append(self._default)
        for session in pooled:
            session._state.adopt_base_url(base_url)

    def _take_dropped(self) -> list[S]:
        """Called with the lock held."""
        dropped, self._sessions.dropped = self._sessions.dropped, []
        return dropped

    def _take_all(self) -> list[S]:
        """Empty the pool; return every session it held, dropped or not, default included."""
        with self._lock:
            self._sessions.expire()
            sessions = self._take_dropped() + list(self._sessions.values())
            self._sessions.clear()
            self._sessions.dropped.clear()  # clear() drops by popitem(): not evictions
            self._tool_calls.clear()
            if self._default is not None:
                sessions.append(self._default)
                self._default = None
        return sessions

    def _let_go(self, sessions: list[S]) -> None:
        for session in sessions:
            logger.debug("kvtether: pool let go of conversation %s", session.conversation_id)
            session._leave_kv_to_lease()

    def _warn_missing_key(self) -> None:
        with self._lock:
            first, self._warned_missing_key = not self._warned_missing_key, True
        if not first:
            return
        message = (
            "a request came with no conversation key (the pool's resolver returned None); it "
            "goes to the pool's default session, shared by every such request. Return a thread "
            "or conversation id from the resolver so each conversation keeps its own KV."
        )
        try:
            warn_at_caller(MissingConversationKeyWarning(message))
        except MissingConversationKeyWarning:
            # `-W error` made it an exception; failing the model request over an advisory would
            # break the agent, so say it in the log instead.
            logger.warning("%s", message)


class SessionPool(BasePool[Session]):
    """One ``Session`` per conversation key (sync I/O). Its constructor is ``BasePool``'s.

    Sessions that leave keep their KV until the router's lease lapses; ``close()`` releases
    the KV of every session still pooled.
    """

    _session_cls = Session

    def close(self) -> None:
        """End every tool run still open, then release the KV of every pooled session. Never
        raises; the pool stays usable."""
        for _, call, _ in self._take_tool_runs():
            call.end()
        for session in self._take_all():
            session.close()

    def __enter__(self) -> SessionPool:
        return self

    def __exit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncSessionPool(BasePool[AsyncSession]):
    """The async twin of ``SessionPool``: ``async with``, ``await pool.aclose()``.

    ``get()`` stays a plain call, so sync code (a tool in a worker thread) can use it too.
    """

    _session_cls = AsyncSession

    def _let_go(self, sessions: list[AsyncSession]) -> None:
        super()._let_go(sessions)
        if not sessions:
            return
        with self._closing_lock:
            self._closing.extend(sessions)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # a worker thread: closed on the event loop later, at the latest by aclose()
        task = loop.create_task(self._close_clients())
        self._close_tasks.add(task)
        task.add_done_callback(self._close_tasks.discard)

    async def _close_clients(self) -> None:
        with self._closing_lock:
            closing, self._closing = self._closing, []
        for session in closing:
            await session._ahttp.aclose()

    async def aclose(self) -> None:
        """End every tool run still open, then release the KV of every pooled session. Never
        raises; the pool stays usable."""
        for _, call, in_task in self._take_tool_runs():
            if in_task:
                await call.aend()
            else:
                call.end()
        for session in self._take_all():
            await session.aclose()
        await self._close_clients()
        if self._close_tasks:
            await asyncio.wait(set(self._close_tasks))

    async def __aenter__(self) -> AsyncSessionPool:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
