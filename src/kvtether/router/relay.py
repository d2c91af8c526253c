"""Relaying D's answer to the client: one JSON body, or an SSE stream passed through chunk by
chunk. Either way the turn is settled (its record completed, D's handle remembered or
released) before the client sees the end of the answer, and how the answer ended (in tool
calls or not, :mod:`.answers`) is known by then.

A stream is read in three parts: the SSE parsing (:func:`parse_data_line`,
:class:`EventFramer`, :class:`FirstTokenSplice`; no I/O), the :class:`StreamObserver` (token
ids, timings), and the thin async relays that pass the bytes on."""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvtether import protocol as p
from kvtether.router import _json
from kvtether.router._clock import Clock
from kvtether.router._errors import RouterHTTPError, anthropic_error_body
from kvtether.router.answers import AnswerReader
from kvtether.router.apis import Api, api_for
from kvtether.router.backends import Backend, BackendStalledError, Slot
from kvtether.router.conversations import Conversation
from kvtether.router.legs import FirstToken, failure_kind, json_or_502, note_failure, prompt_ids
from kvtether.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

__all__ = ["Chunk", "Done", "EventFramer", "FirstTokenSplice", "Frame", "Passthrough",
           "Splice", "StreamObserver", "TurnContext", "TurnEnding", "greedy_single",
           "parse_data_line", "relay_events", "relay_once", "relay_stream"]


@dataclass
class TurnContext:
    """One turn once its decode leg is open: what relaying it needs."""

    conv: Conversation | None
    decode: Backend
    upstream: httpx.Response  # D's answer, not yet read
    slot: Slot  # the decode leg's, released when the answer has been relayed
    record: p.TurnRecord  # completed as the answer is relayed
    headers: dict[str, str]  # the response's kvtether headers
    handle_key: str | None  # the lease key D publishes the handle under (kvtether connector)
    wants_token_ids: bool  # the client asked for token ids; otherwise they are stripped
    decode_sent_unix_s: float = 0.0  # when the decode leg was sent (router clock)
    # Prefill's token, streamed before decode's first step (then decode's copy is dropped).
    first: FirstToken | None = None
    api: Api = field(default_factory=lambda: api_for("/v1/chat/completions"))
    # Filled while relaying: the sequence D now holds KV for.
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    answer: AnswerReader = field(default_factory=AnswerReader)  # how the answer ends
    # A turn decode computes itself: its new tokens, counted in that instance's prompt
    # backlog until the first token.
    local_work: Slot | None = None

    def prompt_computed(self) -> None:
        """Decode has computed this turn's prompt (its first token came, or the turn ended)."""
        if self.local_work is not None:
            self.local_work.prompt_computed()

    def release_slots(self) -> None:
        self.slot.release()
        if self.local_work is not None:
            self.local_work.release()


class TurnEnding(Protocol):
    """The turn a relay ends: settled once the answer is complete (its record, D's handle
    kept or released, the conversation saved), finished however the relay ends."""

    @property
    def settled(self) -> bool: ...

    async def settle(self, handle: dict[str, Any] | None) -> None:
        """Settle with the handle a whole answer carried."""
        ...

    async def settle_streamed(self) -> None:
        """Settle a streamed answer (whose handle D's connector keeps, if anyone)."""
        ...

    def finish(self) -> None:
        """Synchronous and idempotent: runs even when the client went away before (or while)
        the relay ran, so the conversation is never left held."""
        ...


