"""``SessionState``: everything one conversation remembers, behind one lock.

The turn ledger (the most recent turns, tool runs and events, and totals over all of them:
``_ledger.py``), the client's view of its lease, prefix tracking and growth prediction. Every
helper that reports into a session does it through the methods here: the OpenAI transport
(any thread, any event loop), heartbeat threads and tasks, tool and step scopes, and the twins'
release and status calls. None of them touches a field; every mutation
happens under ``_lock``. Nothing here does network I/O, except the exit finalizer, which has no
session left to do it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import httpx

from kvtether.errors import PrefixBreakWarning, RouterUnavailableError
from kvtether.protocol import HeartbeatRequest, Phase, SessionStatus, TurnHints
from kvtether.session._exchange import Endpoint, Exchange
from kvtether.session._lease import (
    LeaseState,
    auth_headers,
    delete_at_exit,
    parse_status,
    session_url,
)
from kvtether.session._lease import unavailable as _unavailable
from kvtether.session._ledger import Ledger
from kvtether.session._predict import GrowthPredictor, PromptSizer
from kvtether.session._prefix import PrefixTracker, describe, warn_break
from kvtether.session._records import (
    EventKind,
    PrefixStatus,
    SessionEvent,
    SessionTotals,
    ToolRun,
    Turn,
)
from kvtether.session._settings import SessionSettings

__all__ = ["SessionState", "CURRENT_STEP", "Clock", "ToolCallListener"]

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
# Told the ids of the tool calls a reply asked for (a session pool indexes them).
ToolCallListener = Callable[[list[str]], None]

# (id of the session state, step number) of the @session.step call the current code runs in.
CURRENT_STEP: ContextVar[tuple[int, int] | None] = ContextVar("kvtether_step", default=None)

_EXIT_LOCK_TIMEOUT_S = 1.0


class SessionState:
    """One conversation's records and lease view. Thread-safe; never blocks on the router.

    ``clock`` (monotonic seconds) times tool runs and the gaps between turns; tests pass a
    fake one instead of sleeping.
    """

    def __init__(
        self, conversation_id: str, settings: SessionSettings, *, clock: Clock = time.monotonic
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.parent_id: str | None = None  # sent as X-Parent-Conversation-Id
        # Reentrant: a finalizer run by the garbage collector may fire in a thread holding it.
        self._lock = threading.RLock()
        self._lease = LeaseState(conversation_id, settings.base_url, settings.request_timeout_s)
        # Bounded: a pooled conversation may never end (totals still cover every turn).
        self._ledger = Ledger(settings.max_turn_records)
        self._warned: set[str] = set()
        self._prefix = PrefixTracker()
        self._predictor = GrowthPredictor()
        self._sizer = PromptSizer()
        self._predicted_next_tokens: int | None = None
        self._next_turn = 1
        self._steps = 0
        self._final_next = False
        self._last_end_s: float | None = None
        self._last_called_tools = False
        self._tool_call_listener: ToolCallListener | None = None

    # --- what the session shows its users ---------------------------------------------------
    @property
    def conversation_id(self) -> str:
        return self._lease.conversation_id  # never changes

    @property
    def base_url(self) -> str | None:
        with self._lock:
            return self._lease.base_url

    @property
    def has_lease(self) -> bool:
        with self._lock:
            return self._lease.has_lease

    @property
    def released(self) -> bool:
        with self._lock:
            return self._lease.released

    @property
    def kv_gone(self) -> bool:
        with self._lock:
            return self._lease.kv_gone

    def turns(self) -> list[Turn]:
        with self._lock:
            return list(self._ledger.turns)

    def tool_runs(self) -> list[ToolRun]:
        with self._lock:
            return list(self._ledger.tool_runs)

    def events(self) -> list[SessionEvent]:
        with self._lock:
            return list(self._ledger.events)

    def totals(self) -> SessionTotals:
        with self._lock:
            return self._ledger.totals()

    def report_records(self) -> tuple[list[Turn], SessionTotals]:
        """The listed turns and the totals, taken together (for the report)."""
        with self._lock:
            return list(self._ledger.turns), self._ledger.totals()

    def replies(self) -> dict[int, Any]:
        """The model's replies as it sent them, by message index, for ``stable_history``."""
        with self._lock:
            return dict(self._prefix.replies)

    def mark_final(self) -> None:
        with self._lock:
            self._final_next = True

    def listen_for_tool_calls(self, listener: ToolCallListener) -> None:
        """Call ``listener`` with the tool-call ids of every reply that has some."""
        with self._lock:
            self._tool_call_listener = listener

    @property
    def api_key(self) -> str | None:
        return self._lease.api_key

    def adopt_api_key(self, api_key: str) -> None:
        """Use ``api_key`` for the session API unless the session was given one."""
        with self._lock:
            if self._lease.api_key is None:
                self._lease.api_key = api_key

    def auth_headers(self) -> dict[str, str]:
        """Headers of every session API call (heartbeat, release, status)."""
        with self._lock:
            return auth_headers(self._lease)

    def adopt_base_url(self, base_url: str) -> None:
        """Use ``base_url`` (already normalized) unless the session was given one."""
        with self._lock:
            if self._lease.base_url is None:
                self._lease.base_url = base_url

    # --- the session API's URLs and answers (the twins do the I/O) --------------------------
    def session_url(self, suffix: str = "") -> str | None:
        with self._lock:
            return session_url(self._lease, suffix)

    def release_url(self) -> str | None:
        """Where to send the release, or None when nothing is retained on the router."""
        with self._lock:
            if not self._lease.has_lease or self._lease.released:
                return None
            return session_url(self._lease)

    def parse_status(self, response: httpx.Response) -> SessionStatus:
        return parse_status(self._lease.conversation_id, response)

    def unavailable(self, exc: httpx.HTTPError) -> RouterUnavailableError:
        return _unavailable(self.base_url, exc)

    def release_answered(self, status_code: int | None, detail: str) -> None:
        """Record the outcome of a release attempt (``status_code`` None: no answer)."""
        # 409: the router's reuse policy keeps no leases, so there is nothing to release.
        if status_code in (200, 204, 404, 409, 410):
            with self._lock:
                self._lease.released, self._lease.has_lease = True, False
                self._record_locked(EventKind.RELEASED, detail, None)
            return
        self.record(EventKind.RELEASE_FAILED, detail)
        logger.warning(
            "kvtether: could not release conversation %s (%s); the router frees it when its "
            "lease lapses",
            self.conversation_id,
            detail,
        )

    def release_at_exit(self) -> None:
        """``weakref.finalize`` callback: free the KV of a session nobody closed. Never raises."""
        with self._exit_lock():
            wanted = self._lease.has_lease and not self._lease.released
            url = session_url(self._lease)
            headers = auth_headers(self._lease)
        if wanted and url is not None and delete_at_exit(url, self._lease.timeout_s, headers):
            with self._exit_lock():
                self._lease.released, self._lease.has_lease = True, False

    @contextlib.contextmanager
    def _exit_lock(self) -> Iterator[None]:
        # At interpreter exit a daemon thread may have been frozen holding the lock: wait a
        # little, then go on without it (nothing else runs by then).
        locked = self._lock.acquire(timeout=_EXIT_LOCK_TIMEOUT_S)
        try:
            yield
        finally:
            if locked:
                self._lock.release()

    # --- model requests, reported by the transport ------------------------------------------
    def begin(
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
            last = self._ledger.last_turn
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
                ex.gap_before_s = self.clock() - self._last_end_s
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
            self._attach_hints_locked(ex, body)
        if ex.prefix.status is PrefixStatus.BREAK:
            self._on_prefix_break(ex)
        return ex

    def _attach_hints_locked(self, ex: Exchange, body: Mapping[str, Any]) -> None:
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
        # Outside the lock: a warning filter or log handler may run arbitrary code.
        message = f"turn {ex.turn} of conversation {self.conversation_id}: {describe(ex.prefix)}"
        self.record(EventKind.PREFIX_BREAK, message, turn=ex.turn)
        if self.settings.on_prefix_break == "warn":
            try:
                warn_break(message)
            except PrefixBreakWarning:
                # `-W error` made it an exception; failing the model request over an advisory
                # would break the agent, so say it in the log instead.
                logger.warning("%s", message)
        elif self.settings.on_prefix_break == "log":
            logger.warning("%s", message)

    def _finish(self, ex: Exchange) -> None:
        """The response ended (or the request failed): record the turn, learn from it."""
        turn = ex.to_turn()
        with self._lock:
            self._ledger.add_turn(turn)
            if ex.status_code is None:
                self._record_locked(EventKind.REQUEST_FAILED, ex.error or "", turn.turn)
            if turn.outcome != "error" and ex.completed:
                self._learn_locked(ex, turn, via_router=turn.reuse is not None)
            listener = self._tool_call_listener
        # Outside the lock: the listener takes its own (the pool's), never the other way round.
        if listener is not None and (ids := ex.tool_call_ids):
            listener(ids)

    def _learn_locked(self, ex: Exchange, turn: Turn, *, via_router: bool) -> None:
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
        self._last_end_s = self.clock()
        self._last_called_tools = ex.called_tools
        if via_router:
            final = turn.hints is not None and turn.hints.phase is Phase.FINAL
            self._lease.has_lease, self._lease.released = not final, False
            self._lease.kv_gone = False

    # --- tools and steps --------------------------------------------------------------------
    def tool_started(self, name: str, key: str, eta_s: float | None) -> ToolRun:
        with self._lock:
            predicted = eta_s if eta_s is not None else self._predictor.tool_duration_s(key)
            last = self._ledger.last_turn
            after = last.turn if last is not None else 0
            run = ToolRun(name=name, key=key, after_turn=after, eta_s=eta_s, predicted_s=predicted)
            self._ledger.add_tool_run(run)
            guess = self._predictor.at_tool(key, eta_s=eta_s)
            self._predicted_next_tokens = guess.next_prompt_tokens
        return run

    def tool_finished(self, run: ToolRun, duration_s: float, error: str | None) -> None:
        with self._lock:
            run.duration_s, run.ok, run.error = duration_s, error is None, error
            self._predictor.observe_tool(run.key, duration_s)
            self._ledger.tool_finished(run)

    def next_step(self) -> int:
        with self._lock:
            self._steps += 1
            return self._steps

    # --- heartbeats -------------------------------------------------------------------------
    def heartbeat_request(
        self, run: ToolRun, *, elapsed_s: float, eta_s: float | None
    ) -> HeartbeatRequest | None:
        """What the next heartbeat for ``run`` says, or None when there is no lease to keep."""
        with self._lock:
            if not self._lease.has_lease:
                return None
            guess = self._predictor.at_tool(run.key, elapsed_s=elapsed_s, eta_s=eta_s)
            self._predicted_next_tokens = guess.next_prompt_tokens
        return HeartbeatRequest(
            phase=Phase.TOOL_RUNNING,
            tool_name=run.name[:200],
            expected_duration_s=round(guess.next_turn_gap_s, 3),
            next_prompt_tokens=guess.next_prompt_tokens,
        )

    def heartbeat_renewed(self, run: ToolRun, lease_remaining_s: float) -> None:
        with self._lock:
            self._lease.lease_remaining_s = lease_remaining_s
            run.heartbeats += 1

    def heartbeat_failed(self, run: ToolRun, detail: str, *, first: bool) -> None:
        """Count a failed heartbeat; the first of a series also goes into the events."""
        with self._lock:
            run.heartbeat_failures += 1
            if first:
                self._record_locked(EventKind.HEARTBEAT_FAILED, f"{run.name}: {detail}", None)
        self.warn_once(
            "heartbeat_failed",
            "heartbeat to the kvtether router failed (%s); retrying quietly with backoff",
            detail,
        )

    def lose_lease(self, kind: EventKind, detail: str, *, kv_gone: bool) -> None:
        with self._lock:
            self._lease.has_lease = False
            self._lease.kv_gone = self._lease.kv_gone or kv_gone
            self._record_locked(kind, detail, None)
        logger.debug("kvtether conversation %s: %s", self.conversation_id, detail)

    # --- events -----------------------------------------------------------------------------
    def record(self, kind: EventKind, detail: str, turn: int | None = None) -> None:
        with self._lock:
            self._record_locked(kind, detail, turn)

    def _record_locked(self, kind: EventKind, detail: str, turn: int | None) -> None:
        if turn is None and (last := self._ledger.last_turn) is not None:
            turn = last.turn
        self._ledger.add_event(SessionEvent(kind, detail, time.time(), turn))

    def warn_once(self, key: str, message: str, *args: Any) -> None:
        """Log ``message`` as a warning the first time ``key`` comes up, later at debug level."""
        with self._lock:
            first = key not in self._warned
            self._warned.add(key)
        logger.log(logging.WARNING if first else logging.DEBUG, message, *args)
