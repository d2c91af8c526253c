"""The one exception tree of kvtether, and its warnings.

Exceptions::

    KVTetherError                  anything kvtether raises on purpose
    ├── ConfigError                a setting or argument is wrong; the message says which and why
    ├── RouterUnavailableError     the kvtether router could not be reached, or timed out
    └── SessionError               the router answered about a conversation, but not with success
        ├── SessionNotFound        404: the router holds no state for this conversation id
        └── SessionGone            410: the conversation's KV was released, evicted or expired

Warnings::

    KVTetherWarning                (UserWarning)
    ├── PrefixBreakWarning         a turn's prompt does not extend the previous turn's prompt and
    │                              reply, so the decode-held KV can be reused only up to the break
    └── MissingConversationKeyWarning
                                   a session pool's resolver gave no conversation key, so requests
                                   go to the pool's one default session (said once per pool)

The client session layer never raises these from inside a model request or a tool: the agent
keeps running when the router is down, and the session records what happened. They are raised
by calls whose whole purpose is to talk to the router (``Session.status()``) and by bad
configuration.
"""

from __future__ import annotations

__all__ = [
    "KVTetherError",
    "ConfigError",
    "RouterUnavailableError",
    "SessionError",
    "SessionNotFound",
    "SessionGone",
    "KVTetherWarning",
    "PrefixBreakWarning",
    "MissingConversationKeyWarning",
]


class KVTetherError(Exception):
    """Base class of every exception kvtether raises on purpose."""


class ConfigError(KVTetherError, ValueError):
    """A setting or argument is invalid."""


class RouterUnavailableError(KVTetherError):
    """The kvtether router did not answer (connection refused, timeout, broken connection)."""


class SessionError(KVTetherError):
    """The router answered a session API call with an error."""

    def __init__(self, message: str, *, conversation_id: str, status_code: int | None = None):
        super().__init__(message)
        self.conversation_id = conversation_id
        self.status_code = status_code


class SessionNotFound(SessionError):
    """The router has no state for this conversation (never seen, or already forgotten)."""


class SessionGone(SessionError):
    """The conversation's KV no longer exists on decode (released, evicted or expired)."""


class KVTetherWarning(UserWarning):
    """Base class of kvtether's warnings."""


class PrefixBreakWarning(KVTetherWarning):
    """A turn rewrote history that the previous turn's KV was computed from."""


class MissingConversationKeyWarning(KVTetherWarning):
    """A session pool got no conversation key; its default session served the request."""