# Request fields under which decode's first token may differ from prefill's, or under which
# the first chunks carry more than a role and a token's text.
# (Stop strings: a streamed answer holds back text that may begin one, a whole answer not.)
_NOT_RELAYABLE = ("stop", "logprobs", "top_logprobs", "tools", "functions", "response_format",
                  "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                  "guided_grammar", "echo", "return_prompt_text", "logits_processors")


def greedy_single(body: dict[str, Any]) -> bool:
    """A chat request whose first token prefill and decode both pick the same way, and whose
    stream begins with that token's text: greedy (``temperature`` 0), one choice, no stop
    strings, logprobs, tools or structured output, no per-chunk usage. Only then may
    prefill's token be streamed before decode's."""
    temperature = body.get("temperature")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        return False
    if temperature != 0 or body.get("n") not in (None, 1):
        return False
    if any(body.get(k) not in (None, False, 0, "", [], {}) for k in _NOT_RELAYABLE):
        return False
    options = body.get("stream_options")
    return not (isinstance(options, dict) and options.get("continuous_usage_stats"))


async def relay_once(ctx: TurnContext, turn: TurnEnding, clock: Clock) -> Response:
    decode, record = ctx.decode, ctx.record
    try:
        raw = await ctx.upstream.aread()
    except httpx.HTTPError as exc:
        note_failure(decode, exc)
        raise RouterHTTPError(502, f"decode instance {decode.name} failed: {failure_kind(exc)}",
                              code="upstream_unavailable") from None
    finally:
        ctx.release_slots()
        await ctx.upstream.aclose()
    data = json_or_502(raw, decode)
    ctx.answer.body(ctx.api.name, data)
    if ctx.api.token_ids_in_answer:
        choice = (data.get("choices") or [{}])[0]
        ctx.output_ids = list(choice.get("token_ids") or [])
        ctx.prompt_ids = prompt_ids(data)
    _complete(record, ctx, clock)
    await turn.settle(data.get("kv_transfer_params"))
    if ctx.api.shows_null_kv_params:
        data["kv_transfer_params"] = None
    else:
        data.pop("kv_transfer_params", None)
    if not ctx.wants_token_ids:
        _strip_token_ids(data)
    return JSONResponse(data, headers=ctx.headers)


# ---------------------------------------------------------------- SSE, without I/O
@dataclass(frozen=True)
class Done:
    """``data: [DONE]``: the end of a chat or completions stream."""


@dataclass(frozen=True)
class Chunk:
    """A ``data:`` line holding a JSON object."""

    data: dict[str, Any]


@dataclass(frozen=True)
class Passthrough:
    """Any other line, relayed as it came."""

    line: str

    def encode(self) -> bytes:
        return (self.line + "\n\n").encode()


def parse_data_line(line: str) -> Done | Chunk | Passthrough | None:
    """One line of a chat or completions stream (None: a blank line, nothing to relay)."""
    if line == "data: [DONE]":
        return Done()
    if not line.startswith("data: "):
        return Passthrough(line) if line else None
    try:
        data = _json.loads(line[6:])
    except ValueError:
        return Passthrough(line)
    return Chunk(data) if isinstance(data, dict) else Passthrough(line)


@dataclass(frozen=True)
class Frame:
    """One named SSE event (Responses, Messages): its name and its lines, as D wrote them."""

    name: str
    lines: tuple[str, ...]

    def encode(self) -> bytes:
        return ("\n".join(self.lines) + "\n\n").encode()


class EventFramer:
    """Lines in, whole events out: a blank line ends an event."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._name = ""

    def feed(self, line: str) -> Frame | None:
        if line:
            if line.startswith("event:"):
                self._name = line[6:].strip()
            self._lines.append(line)
            return None
        return self.flush()

    def flush(self) -> Frame | None:
        """The event under way, if any (the stream ended without its blank line)."""
        if not self._lines:
            return None
        frame = Frame(self._name, tuple(self._lines))
        self._lines, self._name = [], ""
        return frame


class Splice(enum.Enum):
    KEEP = "keep"  # relay the chunk
    DROP = "drop"  # the client has it already (from prefill)
    MISMATCH = "mismatch"  # decode's first token is not the one the client already has


class FirstTokenSplice:
    """Joins decode's stream to the two chunks sent from prefill's answer: decode's role
    chunk and its first token are dropped, every chunk takes prefill's chunk id."""

    def __init__(self, first: FirstToken) -> None:
        self.first = first
        self._drop_role = self._drop_token = True

    def apply(self, chunk: dict[str, Any]) -> Splice:
        chunk["id"] = self.first.chunk_id
        if self._drop_role and _is_role_chunk(chunk):
            self._drop_role = False
            return Splice.DROP
        if self._drop_token and _has_tokens(chunk):
            self._drop_token = False
            if not _drop_first_token(chunk, self.first):
                return Splice.MISMATCH
            if _empty(chunk):
                return Splice.DROP
        return Splice.KEEP


class StreamObserver:
    """What a relayed stream tells about its turn: the token ids and how the answer ends,
    the first token's timings (the one place TTFT is taken), the record's totals."""

    def __init__(self, ctx: TurnContext, clock: Clock, metrics: RouterMetrics) -> None:
        self.ctx, self.clock, self.metrics = ctx, clock, metrics

    def prefill_token_sent(self) -> None:
        """Prefill's first token went to the client: that is the turn's TTFT."""
        self._ttft(self.clock.now_unix_s())
        self.metrics.first_token_from_prefill.inc()

    def chunk(self, chunk: dict[str, Any]) -> None:
        ctx = self.ctx
        ctx.prompt_ids.extend(prompt_ids(chunk))
        ctx.answer.chunk(chunk)
        for c in chunk.get("choices") or []:
            ctx.output_ids.extend(c.get("token_ids") or [])
            if c.get("token_ids"):
                self._decode_token()

    def event(self, frame: Frame) -> None:
        self.ctx.answer.event(frame.name, list(frame.lines))
        if frame.name in self.ctx.api.delta_events:
            self._decode_token()

    def complete(self) -> None:
        _complete(self.ctx.record, self.ctx, self.clock)

    def _decode_token(self) -> None:
        record = self.ctx.record
        if record.timings.decode_first_token_s is not None:
            return
        self.ctx.prompt_computed()
        now = self.clock.now_unix_s()
        record.timings.decode_first_token_s = now - self.ctx.decode_sent_unix_s
        self._ttft(now)

    def _ttft(self, now: float) -> None:
        record = self.ctx.record
        if record.ttft_s is None:
            record.ttft_s = now - record.started_unix_s
            self.metrics.ttft_s.observe(record.ttft_s)


# ---------------------------------------------------------------- the relays
def relay_stream(ctx: TurnContext, turn: TurnEnding, clock: Clock,
                 metrics: RouterMetrics) -> Response:
    """Pass D's SSE stream through; the turn is settled before ``[DONE]`` goes out (SDKs
    close the connection on it, and anything after that would be cancelled with it).

    A stream that ends before that (the client went away, D or the network failed) finishes
    the turn unsettled (:meth:`TurnEnding.finish`).
    """
    observer = StreamObserver(ctx, clock, metrics)
    splice = FirstTokenSplice(ctx.first) if ctx.first is not None else None

    async def relay() -> AsyncIterator[bytes]:
        try:
            if ctx.first is not None:
                for chunk in _first_chunks(ctx.first, ctx.wants_token_ids):
                    yield _event(chunk)
                observer.prefill_token_sent()
            async for line in _lines_or_error(ctx.upstream, ctx.decode):
                item = parse_data_line(line)
                if isinstance(item, Done):
                    observer.complete()
                    await turn.settle_streamed()
                    yield b"data: [DONE]\n\n"
                elif isinstance(item, Passthrough):
                    yield item.encode()
                elif isinstance(item, Chunk):
                    observer.chunk(item.data)
                    verdict = splice.apply(item.data) if splice is not None else Splice.KEEP
                    if verdict is Splice.MISMATCH:
                        yield _mismatch(ctx, metrics)
                        return
                    if verdict is Splice.KEEP:
                        if splice is None and ctx.wants_token_ids:
                            yield (line + "\n\n").encode()  # as decode wrote it
                            continue
                        if not ctx.wants_token_ids:
                            _strip_token_ids(item.data)
                        yield _event(item.data)
        finally:
            turn.finish()
            await ctx.upstream.aclose()

    return _stream_response(relay(), turn, ctx.headers)


def relay_events(ctx: TurnContext, turn: TurnEnding, clock: Clock,
                 metrics: RouterMetrics) -> Response:
    """Pass through a stream of named SSE events (Responses, Messages) frame by frame, as D
    wrote them; the turn is settled before the API's last event (``response.completed``,
    ``message_stop``) goes out, since SDKs stop reading there. Otherwise as
    :func:`relay_stream`."""
    observer = StreamObserver(ctx, clock, metrics)
    framer = EventFramer()
    sequence = 0  # the Responses events' sequence_number, for an error event

    async def relay() -> AsyncIterator[bytes]:
        nonlocal sequence
        try:
            async for line in _lines_or_error(ctx.upstream, ctx.decode, ctx.api,
                                              sequence_of=lambda: sequence):
                frame = framer.feed(line)
                if frame is None:
                    continue
                observer.event(frame)
                if frame.name in ctx.api.terminal_events and not turn.settled:
                    observer.complete()
                    await turn.settle_streamed()
                sequence += 1
                yield frame.encode()
            if (frame := framer.flush()) is not None:
                yield frame.encode()
        finally:
            turn.finish()
            await ctx.upstream.aclose()

    return _stream_response(relay(), turn, ctx.headers)


def _mismatch(ctx: TurnContext, metrics: RouterMetrics) -> bytes:
    """The error event that ends a stream whose first token from decode differs from the
    one prefill's answer already gave the client."""
    assert ctx.first is not None
    metrics.first_token_mismatch.inc()
    logger.warning("decode %s's first token differs from prefill's (%d, %r), which the client "
                   "already has; ending the stream with an error", ctx.decode.name,
                   ctx.first.token_id, ctx.first.text)
    return _event(p.error_body("decode's first token differed from prefill's, which was "
                               "already sent; retry the request", "upstream_error",
                               code="upstream_error"))


def _stream_response(body: AsyncIterator[bytes], turn: TurnEnding,
                     headers: dict[str, str]) -> Response:
    class _Stream(StreamingResponse):
        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                turn.finish()

    return _Stream(body, media_type="text/event-stream", headers=headers)


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + _json.dumps(chunk) + b"\n\n"


def _first_chunks(first: FirstToken, wants_token_ids: bool) -> list[dict[str, Any]]:
    """The two chunks vLLM starts a chat stream with (the role, then the first token's text),
    from prefill's answer."""
    head = {"id": first.chunk_id, "object": "chat.completion.chunk", "created": first.created,
            "model": first.model}
    role: dict[str, Any] = {**head, "choices": [{
        "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
        "finish_reason": None}]}
    token: dict[str, Any] = {**head, "choices": [{
        "index": 0, "delta": {"content": first.text}, "logprobs": None,
        "finish_reason": None}]}
    if wants_token_ids:
        role["prompt_token_ids"] = first.prompt_token_ids
        token["choices"][0]["token_ids"] = [first.token_id]
    return [role, token]


def _choice(chunk: dict[str, Any]) -> dict[str, Any] | None:
    choices = chunk.get("choices")
    if isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict):
        return choices[0]
    return None


