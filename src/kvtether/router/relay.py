"""Relaying D's answer to the client: one JSON body, or an SSE stream passed through chunk by
chunk. Either way the turn is settled (its record completed, D's handle remembered or
released) before the client sees the end of the answer, and how the answer ended (in tool
calls or not, :mod:`.answers`) is known by then."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvtether import protocol as p
from kvtether.router._clock import Clock
from kvtether.router._errors import RouterHTTPError, anthropic_error_body
from kvtether.router.answers import AnswerReader
from kvtether.router.apis import Api, api_for
from kvtether.router.backends import Backend, BackendStalledError
from kvtether.router.conversations import Conversation, HeldConversation
from kvtether.router.legs import FirstToken, failure_kind, json_or_502, note_failure, prompt_ids
from kvtether.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)
# Releases started when a stream ends early; held here so they are not garbage-collected.
_background: set[asyncio.Task[Any]] = set()

__all__ = ["Settle", "TurnContext", "greedy_single", "in_background", "relay_events",
           "relay_once", "relay_stream"]


def in_background(work: Awaitable[Any]) -> None:
    """Start ``work`` (a release nobody waits for) and keep it from being garbage-collected."""
    task = asyncio.get_running_loop().create_task(work)  # type: ignore[arg-type]
    _background.add(task)
    task.add_done_callback(_background.discard)


@dataclass
class TurnContext:
    """One turn once its decode leg is open: what relaying and settling it need."""

    conv: Conversation | None
    held: HeldConversation | None  # the store's hold on ``conv``, let go when the turn ends
    decode: Backend
    upstream: httpx.Response  # D's answer, not yet read
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
    # A turn decode computes itself: its new tokens count in the instance's
    # ``prompt_backlog_tokens`` until the first token.
    local_prompt_on: Backend | None = None
    local_prompt_tokens: int = 0

    def prompt_computed(self) -> None:
        """Decode has computed this turn's prompt (its first token came, or the turn ended)."""
        if self.local_prompt_on is not None:
            self.local_prompt_on.prompt_backlog_tokens -= self.local_prompt_tokens
            self.local_prompt_on = None


# Records D's handle (or its absence) once the answer is complete.
Settle = Callable[[TurnContext, "dict[str, Any] | None"], Awaitable[None]]


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


async def relay_once(ctx: TurnContext, settle: Settle, clock: Clock) -> Response:
    decode, record = ctx.decode, ctx.record
    try:
        raw = await ctx.upstream.aread()
    except httpx.HTTPError as exc:
        note_failure(decode, exc)
        raise RouterHTTPError(502, f"decode instance {decode.name} failed: {failure_kind(exc)}",
                              code="upstream_unavailable") from None
    finally:
        decode.inflight -= 1
        ctx.prompt_computed()
        await ctx.upstream.aclose()
    data = json_or_502(raw, decode)
    ctx.answer.body(ctx.api.name, data)
    if ctx.api.token_ids_in_answer:
        choice = (data.get("choices") or [{}])[0]
        ctx.output_ids = list(choice.get("token_ids") or [])
        ctx.prompt_ids = prompt_ids(data)
    _complete(record, ctx, clock)
    await settle(ctx, data.get("kv_transfer_params"))
    if ctx.api.shows_null_kv_params:
        data["kv_transfer_params"] = None
    else:
        data.pop("kv_transfer_params", None)
    if not ctx.wants_token_ids:
        _strip_token_ids(data)
    return JSONResponse(data, headers=ctx.headers)


