"""Conversation ids: generated, derived from a framework's own id, or checked when given."""

from __future__ import annotations

import hashlib
import uuid

from kvtether.errors import ConfigError
from kvtether.protocol import (
    CONVERSATION_ID_CHARACTERS,
    HEADER_CONVERSATION_ID,
    MAX_CONVERSATION_ID_LEN,
    conversation_id_problem,
)

__all__ = ["conversation_id_from", "new_conversation_id", "check_conversation_id"]

_PREFIX = "kvt-"


def new_conversation_id() -> str:
    """A fresh random id, for agents that have no id of their own."""
    return _PREFIX + uuid.uuid4().hex


def conversation_id_from(*parts: str, namespace: str = "kvtether") -> str:
    """A stable conversation id derived from a framework's ids (thread id, run id, user id...).

    The same parts always give the same id, in any process, so a resumed thread (a LangGraph
    ``thread_id``, an Agents SDK ``session_id``) lands on the KV its earlier turns left behind.
    The id is a hash, so private strings (user names, e-mail addresses) never reach the router.
    """
    if not parts:
        raise ConfigError("conversation_id_from() needs at least one part, e.g. a thread id")
    h = hashlib.blake2b(digest_size=16, person=b"kvtether-conv-id")
    h.update(namespace.encode())
    for part in parts:
        data = str(part).encode()
        # Length-prefix each part so ("ab", "c") and ("a", "bc") differ.
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return _PREFIX + h.hexdigest()


def check_conversation_id(value: str) -> str:
    """Return ``value`` if it can travel as a header and a URL path segment, else raise."""
    if conversation_id_problem(value) is not None:
        raise ConfigError(
            f"conversation_id {str(value)[:40]!r} cannot be sent as {HEADER_CONVERSATION_ID}: "
            f"use 1-{MAX_CONVERSATION_ID_LEN} characters from [{CONVERSATION_ID_CHARACTERS}], "
            "or derive one with kvtether.session.conversation_id_from(your_id)"
        )
    return value
