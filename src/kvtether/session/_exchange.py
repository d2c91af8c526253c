"""One model request through the wrapper: what went out, and what came back.

An ``Exchange`` sees the response bytes as the caller reads them, streamed or not, and keeps
the accounting both paths need: usage, time to first token, the reply (for prefix tracking),
the finish reason. In streams it also removes the usage-only chunk that the wrapper asked for
when the caller did not, so caller code like ``chunk.choices[0]`` keeps working.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

from kvtether.protocol import (
    HEADER_DECODE_INSTANCE,
    HEADER_PROMPT_TOKENS,
    HEADER_REUSABLE_TOKENS,
    HEADER_REUSE,
    HEADER_REUSED_TOKENS,
    HEADER_TIMINGS,
    HEADER_TURN,
    TurnHints,
    parse_reuse_header,
    parse_timings_header,
)
from kvtether.session._records import PrefixCheck, PrefixStatus, Turn

__all__ = ["Exchange", "Endpoint"]

logger = logging.getLogger(__name__)

Endpoint = Literal["chat", "completions"]
_REASONING_KEYS = ("reasoning_content", "reasoning")


class Exchange:
    """Per-request state. Never shared between requests, so concurrent requests are safe."""

    def __init__(
        self,
        *,
        turn: int,
        endpoint: Endpoint,
        stream: bool,
        injected_usage: bool,
        on_done: Callable[[Exchange], None],
    ) -> None:
        self.turn = turn
        self.endpoint: Endpoint = endpoint
        self.stream = stream
        self.injected_usage = injected_usage
        self._on_done = on_done
        self.started_s = time.perf_counter()
        # Request side, filled in by the session.
        self.attempts = 1
        self.step: int | None = None
        self.gap_before_s: float | None = None
        self.prefix = PrefixCheck(PrefixStatus.UNTRACKED)
        self.sent: Any = None  # normalized messages, or the prompt string
        self.tools: Any = None
        self.hints: TurnHints | None = None
        self.predicted_prompt_tokens: int | None = None
        self.request_bytes = 0
        self.new_chars = 0  # characters this turn appends to what decode holds
        # Response side.
        self.status_code: int | None = None
        self.headers: Mapping[str, str] = {}
        self.first_token_s: float | None = None
        self.latency_s = 0.0
        self.usage: Mapping[str, Any] | None = None
        self.finish_reason: str | None = None
        self.reply: dict[str, Any] | None = None
        self.text: str | None = None
        self.error: str | None = None
        self.completed = False
        self._done = False
        self._saw_done = False
        self._body = bytearray()
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._reasoning_key = "reasoning_content"
        self._calls: dict[int, dict[str, Any]] = {}

    # --- response ---------------------------------------------------------------------------
    def on_headers(self, status_code: int, headers: Mapping[str, str]) -> None:
        self.status_code = status_code
        self.headers = headers

    @property
    def _sse(self) -> bool:
        return self.stream and self.status_code is not None and self.status_code < 400

    def feed(self, data: bytes) -> bytes:
        """Account for a piece of the body; return what the caller should see of it."""
        if self._done:
            return data  # trailing bytes read after the turn was recorded (a drain)
        if not self._sse:
            self._body += data
            return data
        self._body += data
        if b"\r" in self._body:
            self._body = bytearray(self._body.replace(b"\r\n", b"\n"))
        out = bytearray()
        while (end := self._body.find(b"\n\n")) >= 0:
            event = bytes(self._body[: end + 2])
            del self._body[: end + 2]
            if self._keep_event(event):
                out += event
        return bytes(out)

    def flush(self) -> bytes:
        """At the end of the body: the last stream event, if the server left it unterminated."""
        if not self._sse or not self._body:
            return b""
        event = bytes(self._body)
        self._body.clear()
        return event if self._keep_event(event) else b""

    def end(self, *, completed: bool, error: BaseException | None = None) -> None:
        """The body ended, the caller closed it, or the request failed. Runs once."""
        if self._done:
            return
        self._done = True
        self.latency_s = time.perf_counter() - self.started_s
        self.completed = (completed or self._saw_done) and error is None
        if error is not None:
            self.error = f"{type(error).__name__}: {error}"
        try:
            if not self._sse and self._body:
                self._parse_body(bytes(self._body))
            elif self._sse:
                self._assemble_reply()
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            logger.debug("kvtether: could not read the response body: %r", exc)
        self._body.clear()
        self._on_done(self)

    # --- parsing ----------------------------------------------------------------------------
    def _keep_event(self, event: bytes) -> bool:
        data = b"\n".join(
            line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
        )
        if data == b"[DONE]":
            # SDKs stop reading here and close the body, so this, not EOF, marks completion.
            self._saw_done = True
            return True
        if not data:
            return True
        try:
            obj = json.loads(data)
            return self._on_chunk(obj) if isinstance(obj, dict) else True
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            logger.debug("kvtether: unreadable stream event passed through: %r", exc)
            return True

    def _on_chunk(self, obj: dict[str, Any]) -> bool:
        usage = obj.get("usage")
        if usage:
            self.usage = usage
        choices = obj.get("choices")
        if not choices:
            # The usage-only final chunk: hide it when the caller did not ask for it.
            return not (self.injected_usage and usage and choices == [])
        for choice in choices:
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            if self.endpoint == "completions":
                piece = choice.get("text") or ""
                if piece and self.first_token_s is None:
                    self.first_token_s = time.perf_counter() - self.started_s
                if choice.get("index", 0) == 0:
                    self._content.append(piece)
                continue
            delta = choice.get("delta") or {}
            got = self._on_delta(delta) if choice.get("index", 0) == 0 else _has_output(delta)
            if got and self.first_token_s is None:
                self.first_token_s = time.perf_counter() - self.started_s
        return True

    def _on_delta(self, delta: Mapping[str, Any]) -> bool:
        if delta.get("content"):
            self._content.append(delta["content"])
        for key in _REASONING_KEYS:
            if delta.get(key):
                self._reasoning_key = key
                self._reasoning.append(delta[key])
        for call in delta.get("tool_calls") or ():
            slot = self._calls.setdefault(
                call.get("index", 0),
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if call.get("id"):
                slot["id"] = call["id"]
            fn = call.get("function") or {}
            slot["function"]["name"] += fn.get("name") or ""
            slot["function"]["arguments"] += fn.get("arguments") or ""
        return _has_output(delta)

    def _assemble_reply(self) -> None:
        if self.endpoint == "completions":
            self.text = "".join(self._content)
            return
        reply: dict[str, Any] = {"role": "assistant", "content": "".join(self._content) or None}
        if self._reasoning:
            reply[self._reasoning_key] = "".join(self._reasoning)
        if self._calls:
            reply["tool_calls"] = [self._calls[i] for i in sorted(self._calls)]
        self.reply = reply

    def _parse_body(self, body: bytes) -> None:
        obj = json.loads(body)
        if self.status_code is not None and self.status_code >= 400:
            err = obj.get("error") if isinstance(obj, dict) else None
            message = err.get("message") if isinstance(err, dict) else str(obj)[:200]
            self.error = f"HTTP {self.status_code}: {message}"
            return
        self.usage = obj.get("usage")
        choice = (obj.get("choices") or [{}])[0]
        self.finish_reason = choice.get("finish_reason")
        if self.endpoint == "completions":
            self.text = choice.get("text")
        else:
            message = choice.get("message")
            self.reply = (
                {k: v for k, v in message.items() if v is not None and v != []}
                if isinstance(message, dict)
                else None
            )

    def to_turn(self) -> Turn:
        """The record of this request, from the router's headers and the body's usage."""
        h = self.headers
        reuse = parse_reuse_header(
            h.get(HEADER_REUSE), h.get(HEADER_REUSED_TOKENS), h.get(HEADER_REUSABLE_TOKENS)
        )
        usage = self.usage or {}
        ok = self.error is None and self.status_code is not None and self.status_code < 400
        return Turn(
            turn=self.turn,
            endpoint=self.endpoint,
            stream=self.stream,
            step=self.step,
            outcome=(reuse.label if reuse else "unknown") if ok else "error",
            reuse=reuse,
            reused_tokens=reuse.reused_tokens if reuse else 0,
            reusable_tokens=reuse.reusable_tokens if reuse else 0,
            prompt_tokens=int(usage.get("prompt_tokens") or _int(h.get(HEADER_PROMPT_TOKENS)) or 0),
            output_tokens=int(usage.get("completion_tokens") or 0),
            ttft_s=self.first_token_s,
            latency_s=self.latency_s,
            gap_before_s=self.gap_before_s,
            prefix=self.prefix,
            hints=self.hints,
            predicted_prompt_tokens=self.predicted_prompt_tokens,
            finish_reason=self.finish_reason,
            router_turn=_int(h.get(HEADER_TURN)),
            decode_instance=h.get(HEADER_DECODE_INSTANCE),
            http_status=self.status_code,
            error=self.error,
            attempts=self.attempts,
            completed=self.completed,
            timings=parse_timings_header(h.get(HEADER_TIMINGS)),
        )

    @property
    def tool_call_ids(self) -> list[str]:
        """The ids of the tool calls in the reply (streamed or not), in order."""
        calls = self.reply.get("tool_calls") if self.reply else None
        return [c["id"] for c in calls or () if isinstance(c, dict) and c.get("id")]

    @property
    def called_tools(self) -> bool:
        calls = self.reply.get("tool_calls") if self.reply else None
        return self.finish_reason == "tool_calls" or bool(calls)


def _int(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None


def _has_output(delta: Mapping[str, Any]) -> bool:
    return bool(
        delta.get("content")
        or delta.get("tool_calls")
        or any(delta.get(k) for k in _REASONING_KEYS)
    )
