"""Names on the wire: the protocol version, request and response headers, body fields, and the
one conversation-id rule."""

from __future__ import annotations

import re


PROTOCOL_VERSION = "1"

# --- request side -------------------------------------------------------------------------
HEADER_CONVERSATION_ID = "X-Conversation-Id"
# Accepted as aliases, in this order of precedence after X-Conversation-Id.
CONVERSATION_ID_HEADER_ALIASES = ("X-Session-Id",)
# What vLLM's own multi-turn benchmark sends in the JSON body.
BODY_CONVERSATION_ID = "conversation_id"
# The conversation this one was spawned from (a subagent's main agent).
HEADER_PARENT_CONVERSATION_ID = "X-Parent-Conversation-Id"
# "true" on a conversation's last request: what its turn retains is released once answered.
HEADER_END = "X-KVTether-End"

# Hints travel either as a JSON object in this header or as this body field.
HEADER_HINTS = "X-KVTether-Hints"
BODY_HINTS = "kvtether_hints"

# Body fields that belong to kvtether and are stripped before a request reaches vLLM.
KVTETHER_BODY_FIELDS = (BODY_CONVERSATION_ID, BODY_HINTS)

# --- response side ------------------------------------------------------------------------
HEADER_REUSE = "X-KVTether-Reuse"  # "fired" or "miss:<cause>"
HEADER_REUSED_TOKENS = "X-KVTether-Reused-Tokens"  # prompt tokens served from cached KV
# Prompt tokens that repeat the sequence the conversation's previous finished turn built
# (its prompt + output, less the last output token, which has no KV): the most this turn
# could have reused.
HEADER_REUSABLE_TOKENS = "X-KVTether-Reusable-Tokens"
# Where the turn's time went before decode began (TurnTimings.header_value()): the stages known
# when the answer starts, "stage=seconds;...".
HEADER_TIMINGS = "X-KVTether-Timings"
HEADER_PROMPT_TOKENS = "X-KVTether-Prompt-Tokens"
HEADER_TURN = "X-KVTether-Turn"  # 1-based turn index within the conversation
HEADER_DECODE_INSTANCE = "X-KVTether-Decode-Instance"
# Whenever the prompt diverged from decode's retained sequence: the whole-block prefix of
# decode's KV that still matched and was offered to prefill.
HEADER_SALVAGED_TOKENS = "X-KVTether-Salvaged-Tokens"
# Set by the round-robin front of several router replicas: which replica answered.
HEADER_ROUTER = "X-KVTether-Router"

MAX_CONVERSATION_ID_LEN = 256
# Visible ASCII only: an id travels in an HTTP header and in the session API's URL paths.
CONVERSATION_ID_CHARACTERS = "A-Za-z0-9._:@~+=-"
_CONVERSATION_ID = re.compile(f"[{CONVERSATION_ID_CHARACTERS}]+")


def conversation_id_problem(value: object) -> str | None:
    """What is wrong with ``value`` as a conversation id, or None when it is a valid one: 1 to
    :data:`MAX_CONVERSATION_ID_LEN` characters from :data:`CONVERSATION_ID_CHARACTERS`. The
    one rule, applied by the client before sending and by the router on every request."""
    if not isinstance(value, str) or not value:
        return "must be a non-empty string"
    if len(value) > MAX_CONVERSATION_ID_LEN:
        return f"is longer than {MAX_CONVERSATION_ID_LEN} characters"
    if not _CONVERSATION_ID.fullmatch(value):
        return f"may only use the characters [{CONVERSATION_ID_CHARACTERS}]"
    return None
