"""How a conversation is stored in its Redis hash: JSON for what is small, the bytes of an
``array`` (4 bytes a token) for token sequences; each field is written only when it changed.
What only a turn needs (``turns``, ``seq``, ``tools``: the tool gaps learned for a client
without hints) is not read by a heartbeat, release or reap (:mod:`._redis_lua`)."""

from __future__ import annotations

import json
from array import array
from collections import deque
from typing import Any

from kvtether.protocol import MissCause, Phase, TurnRecord
from kvtether.router.conversations import Conversation, RetainedKV
from kvtether.router.tool_leases import AwaitingTools, ToolGaps

__all__ = ["FIELDS", "dump", "fields", "load"]

FIELDS = ["meta", "turns", "seq", "ret", "rtok", "tools"]


def fields(data: Any) -> dict[bytes, bytes]:
    """A script's HGETALL (flat field, value pairs) or a client's, as {field: value}."""
    if isinstance(data, list):
        data = dict(zip(data[::2], data[1::2], strict=True))
    return {(k.encode() if isinstance(k, str) else k): v for k, v in data.items()}


def dump(conv: Conversation, names: list[str]) -> dict[bytes, bytes]:
    """The named fields of the conversation's hash, as bytes (compared with what was read)."""
    out: dict[bytes, bytes] = {}
    r = conv.retained
    for name in names:
        if name == "meta":
            value: bytes = json.dumps({
                "decode": conv.decode_instance,
                "parent": conv.parent_id,
                "gone": conv.gone_cause.value if conv.gone_cause else None,
                "turn_count": conv.turn_count,
                "fired_turns": conv.fired_turns,
                "prompt_tokens_total": conv.prompt_tokens_total,
                "reused_tokens_total": conv.reused_tokens_total,
                "last_active_unix_s": conv.last_active_unix_s,
                "phase": conv.phase.value if conv.phase else None,
                "expected_next_prompt_tokens": conv.expected_next_prompt_tokens,
                "basis": conv.lease_basis,
            }, separators=(",", ":")).encode()
        elif name == "turns":
            value = json.dumps([t.model_dump(mode="json") for t in conv.turns],
                               separators=(",", ":")).encode()
        elif name == "seq":
            value = _pack(conv.last_token_ids)
        elif name == "tools":
            value = _dump_tools(conv)
        elif name == "ret":
            value = b"" if r is None else json.dumps({
                "decode_instance": r.decode_instance, "params": r.params,
                "retained_tokens": r.retained_tokens,
                "lease_deadline_unix_s": r.lease_deadline_unix_s, "handle_key": r.handle_key,
                "created_unix_s": r.created_unix_s,
            }, separators=(",", ":")).encode()
        else:  # rtok
            value = b"" if r is None else _pack(r.token_ids)
        out[name.encode()] = value
    return out


def _dump_tools(conv: Conversation) -> bytes:
    w = conv.awaiting_tools
    if w is None and not len(conv.tool_gaps):
        return b""
    return json.dumps({
        "gaps": conv.tool_gaps.to_json(),
        "awaiting": None if w is None else {"keys": list(w.keys), "at": w.answered_unix_s,
                                            "turn": w.turn},
    }, separators=(",", ":")).encode()


def _load_tools(conv: Conversation, raw: bytes) -> None:
    if not raw:
        return
    tools = json.loads(raw)
    conv.tool_gaps = ToolGaps.from_json(tools.get("gaps"))
    w = tools.get("awaiting")
    if w:
        conv.awaiting_tools = AwaitingTools(tuple(w["keys"]), w["at"], w["turn"])


def _pack(ids: Any) -> bytes:
    """Token ids as the bytes of an ``array`` (4 bytes a token), its typecode first."""
    if ids is None or len(ids) == 0:
        return b""
    if isinstance(ids, array):
        return ids.typecode.encode() + ids.tobytes()
    try:
        a = array("I", ids)
    except OverflowError:
        a = array("q", ids)
    return a.typecode.encode() + a.tobytes()


def _unpack(raw: bytes) -> array | None:
    if not raw:
        return None
    a = array(raw[:1].decode())
    a.frombytes(raw[1:])
    return a


def load(conversation_id: str, tenant: str, data: dict[bytes, bytes],
         max_turn_records: int) -> Conversation:
    """A conversation from its hash's fields (all of them, or those a partial load read)."""
    conv = Conversation(conversation_id, tenant,
                        turns=deque(maxlen=max_turn_records))
    if not data:
        return conv
    meta = json.loads(data[b"meta"])
    conv.decode_instance = meta["decode"]
    conv.parent_id = meta.get("parent")
    conv.gone_cause = MissCause(meta["gone"]) if meta["gone"] else None
    conv.turn_count = meta["turn_count"]
    conv.fired_turns = meta["fired_turns"]
    conv.prompt_tokens_total = meta["prompt_tokens_total"]
    conv.reused_tokens_total = meta["reused_tokens_total"]
    conv.last_active_unix_s = meta["last_active_unix_s"]
    conv.phase = Phase(meta["phase"]) if meta["phase"] else None
    conv.expected_next_prompt_tokens = meta["expected_next_prompt_tokens"]
    conv.lease_basis = meta.get("basis")
    if b"turns" in data:
        conv.turns.extend(TurnRecord.model_validate(t) for t in json.loads(data[b"turns"]))
    conv.last_token_ids = _unpack(data.get(b"seq", b""))
    _load_tools(conv, data.get(b"tools", b""))
    ret = data.get(b"ret")
    if ret:
        r = json.loads(ret)
        tokens = _unpack(data.get(b"rtok", b""))
        conv.retained = RetainedKV(
            decode_instance=r["decode_instance"], params=r["params"],
            token_ids=list(tokens) if tokens is not None else [],
            retained_tokens=r["retained_tokens"],
            lease_deadline_unix_s=r["lease_deadline_unix_s"],
            handle_key=r["handle_key"], created_unix_s=r["created_unix_s"],
        )
    return conv