def _is_role_chunk(chunk: dict[str, Any]) -> bool:
    c = _choice(chunk)
    delta = c.get("delta") if c is not None else None
    return (isinstance(delta, dict) and "role" in delta and not delta.get("content")
            and not c.get("token_ids") and c.get("finish_reason") is None)  # type: ignore[union-attr]


def _has_tokens(chunk: dict[str, Any]) -> bool:
    c = _choice(chunk)
    return c is not None and bool(c.get("token_ids"))


def _drop_first_token(chunk: dict[str, Any], first: FirstToken) -> bool:
    """Take decode's first token (the one prefill's chunk already gave) out of ``chunk``;
    False when it is not that token."""
    c = _choice(chunk)
    assert c is not None
    ids, delta = c["token_ids"], c.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else None
    if ids[0] != first.token_id or not isinstance(text, str) or not text.startswith(first.text):
        return False
    c["token_ids"] = ids[1:]
    delta["content"] = text[len(first.text):]  # type: ignore[index]
    return True


def _empty(chunk: dict[str, Any]) -> bool:
    """Nothing left for the client: no text, no tokens, no finish, no usage."""
    c = _choice(chunk)
    delta = c.get("delta") if c is not None else None
    return (c is not None and not c.get("token_ids") and c.get("finish_reason") is None
            and isinstance(delta, dict) and not any(delta.values())
            and not chunk.get("usage"))


