"""Prefix tracking: does this turn's prompt extend what the previous turn left on decode?

Decode holds the KV of the previous prompt *and* the reply it generated. The next turn can read
that KV only as far as its prompt repeats those tokens exactly. Agent frameworks often rewrite
history without meaning to (drop reasoning, re-serialize tool-call arguments, re-sort tool
results, edit the system prompt), and the server only finds out after tokenizing. This module
compares messages client-side, before the request leaves, and says where and why it broke.
"""

from __future__ import annotations

import sys
import warnings
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from kvtether.errors import PrefixBreakWarning
from kvtether.session._records import PrefixCheck, PrefixStatus

__all__ = [
    "PrefixTracker",
    "normalize_message",
    "keep_prefix_stable",
    "reply_key",
    "describe",
    "warn_break",
    "warn_at_caller",
]

Message = dict[str, Any]

_REASONING_KEYS = ("reasoning_content", "reasoning")
# Response-only fields that chat templates never render; clients echo them back or not.
_IGNORED_KEYS = frozenset({"annotations", "refusal", "audio", "function_call", "index"})
_MAX_REPLIES = 256
# Frames of these packages are skipped so a kvtether warning points at the agent's code.
_INTERNAL_PACKAGES = frozenset(
    {"kvtether", "openai", "httpx", "httpx2", "anyio", "asyncio", "contextlib", "functools"}
)


def _as_dict(message: Any) -> Message:
    if isinstance(message, Mapping):
        return dict(message)
    dump = getattr(message, "model_dump", None)  # an SDK object, e.g. ChatCompletionMessage
    if callable(dump):
        return dict(dump(exclude_none=True))
    raise TypeError(f"a chat message must be a mapping, got {type(message).__name__}")


def _content_text(content: Any) -> Any:
    # vLLM joins text-only content parts with newlines, so both spellings give the same tokens.
    if isinstance(content, list) and all(
        isinstance(p, Mapping) and p.get("type") == "text" for p in content
    ):
        return "\n".join(str(p.get("text", "")) for p in content)
    return content


def _tool_call(call: Any) -> dict[str, Any]:
    c = _as_dict(call)
    fn = _as_dict(c.get("function") or {})
    return {"id": c.get("id"), "name": fn.get("name"), "arguments": fn.get("arguments")}


def normalize_message(message: Any) -> Message:
    """The parts of a chat message that reach the prompt, in one canonical spelling."""
    out: Message = {}
    for key, value in _as_dict(message).items():
        if value is None or key in _IGNORED_KEYS:
            continue
        if key in _REASONING_KEYS:
            if value:
                out["reasoning"] = value
        elif key == "tool_calls":
            if value:
                out["tool_calls"] = [_tool_call(c) for c in value]
        elif key == "content":
            # Empty and absent content render alike; replies with only tool calls come both ways.
            if value != "":
                out["content"] = _content_text(value)
        else:
            out[key] = value
    return out


def _chars(message: Message) -> int:
    n = len(str(message.get("content", ""))) + len(str(message.get("reasoning", "")))
    for call in message.get("tool_calls", ()):
        n += len(str(call.get("name", ""))) + len(str(call.get("arguments", "")))
    return n


def reply_key(message: Any) -> tuple[str, ...] | None:
    """Identity of an assistant message that survives re-serialization: its tool-call ids, or
    else its text."""
    m = _as_dict(message)
    if m.get("role") != "assistant":
        return None
    calls = m.get("tool_calls") or ()
    ids = tuple(str(_tool_call(c)["id"]) for c in calls if _tool_call(c)["id"])
    if ids:
        return ("tool_calls", *ids)
    text = _content_text(m.get("content"))
    return ("content", text.strip()) if isinstance(text, str) and text.strip() else None


def keep_prefix_stable(
    messages: Sequence[Any], replies: Mapping[tuple[str, ...], Message]
) -> list[Any]:
    """Replace each assistant message that the model produced by the exact reply it produced.

    ``replies`` maps ``reply_key`` to the reply as received (reasoning included). Messages that
    match no reply are returned unchanged.
    """
    out: list[Any] = []
    for message in messages:
        key = reply_key(message)
        exact = replies.get(key) if key is not None else None
        out.append(dict(exact) if exact is not None else message)
    return out


def _classify(expected: list[Message], new: list[Message], i: int) -> str:
    exp, got = expected[i], new[i]
    if i == 0 and "system" in (exp.get("role"), got.get("role")):
        return "system_prompt_changed"
    if exp.get("role") == got.get("role") == "assistant":
        without = {k: v for k, v in exp.items() if k != "reasoning"}
        if "reasoning" in exp and "reasoning" not in got and without == got:
            return "reasoning_stripped"
        return "assistant_edited"
    if exp.get("role") == got.get("role") == "tool" and got in expected[i + 1 :]:
        return "tool_results_reordered"
    if i + 1 < len(expected) and got == expected[i + 1]:
        return "message_dropped"
    return "message_edited"


