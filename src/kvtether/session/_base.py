"""State and bookkeeping shared by ``Session`` and ``AsyncSession``.

Everything here is synchronous and guarded by one lock, so the OpenAI transport (any thread,
any event loop), heartbeat threads and tasks, and the agent's own code can all report into it.
Network I/O lives in the twins (``_session.py``); this module never blocks on the router.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any, TypeVar

from pydantic import ValidationError

from kvtether.errors import ConfigError, PrefixBreakWarning
from kvtether.protocol import Phase, TurnHints
from kvtether.session._exchange import Endpoint, Exchange
from kvtether.session._heartbeat import Beat, HeartbeatPlan
from kvtether.session._ids import (
    check_conversation_id,
    conversation_id_from,
    new_conversation_id,
)
from kvtether.session._lease import LeaseState, release_at_exit, session_url
from kvtether.session._predict import GrowthPredictor, PromptSizer
from kvtether.session._prefix import PrefixTracker, describe, keep_prefix_stable, warn_break
from kvtether.session._records import EventKind, PrefixStatus, SessionEvent, ToolRun, Turn
from kvtether.session._report import format_report
from kvtether.session._settings import SessionSettings, normalize_base_url

__all__ = ["BaseSession", "CURRENT_STEP"]

logger = logging.getLogger(__name__)

# (id of the session, step number) of the @session.step call the current code runs in.
CURRENT_STEP: ContextVar[tuple[int, int] | None] = ContextVar("kvtether_step", default=None)
_S = TypeVar("_S", bound="BaseSession")


class BaseSession:
    def __init__(
        self,
        base_url: str | None = None,
        *,
        conversation_id: str | None = None,
        settings: SessionSettings | None = None,
    ) -> None:
        try:
            settings = settings if settings is not None else SessionSettings()
        except ValidationError as exc:
            raise ConfigError(f"invalid KVTETHER_SESSION_* setting: {exc}") from None
        if base_url is not None:
            settings = settings.model_copy(update={"base_url": normalize_base_url(base_url)})
        self._settings = settings
        cid = new_conversation_id() if conversation_id is None else conversation_id
        self._lease = LeaseState(
            check_conversation_id(cid), settings.base_url, settings.request_timeout_s
        )
        self._lock = threading.Lock()
        self._turns: list[Turn] = []
        self._tool_runs: list[ToolRun] = []
        self._events: list[SessionEvent] = []
        self._warned: set[str] = set()
        self._prefix = PrefixTracker()
        self._predictor = GrowthPredictor()
        self._predicted_next_tokens: int | None = None
        self._next_turn = 1
        self._steps = 0
        self._final_next = False
        self._last_end_s: float | None = None
        self._last_called_tools = False
        self._sizer = PromptSizer()
        if settings.release_at_exit:
            # Holds only the lease state, so the session itself can still be collected.
            weakref.finalize(self, release_at_exit, self._lease)

    @classmethod
    def from_thread_id(cls: type[_S], *ids: str, namespace: str = "kvtether", **kwargs: Any) -> _S:
        """A session whose conversation id is derived from a framework's thread/session id."""
        return cls(conversation_id=conversation_id_from(*ids, namespace=namespace), **kwargs)

    # --- what users read --------------------------------------------------------------------
    @property
    def conversation_id(self) -> str:
        return self._lease.conversation_id

    @property
    def base_url(self) -> str | None:
        return self._lease.base_url

    @property
    def turns(self) -> list[Turn]:
        with self._lock:
            return list(self._turns)

    @property
    def tool_runs(self) -> list[ToolRun]:
        with self._lock:
            return list(self._tool_runs)

    @property
    def events(self) -> list[SessionEvent]:
        with self._lock:
            return list(self._events)

    @property
    def released(self) -> bool:
        return self._lease.released

    @property
    def kv_gone(self) -> bool:
        return self._lease.kv_gone

    def report(self) -> str:
        """A per-turn table with totals, for printing."""
        return format_report(self.conversation_id, self.base_url, self.turns, self.events)

    def stable_history(self, messages: list[Any]) -> list[Any]:
        """``messages`` with each earlier model reply restored to exactly what the model sent
        (reasoning included), so the next prompt extends the KV that decode holds."""
        with self._lock:
            replies = dict(self._prefix.replies)
        return keep_prefix_stable(messages, replies)

    def mark_final(self) -> None:
        """The next request is the conversation's last: ask the router not to retain its KV."""
        self._final_next = True

    def wrap(self, client: Any) -> Any:
        """A copy of an ``openai.OpenAI`` / ``AsyncOpenAI`` client whose chat and completion
        requests belong to this session. The client's API is unchanged."""
        from kvtether.session._openai import wrap_client

        if self._lease.base_url is None and getattr(client, "base_url", None) is not None:
            self._lease.base_url = normalize_base_url(str(client.base_url))
        return wrap_client(self, client)

    # --- reports from the transport ---------------------------------------------------------
    def _begin(
        self,
        endpoint: Endpoint,
        body: Mapping[str, Any],
        body_bytes: int,
        *,
        injected_usage: bool,
        retry: int,
    ) -> Exchange:
        """A model request is about to leave: number it, check its prefix, attach hints."""
        step = CURRENT_STEP.get()
        with self._lock:
            last = self._turns[-1] if self._turns else None
            retrying = retry > 0 and last is not None and last.outcome == "error"
            ex = Exchange(
                turn=last.turn if retrying and last else self._next_turn,
                endpoint=endpoint,
                stream=bool(body.get("stream")),
                injected_usage=injected_usage,
                on_done=self._finish,
            )
            if retrying and last is not None:
                ex.attempts = last.attempts + 1
            else:
                self._next_turn += 1
            ex.step = step[1] if step is not None and step[0] == id(self) else None
            ex.request_bytes = body_bytes
            if self._last_end_s is not None:
                ex.gap_before_s = time.monotonic() - self._last_end_s
                if not retrying:
                    self._predictor.observe_gap(
                        ex.gap_before_s, after_tool_calls=self._last_called_tools
                    )
            if endpoint == "chat" and isinstance(body.get("messages"), list):
                ex.tools = body.get("tools")
                ex.prefix, ex.sent, ex.new_chars = self._prefix.check_chat(
                    body["messages"], ex.tools
                )
            elif endpoint == "completions":
                ex.sent = body.get("prompt")
                ex.prefix, ex.new_chars = self._prefix.check_completion(ex.sent)
            self._attach_hints(ex, body)
        if ex.prefix.status is PrefixStatus.BREAK:
            self._on_prefix_break(ex)
        return ex

    def _attach_hints(self, ex: Exchange, body: Mapping[str, Any]) -> None:
        extends = ex.prefix.status in (PrefixStatus.EXTENDS, PrefixStatus.RESENT)
        estimate = self._sizer.estimate(
            extends=extends, new_chars=ex.new_chars, request_bytes=ex.request_bytes
        )
        tools_offered = bool(body.get("tools")) and body.get("tool_choice") != "none"
        guess = self._predictor.at_request(estimate, tools_offered=tools_offered)
        phase = Phase.FINAL if self._final_next else guess.phase
        self._final_next = False
        ex.hints = TurnHints(
            next_prompt_tokens=guess.next_prompt_tokens,
            next_turn_gap_s=round(guess.next_turn_gap_s, 3),
            phase=phase,
        )
        ex.predicted_prompt_tokens = self._predicted_next_tokens
        self._predicted_next_tokens = guess.next_prompt_tokens

    def _on_prefix_break(self, ex: Exchange) -> None:
        message = f"turn {ex.turn} of conversation {self.conversation_id}: {describe(ex.prefix)}"
        self._record(EventKind.PREFIX_BREAK, message, turn=ex.turn)
        if self._settings.on_prefix_break == "warn":
            try:
                warn_break(message)
            except PrefixBreakWarning:
                # `-W error` made it an exception; failing the model request over an advisory
                # would break the agent, so say it in the log instead.
                logger.warning("%s", message)
        elif self._settings.on_prefix_break == "log":
            logger.warning("%s", message)

    def _finish(self, ex: Exchange) -> None:
        """The response ended (or the request failed): record the turn, learn from it."""
        turn = ex.to_turn()
        with self._lock:
            if self._turns and self._turns[-1].turn == turn.turn:
                self._turns[-1] = turn  # a retry replaces its failed attempt
            else:
                self._turns.append(turn)
            if ex.status_code is None:
                self._record_locked(EventKind.REQUEST_FAILED, ex.error or "", turn.turn)
            if turn.outcome != "error" and ex.completed:
                self._learn(ex, turn, turn.reuse is not None)

    def _learn(self, ex: Exchange, turn: Turn, via_router: bool) -> None:
        if ex.endpoint == "chat" and isinstance(ex.sent, list):
            self._prefix.commit_chat(ex.sent, ex.reply, ex.tools)
        elif ex.endpoint == "completions":
            self._prefix.commit_completion(ex.sent, ex.text)
        self._sizer.learn(
            turn.prompt_tokens,
            turn.output_tokens,
            new_chars=ex.new_chars,
            request_bytes=ex.request_bytes,
        )
        self._predictor.observe_turn(turn.prompt_tokens, turn.output_tokens, ex.called_tools)
        self._last_end_s = time.monotonic()
        self._last_called_tools = ex.called_tools
        if via_router:
            final = turn.hints is not None and turn.hints.phase is Phase.FINAL
            self._lease.has_lease, self._lease.released = not final, False
            self._lease.kv_gone = False

    # --- tools ------------------------------------------------------------------------------
    def _tool_started(self, name: str, key: str, eta_s: float | None) -> ToolRun:
        with self._lock:
            predicted = eta_s if eta_s is not None else self._predictor.tool_duration_s(key)
            after = self._turns[-1].turn if self._turns else 0
            run = ToolRun(name=name, key=key, after_turn=after, eta_s=eta_s, predicted_s=predicted)
            self._tool_runs.append(run)
            guess = self._predictor.at_tool(key, eta_s=eta_s)
            self._predicted_next_tokens = guess.next_prompt_tokens
        return run

    def _start_heartbeat(self, plan: HeartbeatPlan, *, in_task: bool) -> Beat:
        raise NotImplementedError  # each twin knows its own I/O

    def _tool_finished(self, run: ToolRun, duration_s: float, error: str | None) -> None:
        with self._lock:
            run.duration_s, run.ok, run.error = duration_s, error is None, error
            self._predictor.observe_tool(run.key, duration_s)
            for turn in reversed(self._turns):
                if turn.turn == run.after_turn:
                    turn.tools.append(run.name)
                    turn.tool_time_s += duration_s
                    break

    def _next_step(self) -> int:
        with self._lock:
            self._steps += 1
            return self._steps

    # --- lease bookkeeping ------------------------------------------------------------------
    def _heartbeat_url(self) -> str | None:
        return session_url(self._lease, "/heartbeat")

    def _record(self, kind: EventKind, detail: str, turn: int | None = None) -> None:
        with self._lock:
            self._record_locked(kind, detail, turn)

    def _record_locked(self, kind: EventKind, detail: str, turn: int | None) -> None:
        if turn is None and self._turns:
            turn = self._turns[-1].turn
        self._events.append(SessionEvent(kind, detail, time.time(), turn))

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        with self._lock:
            first = key not in self._warned
            self._warned.add(key)
        logger.log(logging.WARNING if first else logging.DEBUG, message, *args)

    def _lose_lease(self, kind: EventKind, detail: str, *, kv_gone: bool) -> None:
        with self._lock:
            self._lease.has_lease = False
            self._lease.kv_gone = self._lease.kv_gone or kv_gone
            self._record_locked(kind, detail, None)
        logger.debug("kvtether conversation %s: %s", self.conversation_id, detail)

    def _released(self, status_code: int | None, detail: str) -> None:
        """Record the outcome of a release attempt (``status_code`` None: no answer)."""
        if status_code in (200, 204, 404, 410):
            with self._lock:
                self._lease.released, self._lease.has_lease = True, False
                self._record_locked(EventKind.RELEASED, detail, None)
        else:
            self._record(EventKind.RELEASE_FAILED, detail)
            logger.warning(
                "kvtether: could not release conversation %s (%s); the router frees "
                "it when its lease lapses",
                self.conversation_id,
                detail,
            )
