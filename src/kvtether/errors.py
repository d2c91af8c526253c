"""The one exception tree of kvtether, and its warnings.

Exceptions::

    KVTetherError                      anything kvtether raises on purpose
    ├── ConfigError                    a setting or argument is wrong; the message says which
    │   └── ScenarioError              (kvtether.bench) a scenario file that cannot be read
    ├── UnsupportedVersionError        an installed vLLM or framework is outside the supported
    │   │                              versions (also an ImportError)
    │   ├── VLLMVersionError           vLLM is not the version the connector was written for
    │   └── (kvtether_langgraph.UnsupportedFrameworkVersionError,
    │        kvtether_openai_agents.UnsupportedAgentsVersionError)
    ├── RouterUnavailableError         the kvtether router could not be reached, or timed out
    ├── SessionError                   the router answered about a conversation, not with success
    │   ├── SessionNotFoundError       404: the router holds no state for this conversation id
    │   └── SessionGoneError           410: the conversation's KV was released, evicted or expired
    ├── StackError                     (kvtether.stack) the stack could not be started, stopped
    │   │                              or found
    │   ├── PortInUseError             a port the stack needs is taken
    │   ├── StackAlreadyRunningError   a live stack already owns the state directory
    │   ├── StackNotRunningError       no stack is recorded in the state directory
    │   ├── InstanceFailedError        a process exited or stayed unhealthy while starting
    │   └── RestartsExhaustedError     a supervised process kept dying; the supervisor gave up
    │
    │   Inside the router (kvtether.router, defined beside the code that raises them; the
    │   application maps each to an HTTP status and the API's own error shape at the edge):
    ├── RouterHTTPError                answer the request with this status and message
    │   ├── UpstreamError              vLLM answered with an error: relayed as it came
    │   ├── PrefillRefusedError        a prefill instance refused the connection (another may
    │   │                              take the turn)
    │   ├── PrefillTimedOutError       a prefill leg got no answer in time (decode may answer
    │   │   │                          alone)
    │   │   └── PrefillStalledError    the prefill instance stalled during the leg
    │   └── BackendStalledError        an instance's engine step waits on a frozen worker
    ├── StoreError                     the conversation store could not do what was asked
    │   ├── StoreUnavailableError      the shared store did not answer (plain P/D meanwhile)
    │   ├── StoreFencedError           this holder's lock expired; a newer holder saved
    │   └── ConversationBusyError      another turn held the conversation too long (409)
    └── ConversationTableFullError     every conversation in a full table is busy (503)

Warnings::

    KVTetherWarning                    (UserWarning)
    ├── PrefixBreakWarning             a turn's prompt does not extend the previous turn's
    │                                  prompt and reply, so the decode-held KV can be reused only
    │                                  up to the break
    └── MissingConversationKeyWarning  a session pool's resolver gave no conversation key, so
                                       requests go to the pool's one default session (said once
                                       per pool)

Every class outside the router is defined here and exported where the public API raises it
as well (``kvtether.stack``, ``kvtether.session``, ``kvtether.bench``). ``SessionNotFound`` and ``SessionGone`` are the
earlier names of ``SessionNotFoundError`` and ``SessionGoneError`` (the same classes).

The client session layer never raises these from inside a model request or a tool: the agent
keeps running when the router is down, and the session records what happened. They are raised
by calls whose whole purpose is to talk to the router (``Session.status()``) and by bad
configuration.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "KVTetherError",
    "ConfigError",
    "ScenarioError",
    "UnsupportedVersionError",
    "VLLMVersionError",
    "RouterUnavailableError",
    "SessionError",
    "SessionNotFoundError",
    "SessionGoneError",
    "SessionNotFound",
    "SessionGone",
    "StackError",
    "PortInUseError",
    "StackAlreadyRunningError",
    "StackNotRunningError",
    "InstanceFailedError",
    "RestartsExhaustedError",
    "KVTetherWarning",
    "PrefixBreakWarning",
    "MissingConversationKeyWarning",
]


class KVTetherError(Exception):
    """Base class of every exception kvtether raises on purpose."""


class ConfigError(KVTetherError, ValueError):
    """A setting or argument is invalid."""


class ScenarioError(ConfigError):
    """A scenario or trace file that cannot be read; the message says what and where."""


class UnsupportedVersionError(KVTetherError, ImportError):
    """An installed engine or framework is outside the versions kvtether supports."""


class VLLMVersionError(UnsupportedVersionError):
    """The installed vLLM is not the version the kvtether connector was written for."""


class RouterUnavailableError(KVTetherError):
    """The kvtether router did not answer (connection refused, timeout, broken connection)."""


class SessionError(KVTetherError):
    """The router answered a session API call with an error."""

    def __init__(self, message: str, *, conversation_id: str, status_code: int | None = None):
        super().__init__(message)
        self.conversation_id = conversation_id
        self.status_code = status_code


class SessionNotFoundError(SessionError):
    """The router has no state for this conversation (never seen, or already forgotten)."""


class SessionGoneError(SessionError):
    """The conversation's KV no longer exists on decode (released, evicted or expired)."""


# The names before kvtether settled on "...Error"; kept so that existing code still works.
SessionNotFound = SessionNotFoundError
SessionGone = SessionGoneError


class StackError(KVTetherError):
    """The stack could not be started, stopped or found."""


class PortInUseError(StackError):
    def __init__(self, host: str, port: int, purpose: str) -> None:
        super().__init__(
            f"port {port} on {host} ({purpose}) is already in use; stop whatever holds it "
            f"or choose other ports (--port, --base-port, --side-channel-base-port)"
        )
        self.host, self.port, self.purpose = host, port, purpose


class StackAlreadyRunningError(StackError):
    def __init__(self, state_dir: Path) -> None:
        super().__init__(
            f"a stack is already running from {state_dir}; run `kvtether stack down` first "
            f"or pass another --state-dir"
        )


class StackNotRunningError(StackError):
    def __init__(self, state_dir: Path) -> None:
        super().__init__(f"no stack is recorded in {state_dir} (start one: `kvtether stack up`)")


class InstanceFailedError(StackError):
    """A process died or never became healthy while the stack was starting."""

    def __init__(self, name: str, reason: str, log_path: Path | None, log_tail: str = "") -> None:
        where = f" (log: {log_path})" if log_path else ""
        super().__init__(f"{name} {reason}{where}")
        self.name, self.reason, self.log_path, self.log_tail = name, reason, log_path, log_tail


class RestartsExhaustedError(StackError):
    """A process kept dying: the supervisor stopped restarting it."""

    def __init__(
        self, name: str, failures: int, window_s: float, log_path: Path | str | None,
        log_tail: str,
    ) -> None:
        super().__init__(
            f"{name} failed {failures} times within {window_s:.0f} s; giving up on restarting "
            f"it and stopping the stack (log: {log_path}; raise --restart-max-failures or fix "
            "the cause)"
        )
        self.name, self.failures, self.log_path, self.log_tail = name, failures, log_path, log_tail


class KVTetherWarning(UserWarning):
    """Base class of kvtether's warnings."""


class PrefixBreakWarning(KVTetherWarning):
    """A turn rewrote history that the previous turn's KV was computed from."""


class MissingConversationKeyWarning(KVTetherWarning):
    """A session pool got no conversation key; its default session served the request."""