class PrefixTracker:
    """Remembers what decode holds after each turn and checks the next turn against it."""

    def __init__(self) -> None:
        self._expected: list[Message] | None = None
        self._tools: Any = None
        self._expected_text: str | None = None
        self.replies: OrderedDict[tuple[str, ...], Message] = OrderedDict()

    def check_chat(
        self, messages: Sequence[Any], tools: Any
    ) -> tuple[PrefixCheck, list[Message], int]:
        """Return the check, the normalized messages and the characters the turn appends."""
        new = [normalize_message(m) for m in messages]
        expected = self._expected
        if expected is None:
            return PrefixCheck(PrefixStatus.FIRST), new, sum(map(_chars, new))
        if tools != self._tools:
            # Chat templates render tool schemas into the system prompt: everything shifts.
            check = PrefixCheck(
                PrefixStatus.BREAK, 0, "tools_changed", "the tools list differs from last turn"
            )
            return check, new, sum(map(_chars, new))
        for i in range(min(len(expected), len(new))):
            if new[i] != expected[i]:
                cause = _classify(expected, new, i)
                detail = f"message {i} ({new[i].get('role')}) differs from what decode holds"
                return (
                    PrefixCheck(PrefixStatus.BREAK, i, cause, detail),
                    new,
                    sum(map(_chars, new[i:])),
                )
        if len(new) <= len(expected):
            return PrefixCheck(PrefixStatus.RESENT), new, 0
        return PrefixCheck(PrefixStatus.EXTENDS), new, sum(map(_chars, new[len(expected) :]))

    def commit_chat(self, sent: list[Message], reply: Message | None, tools: Any) -> None:
        self._tools = tools
        self._expected = sent + ([normalize_message(reply)] if reply is not None else [])
        key = reply_key(reply) if reply is not None else None
        if key is not None and reply is not None:
            self.replies[key] = reply
            self.replies.move_to_end(key)
            while len(self.replies) > _MAX_REPLIES:
                self.replies.popitem(last=False)

    def check_completion(self, prompt: Any) -> tuple[PrefixCheck, int]:
        if not isinstance(prompt, str):
            return PrefixCheck(PrefixStatus.UNTRACKED), 0
        expected = self._expected_text
        if expected is None:
            return PrefixCheck(PrefixStatus.FIRST), len(prompt)
        if prompt.startswith(expected):
            status = PrefixStatus.RESENT if len(prompt) == len(expected) else PrefixStatus.EXTENDS
            return PrefixCheck(status), len(prompt) - len(expected)
        if expected.startswith(prompt):
            return PrefixCheck(PrefixStatus.RESENT), 0
        i = next(i for i, (a, b) in enumerate(zip(expected, prompt, strict=False)) if a != b)
        detail = f"prompt differs from what decode holds at character {i}"
        return PrefixCheck(PrefixStatus.BREAK, i, "prompt_edited", detail), len(prompt) - i

    def commit_completion(self, prompt: Any, text: str | None) -> None:
        self._expected_text = prompt + (text or "") if isinstance(prompt, str) else None


def describe(check: PrefixCheck) -> str:
    """One readable sentence for warnings and logs."""
    hint = {
        "reasoning_stripped": "send the assistant message back with its reasoning "
        "(session.stable_history(messages) does this)",
        "assistant_edited": "send the assistant message back exactly as received "
        "(session.stable_history(messages) does this)",
        "system_prompt_changed": "keep the system prompt fixed; put changing context in a "
        "later message",
        "tools_changed": "keep the tools list fixed for the whole conversation",
    }.get(check.cause or "", "append new messages instead of rewriting earlier ones")
    return f"prefix break ({check.cause}): {check.detail}; {hint}"


def warn_break(message: str) -> None:
    """Issue a PrefixBreakWarning attributed to the first frame outside kvtether and the SDK."""
    warn_at_caller(PrefixBreakWarning(message))


def warn_at_caller(warning: Warning) -> None:
    """``warnings.warn(warning)`` attributed to the first frame outside kvtether and the SDK."""
    frame = sys._getframe(1)
    level = 2  # 1 would be this function; 2 its caller
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] in (
        _INTERNAL_PACKAGES
    ):
        frame = frame.f_back
        level += 1
    warnings.warn(warning, stacklevel=level)
