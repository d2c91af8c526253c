"""``BaseSession``: what ``Session`` and ``AsyncSession`` share, which is all but their I/O.

The records live in one ``SessionState`` (``_state.py``); the helpers (the OpenAI transport,
tool and step scopes, heartbeats) get that state, never the session. This class holds the state,
the blocking HTTP client heartbeat threads use, and the public surface both twins offer.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any, TypeVar, overload

import httpx
from pydantic import ValidationError

from kvtether.errors import ConfigError
from kvtether.session._heartbeat import Beat, HeartbeatPlan, ThreadHeartbeat
from kvtether.session._http import ClientSlot, client_options
from kvtether.session._ids import (
    check_conversation_id,
    conversation_id_from,
    new_conversation_id,
)
from kvtether.session._lease import API_KEY_ENV
from kvtether.session._prefix import keep_prefix_stable
from kvtether.session._records import SessionEvent, SessionTotals, ToolRun, Turn
from kvtether.session._report import format_report
from kvtether.session._settings import SessionSettings, normalize_base_url
from kvtether.session._state import SessionState
from kvtether.session._tools import StepScope, ToolCall, bound_arguments, decorate

__all__ = ["BaseSession"]

_S = TypeVar("_S", bound="BaseSession")
F = TypeVar("F", bound=Callable[..., Any])


class BaseSession:
    """Shared by the twins. ``http_client`` is ``Session``'s (``AsyncSession`` has its own)."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        conversation_id: str | None = None,
        settings: SessionSettings | None = None,
        http_client: httpx.Client | None = None,
        api_key: str | None = None,
        parent_id: str | None = None,
    ) -> None:
        try:
            settings = settings if settings is not None else SessionSettings()
        except ValidationError as exc:
            raise ConfigError(f"invalid KVTETHER_SESSION_* setting: {exc}") from None
        if base_url is not None:
            settings = settings.model_copy(update={"base_url": normalize_base_url(base_url)})
        timeout_s = settings.request_timeout_s
        cid = new_conversation_id() if conversation_id is None else conversation_id
        self._state = state = SessionState(check_conversation_id(cid), settings)
        state.parent_id = None if parent_id is None else check_conversation_id(parent_id)
        api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        if api_key is not None:
            state.adopt_api_key(api_key)
        # For heartbeat threads in both twins; Session also sends release and status on it.
        # Its options read the state, not the session: no reference cycle through the slot.
        self._http = ClientSlot(lambda: client_options(state.base_url, timeout_s), http_client)
        self._exit_release: weakref.finalize[[], None] | None = None
        if settings.release_at_exit:
            # Holds only the state, so the session itself can still be collected.
            self._exit_release = weakref.finalize(self, state.release_at_exit)

    @classmethod
    def from_thread_id(cls: type[_S], *ids: str, namespace: str = "kvtether", **kwargs: Any) -> _S:
        """A session whose conversation id is derived from a framework's thread/session id."""
        return cls(conversation_id=conversation_id_from(*ids, namespace=namespace), **kwargs)

    def subagent(self: _S, name: str, **kwargs: Any) -> _S:
        """A session for a subagent of this one: its own conversation
        (``<conversation id>:agent:<name>``, the id a Claude Code subagent gets), linked to this
        one as its parent (``X-Parent-Conversation-Id``), with this session's settings and key.
        ``kwargs`` go to the constructor (e.g. ``http_client``)."""
        state = self._state
        kwargs.setdefault("settings", state.settings)
        kwargs.setdefault("api_key", state.api_key)
        return type(self)(
            conversation_id=f"{state.conversation_id}:agent:{name}",
            parent_id=state.conversation_id, **kwargs,
        )

    # --- what users read --------------------------------------------------------------------
    @property
    def conversation_id(self) -> str:
        return self._state.conversation_id

    @property
    def parent_id(self) -> str | None:
        """The conversation this one was spawned from (``subagent()``, or ``parent_id=``)."""
        return self._state.parent_id

    @property
    def base_url(self) -> str | None:
        return self._state.base_url

    @property
    def turns(self) -> list[Turn]:
        """The most recent turns (at most ``settings.max_turn_records``), oldest first."""
        return self._state.turns()

    @property
    def tool_runs(self) -> list[ToolRun]:
        """The most recent tool runs (at most ``settings.max_turn_records``), oldest first."""
        return self._state.tool_runs()

    @property
    def events(self) -> list[SessionEvent]:
        """The most recent events (at most ``settings.max_turn_records``), oldest first."""
        return self._state.events()

    @property
    def totals(self) -> SessionTotals:
        """Counts over every turn, tool run and event, including those no longer listed."""
        return self._state.totals()

    @property
    def released(self) -> bool:
        return self._state.released

    @property
    def kv_gone(self) -> bool:
        return self._state.kv_gone

    def report(self) -> str:
        """A table of the listed turns and a summary line over every turn, for printing."""
        turns, totals = self._state.report_records()
        return format_report(self.conversation_id, self.base_url, turns, totals)

    def stable_history(self, messages: list[Any]) -> list[Any]:
        """``messages`` with each earlier model reply restored to exactly what the model sent
        (reasoning included), so the next prompt extends the KV that decode holds."""
        return keep_prefix_stable(messages, self._state.replies())

    def mark_final(self) -> None:
        """The next request is the conversation's last: ask the router not to retain its KV."""
        self._state.mark_final()

    def wrap(self, client: Any) -> Any:
        """A copy of an ``openai.OpenAI`` / ``AsyncOpenAI`` client whose chat and completion
        requests belong to this session. The client's API is unchanged."""
        from kvtether.session._openai import wrap_client

        if self._state.base_url is None and getattr(client, "base_url", None) is not None:
            self._state.adopt_base_url(normalize_base_url(str(client.base_url)))
        if isinstance(getattr(client, "api_key", None), str) and client.api_key:
            self._state.adopt_api_key(client.api_key)  # unless given one, or by the env
        state = self._state
        return wrap_client(lambda: state, client, owner=self)

    # --- what agent code decorates ----------------------------------------------------------
    def tool_call(self, name: str, *, eta_s: float | None = None, args: Any = None) -> ToolCall:
        """``with session.tool_call("grep", eta_s=5):`` (or ``async with``) around a tool run.

        ``eta_s``: your own estimate of the duration, if you have one. ``args``: the tool's
        arguments; the first word of the first string one refines duration predictions.
        """
        return ToolCall(self._state, self._start_heartbeat, name, eta_s=eta_s, args=args)

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
                f, lambda a, kw: self.tool_call(tool_name, eta_s=eta_s, args=arguments(a, kw))
            )

        return decorator(fn) if fn is not None else decorator

    @overload
    def step(self, fn: F, /) -> F: ...

    @overload
    def step(self, fn: None = None, /) -> Callable[[F], F]: ...

    def step(self, fn: Callable[..., Any] | None = None, /) -> Any:
        """Decorate one iteration of the agent loop; its model requests carry its number."""

        def decorator(f: Callable[..., Any]) -> Callable[..., Any]:
            return decorate(f, lambda a, kw: StepScope(self._state))

        return decorator(fn) if fn is not None else decorator

    # --- I/O both twins share ---------------------------------------------------------------
    def _leave_kv_to_lease(self) -> None:
        """Let go of this session without releasing its KV: a session pool evicts it, and the
        conversation may come back (same id), so the router keeps the KV until the lease lapses.
        Closes the heartbeat threads' client; heartbeats of a tool still running end with it."""
        if self._exit_release is not None:
            self._exit_release.detach()
        self._http.close()

    def _heartbeat_name(self) -> str:
        return f"kvtether-heartbeat-{self.conversation_id}"

    def _start_heartbeat(self, plan: HeartbeatPlan, in_task: bool) -> Beat:
        """A thread beats whatever the tool does, even when it blocks an event loop."""
        return ThreadHeartbeat(plan, self._http.get, self._heartbeat_name())

    def _status_url(self) -> str:
        url = self._state.session_url()
        if url is None:
            raise ConfigError(
                "this session has no base_url: pass Session(base_url=...) or wrap() a client first"
            )
        return url
