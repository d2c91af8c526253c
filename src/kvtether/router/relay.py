"""Relaying D's answer to the client: one JSON body, or an SSE stream passed through chunk by
chunk. Either way the turn is settled (its record completed, D's handle remembered or
released) before the client sees the end of the answer."""

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
from kvtether.router._errors import RouterHTTPError
from kvtether.router.backends import Backend
from kvtether.router.conversations import Conversation, HeldConversation
from kvtether.router.legs import failure_kind, json_or_502, note_failure, prompt_ids
from kvtether.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)
# Releases started when a stream ends early; held here so they are not garbage-collected.
_background: set[asyncio.Task[Any]] = set()

__all__ = ["Settle", "TurnContext", "in_background", "relay_once", "relay_stream"]


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
    # Filled while relaying: the sequence D now holds KV for.
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


# Records D's handle (or its absence) once the answer is complete.
Settle = Callable[[TurnContext, "dict[str, Any] | None"], Awaitable[None]]


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
        await ctx.upstream.aclose()
    data = json_or_502(raw, decode)
    choice = (data.get("choices") or [{}])[0]
    ctx.output_ids = list(choice.get("token_ids") or [])
    ctx.prompt_ids = prompt_ids(data)
    _complete(record, ctx, clock)
    await settle(ctx, data.get("kv_transfer_params"))
    data["kv_transfer_params"] = None
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
    conv, held, record, decode, upstream = ctx.conv, ctx.held, ctx.record, ctx.decode, ctx.upstream
    finished = settled = False

    def done() -> None:
        # Synchronous and idempotent: runs even when the client went away before (or
        # while) the generator ran, so the conversation is never left locked.
        nonlocal finished
        if finished:
            return
        finished = True
        decode.inflight -= 1
        if not settled and release_unsettled is not None:
            in_background(release_unsettled())
        if conv is not None and held is not None:
            if not any(t is record for t in conv.turns):
                conv.add_turn(record)
            held.commit_soon()  # saved already, unless the stream ended before settling

    async def relay() -> AsyncIterator[bytes]:
        nonlocal settled
        try:
            async for line in _lines_or_error(upstream, decode):
                if line == "data: [DONE]":
                    # Settle before [DONE] reaches the client: SDKs close the connection on
                    # [DONE], and anything after that yield would be cancelled with it.
                    _complete(record, ctx, clock)
                    settled = True
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
                for c in chunk.get("choices") or []:
                    ctx.output_ids.extend(c.get("token_ids") or [])
                    if record.ttft_s is None and c.get("token_ids"):
                        now = clock.now_unix_s()
                        record.ttft_s = now - record.started_unix_s
                        record.timings.decode_first_token_s = now - ctx.decode_sent_unix_s
                        metrics.ttft_s.observe(record.ttft_s)
                if not ctx.wants_token_ids:
                    _strip_token_ids(chunk)
                yield ("data: " + json.dumps(chunk, separators=(",", ":")) + "\n\n").encode()
        finally:
            done()
            await upstream.aclose()

    class _Stream(StreamingResponse):
        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                done()

    return _Stream(relay(), media_type="text/event-stream", headers=ctx.headers)


async def _lines_or_error(upstream: httpx.Response, decode: Backend) -> AsyncIterator[str]:
    """D's SSE lines; if D fails mid-stream, one OpenAI-style error event ends the stream.

    The status (200) went out with the first chunk, so the error travels as an SSE event, the
    shape the OpenAI SDK raises ``APIError`` for; no ``[DONE]`` follows, and nothing is
    retained for this turn.
    """
    try:
        async for line in upstream.aiter_lines():
            yield line
    except httpx.HTTPError as exc:
        logger.warning("decode %s failed mid-stream: %r", decode.name, exc)
        body = p.error_body(f"decode instance {decode.name} failed while streaming the answer; "
                            "retry the request", "upstream_error", code="upstream_unavailable")
        yield "data: " + json.dumps(body, separators=(",", ":"))


def _complete(record: p.TurnRecord, ctx: TurnContext, clock: Clock) -> None:
    record.output_tokens = len(ctx.output_ids)
    record.prompt_tokens = len(ctx.prompt_ids) or record.prompt_tokens
    record.latency_s = clock.now_unix_s() - record.started_unix_s


def _strip_token_ids(data: dict[str, Any]) -> None:
    data.pop("prompt_token_ids", None)
    for c in data.get("choices") or []:
        c.pop("token_ids", None)
        c.pop("prompt_token_ids", None)