async def _lines_or_error(
    upstream: httpx.Response, decode: Backend, api: Api | None = None,
    sequence_of: Callable[[], int] = lambda: 0,
) -> AsyncIterator[str]:
    """D's SSE lines; if D fails mid-stream, one error event in the API's own shape ends the
    stream.

    The status (200) went out with the first chunk, so the error travels as an SSE event: for
    chat and completions the shape the OpenAI SDK raises ``APIError`` for (no ``[DONE]``
    follows), for Responses an ``error`` event, for Messages Anthropic's ``error`` event.
    Nothing is retained for this turn.
    """
    try:
        async for line in decode.watch_lines(upstream.aiter_lines()):
            yield line
    except (httpx.HTTPError, BackendStalledError) as exc:
        logger.warning("decode %s failed mid-stream: %r", decode.name, exc)
        stalled = isinstance(exc, BackendStalledError)
        what = "stalled" if stalled else "failed"
        code = "upstream_stalled" if stalled else "upstream_unavailable"
        message = (f"decode instance {decode.name} {what} while streaming the answer; "
                   "retry the request")
        if api is not None and api.anthropic_errors:
            body: dict[str, Any] = anthropic_error_body(502, message)
        elif api is not None and api.named_events:
            body = {"type": "error", "code": code, "message": message,
                    "param": None, "sequence_number": sequence_of()}
        else:
            body = p.error_body(message, "upstream_error", code=code)
        if api is not None and api.named_events:
            yield "event: error"
        yield "data: " + json.dumps(body, separators=(",", ":"))
        if api is not None and api.named_events:
            yield ""


def _complete(record: p.TurnRecord, ctx: TurnContext, clock: Clock) -> None:
    record.output_tokens = len(ctx.output_ids)
    record.prompt_tokens = len(ctx.prompt_ids) or record.prompt_tokens
    record.latency_s = clock.now_unix_s() - record.started_unix_s


def _strip_token_ids(data: dict[str, Any]) -> None:
    data.pop("prompt_token_ids", None)
    for c in data.get("choices") or []:
        c.pop("token_ids", None)
        c.pop("prompt_token_ids", None)