def relay_stream(
    ctx: TurnContext, settle: Settle, fetch_handle: Callable[[], Awaitable[dict[str, Any] | None]],
    clock: Clock, metrics: RouterMetrics,
    release_unsettled: Callable[[], Awaitable[Any]] | None = None,
) -> Response:
    """Pass D's SSE stream through; the conversation is saved and let go when it ends.

    vLLM does not put the handle in a stream, so it is fetched from D's connector
    (``fetch_handle``) before ``[DONE]`` goes out. A stream that ends before that (the client
    went away, D or the network failed) calls ``release_unsettled``: D may have finished the
    turn and hold its KV under a lease nobody will ask for.
    """
    record, decode, upstream = ctx.record, ctx.decode, ctx.upstream
    end = _StreamEnd(ctx, release_unsettled)
    first = ctx.first
    # With ``first``: decode's role chunk and its first token were already sent (prefill's).
    drop_role = drop_token = first is not None

    async def relay() -> AsyncIterator[bytes]:
        nonlocal drop_role, drop_token
        try:
            if first is not None:
                for chunk in _first_chunks(first, ctx.wants_token_ids):
                    yield _event(chunk)
                record.ttft_s = clock.now_unix_s() - record.started_unix_s
                metrics.ttft_s.observe(record.ttft_s)
                metrics.first_token_from_prefill.inc()
            async for line in _lines_or_error(upstream, decode):
                if line == "data: [DONE]":
                    # Settle before [DONE] reaches the client: SDKs close the connection on
                    # [DONE], and anything after that yield would be cancelled with it.
                    _complete(record, ctx, clock)
                    end.settled = True
                    await settle(ctx, await fetch_handle())
                    yield b"data: [DONE]\n\n"
                    continue
                if not line.startswith("data: "):
                    if line:
                        yield (line + "\n\n").encode()
                    continue
                try:
                    chunk = json.loads(line[6:])
                except json.JSONDecodeError:
                    yield (line + "\n\n").encode()
                    continue
                ctx.prompt_ids.extend(prompt_ids(chunk))
                ctx.answer.chunk(chunk)
                for c in chunk.get("choices") or []:
                    ctx.output_ids.extend(c.get("token_ids") or [])
                    if record.timings.decode_first_token_s is None and c.get("token_ids"):
                        ctx.prompt_computed()
                        now = clock.now_unix_s()
                        record.timings.decode_first_token_s = now - ctx.decode_sent_unix_s
                        if record.ttft_s is None:
                            record.ttft_s = now - record.started_unix_s
                            metrics.ttft_s.observe(record.ttft_s)
                if first is not None:
                    chunk["id"] = first.chunk_id
                    if drop_role and _is_role_chunk(chunk):
                        drop_role = False
                        continue
                    if drop_token and _has_tokens(chunk):
                        drop_token = False
                        if not _drop_first_token(chunk, first):
                            metrics.first_token_mismatch.inc()
                            logger.warning(
                                "decode %s's first token differs from prefill's (%d, %r), "
                                "which the client already has; ending the stream with an "
                                "error", decode.name, first.token_id, first.text)
                            yield _event(p.error_body(
                                "decode's first token differed from prefill's, which was "
                                "already sent; retry the request", "upstream_error",
                                code="upstream_error"))
                            return
                        if _empty(chunk):
                            continue
                if not ctx.wants_token_ids:
                    _strip_token_ids(chunk)
                yield _event(chunk)
        finally:
            end()
            await upstream.aclose()

    return _stream_response(relay(), end, ctx.headers)


def relay_events(
    ctx: TurnContext, settle: Settle, fetch_handle: Callable[[], Awaitable[dict[str, Any] | None]],
    clock: Clock, metrics: RouterMetrics,
    release_unsettled: Callable[[], Awaitable[Any]] | None = None,
) -> Response:
    """Pass through a stream of named SSE events (Responses, Messages) frame by frame, as D
    wrote them; the turn is settled before the API's last event (``response.completed``,
    ``message_stop``) goes out, since SDKs stop reading there. Otherwise as
    :func:`relay_stream`."""
    record, decode, upstream, api = ctx.record, ctx.decode, ctx.upstream, ctx.api
    end = _StreamEnd(ctx, release_unsettled)

    async def relay() -> AsyncIterator[bytes]:
        frame: list[str] = []
        name = ""
        sequence = 0  # the Responses events' sequence_number, for an error event
        try:
            async for line in _lines_or_error(upstream, decode, api, sequence_of=lambda: sequence):
                if line:
                    if line.startswith("event:"):
                        name = line[6:].strip()
                    frame.append(line)
                    continue
                if not frame:
                    continue
                ctx.answer.event(name, frame)
                if name in api.delta_events and record.timings.decode_first_token_s is None:
                    ctx.prompt_computed()
                    now = clock.now_unix_s()
                    record.timings.decode_first_token_s = now - ctx.decode_sent_unix_s
                    record.ttft_s = now - record.started_unix_s
                    metrics.ttft_s.observe(record.ttft_s)
                if name in api.terminal_events and not end.settled:
                    _complete(record, ctx, clock)
                    end.settled = True
                    await settle(ctx, await fetch_handle())
                sequence += 1
                yield ("\n".join(frame) + "\n\n").encode()
                frame, name = [], ""
            if frame:
                yield ("\n".join(frame) + "\n\n").encode()
        finally:
            end()
            await upstream.aclose()

    return _stream_response(relay(), end, ctx.headers)


class _StreamEnd:
    """The end of a relayed stream, however it comes: synchronous and idempotent, so it runs
    even when the client went away before (or while) the generator ran, and the conversation
    is never left locked. A stream that ended before the turn was settled releases what D may
    hold for it."""

    def __init__(self, ctx: TurnContext,
                 release_unsettled: Callable[[], Awaitable[Any]] | None) -> None:
        self.ctx = ctx
        self.release_unsettled = release_unsettled
        self.settled = False
        self.finished = False

    def __call__(self) -> None:
        if self.finished:
            return
        self.finished = True
        ctx = self.ctx
        ctx.decode.inflight -= 1
        ctx.prompt_computed()
        if not self.settled and self.release_unsettled is not None:
            in_background(self.release_unsettled())
        conv, held, record = ctx.conv, ctx.held, ctx.record
        if conv is not None and held is not None:
            if not any(t is record for t in conv.turns):
                conv.add_turn(record)
            held.commit_soon()  # saved already, unless the stream ended before settling


def _stream_response(body: AsyncIterator[bytes], end: _StreamEnd,
                     headers: dict[str, str]) -> Response:
    class _Stream(StreamingResponse):
        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                end()

    return _Stream(body, media_type="text/event-stream", headers=headers)


def _event(chunk: dict[str, Any]) -> bytes:
    return ("data: " + json.dumps(chunk, separators=(",", ":")) + "\n\n").encode()


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
