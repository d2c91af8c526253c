"""A small stand-in for the kvtether router, speaking the real wire contract.

It answers chat and completion requests (streamed or not) with scripted replies and the
X-KVTether-* headers, and serves the session API. Tests script it through ``FakeRouter``
attributes and read back what it received.

The fixtures at the end serve it once per test session; the core's session tests and the
framework integrations' tests import them into their own conftest.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvtether.protocol import (
    HEADER_CONVERSATION_ID,
    HEADER_PROMPT_TOKENS,
    HEADER_REUSE,
    HEADER_REUSED_TOKENS,
    HEADER_REUSABLE_TOKENS,
    HEADER_TURN,
    HeartbeatRequest,
    HeartbeatResponse,
    SessionStatus,
    error_body,
)
from kvtether.session import SessionSettings

from .servers import refused_url, serve_app

FAST = SessionSettings(heartbeat_interval_s=0.05, request_timeout_s=1.0)


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class Conversation:
    turns: int = 0
    held_tokens: int = 0
    state: str = "active"  # "active" | "released" | "gone"


@dataclass
class FakeRouter:
    url: str = ""
    received: list[Received] = field(default_factory=list)
    conversations: dict[str, Conversation] = field(default_factory=dict)
    replies: deque[dict[str, Any]] = field(default_factory=deque)
    heartbeat_status: int | None = None  # force this status on heartbeats
    delete_status: int | None = None  # force this status on DELETE of a session
    heartbeat_delay_s: float = 0.0
    chat_status: int | None = None  # force this status on the next chat request
    lease_remaining_s: float = 30.0
    send_headers: bool = True  # False: behave like plain vLLM

    def reset(self) -> None:
        self.received.clear()
        self.conversations.clear()
        self.replies.clear()
        self.heartbeat_status = None
        self.delete_status = None
        self.heartbeat_delay_s = 0.0
        self.chat_status = None
        self.lease_remaining_s = 30.0
        self.send_headers = True

    def requests_to(self, suffix: str) -> list[Received]:
        return [r for r in self.received if r.path.endswith(suffix)]


def _prompt_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        return 10 + sum(len(json.dumps(m)) // 4 for m in body["messages"])
    return 1 + len(str(body.get("prompt", ""))) // 4


def build_app(router: FakeRouter) -> Starlette:
    async def generate(request: Request) -> Response:
        body = await request.json()
        cid = request.headers.get(HEADER_CONVERSATION_ID)
        router.received.append(Received("POST", request.url.path, dict(request.headers), body))
        if router.chat_status is not None:
            status, router.chat_status = router.chat_status, None
            return JSONResponse(error_body("scripted failure", "server_error"), status_code=status)
        prompt = _prompt_tokens(body)
        conv = router.conversations.setdefault(cid, Conversation()) if cid else Conversation()
        if not cid:
            reuse, reused = "miss:no_conversation_id", 0
        elif conv.turns == 0:
            reuse, reused = "miss:first_turn", 0
        elif conv.state != "active":
            reuse, reused = ("miss:released" if conv.state == "released" else "miss:evicted"), 0
        else:
            reuse, reused = "fired", min(conv.held_tokens, prompt - 1)
        reusable = min(conv.held_tokens, prompt) if cid and conv.turns else 0
        reply = router.replies.popleft() if router.replies else {"content": f"ok {conv.turns}"}
        output = max(1, len(json.dumps(reply)) // 4)
        conv.turns += 1
        conv.held_tokens, conv.state = prompt + output, "active"
        headers = {}
        if router.send_headers:
            headers = {
                HEADER_REUSE: reuse,
                HEADER_REUSED_TOKENS: str(reused),
                HEADER_REUSABLE_TOKENS: str(reusable),
                HEADER_PROMPT_TOKENS: str(prompt),
                HEADER_TURN: str(conv.turns),
            }
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": output,
            "total_tokens": prompt + output,
        }
        chat = request.url.path.endswith("/chat/completions")
        if body.get("stream"):
            include = bool((body.get("stream_options") or {}).get("include_usage"))
            events = _stream_events(reply, usage if include else None, chat, body["model"])
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        return JSONResponse(_completion(reply, usage, chat, body["model"]), headers=headers)

    async def heartbeat(request: Request) -> Response:
        cid = request.path_params["cid"]
        raw = await request.body()
        router.received.append(
            Received("POST", request.url.path, dict(request.headers), json.loads(raw or b"{}"))
        )
        if router.heartbeat_delay_s:
            await asyncio.sleep(router.heartbeat_delay_s)
        if router.heartbeat_status is not None:
            return JSONResponse(error_body("scripted", "x"), status_code=router.heartbeat_status)
        try:
            HeartbeatRequest.model_validate_json(raw or b"{}")
        except ValidationError as exc:
            return JSONResponse(error_body(str(exc), "invalid_request_error"), status_code=400)
        conv = router.conversations.get(cid)
        if conv is None or conv.state == "released":
            return JSONResponse(error_body("unknown session", "not_found"), status_code=404)
        if conv.state == "gone":
            return JSONResponse(error_body("KV gone", "gone"), status_code=410)
        return JSONResponse(
            HeartbeatResponse(
                conversation_id=cid,
                lease_deadline_unix_s=time.time() + router.lease_remaining_s,
                lease_remaining_s=router.lease_remaining_s,
                retained_tokens=conv.held_tokens,
            ).model_dump()
        )

    async def session(request: Request) -> Response:
        cid = request.path_params["cid"]
        router.received.append(
            Received(request.method, request.url.path, dict(request.headers), None)
        )
        conv = router.conversations.get(cid)
        if conv is None or conv.state == "released":
            return JSONResponse(error_body("unknown session", "not_found"), status_code=404)
        if request.method == "DELETE":
            if router.delete_status is not None:
                return JSONResponse(error_body("scripted", "x"), status_code=router.delete_status)
            conv.state = "released"
            return Response(status_code=204)
        return JSONResponse(
            SessionStatus(
                conversation_id=cid,
                decode_instance="d0",
                retained_tokens=conv.held_tokens,
                lease_deadline_unix_s=None,
                lease_state="active",
                turns=[],
            ).model_dump()
        )

    async def models(request: Request) -> Response:
        router.received.append(Received("GET", request.url.path, dict(request.headers), None))
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": "fake", "object": "model", "created": 0, "owned_by": "kvtether"}],
            }
        )

    return Starlette(
        routes=[
            Route("/v1/chat/completions", generate, methods=["POST"]),
            Route("/v1/completions", generate, methods=["POST"]),
            Route("/v1/sessions/{cid}/heartbeat", heartbeat, methods=["POST"]),
            Route("/v1/sessions/{cid}", session, methods=["GET", "DELETE"]),
            Route("/v1/models", models, methods=["GET"]),
        ]
    )


def _completion(
    reply: dict[str, Any], usage: dict[str, int], chat: bool, model: str
) -> dict[str, Any]:
    if not chat:
        return {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 0,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": reply.get("content", ""),
                    "finish_reason": "stop",
                    "logprobs": None,
                }
            ],
            "usage": usage,
        }
    message: dict[str, Any] = {
        "role": "assistant",
        "content": reply.get("content"),
        "tool_calls": reply.get("tool_calls", []),
        "refusal": None,
    }
    if "reasoning" in reply:
        message["reasoning_content"] = reply["reasoning"]
    finish = "tool_calls" if reply.get("tool_calls") else "stop"
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": usage,
    }


async def _stream_events(
    reply: dict[str, Any], usage: dict[str, int] | None, chat: bool, model: str
) -> Any:
    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        obj = {
            "id": "c-1",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 0,
            "model": model,
            "choices": choices,
            **extra,
        }
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    if chat:
        yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}}])
        for piece in _pieces(reply.get("reasoning", "")):
            yield event([{"index": 0, "delta": {"reasoning_content": piece}}])
        for piece in _pieces(reply.get("content") or ""):
            yield event([{"index": 0, "delta": {"content": piece}}])
        for i, call in enumerate(reply.get("tool_calls", [])):
            fn = call["function"]
            yield event(
                [
                    {
                        "index": 0,
                        "delta": {
                            "tool_calls": [
                                {
                                    "index": i,
                                    "id": call["id"],
                                    "type": "function",
                                    "function": {"name": fn["name"], "arguments": ""},
                                }
                            ]
                        },
                    }
                ]
            )
            for piece in _pieces(fn["arguments"], size=5):
                yield event(
                    [
                        {
                            "index": 0,
                            "delta": {
                                "tool_calls": [{"index": i, "function": {"arguments": piece}}]
                            },
                        }
                    ]
                )
        finish = "tool_calls" if reply.get("tool_calls") else "stop"
        yield event([{"index": 0, "delta": {}, "finish_reason": finish}])
    else:
        for piece in _pieces(reply.get("content", "")):
            yield event([{"index": 0, "text": piece, "finish_reason": None}])
        yield event([{"index": 0, "text": "", "finish_reason": "stop"}])
    if usage is not None:
        yield event([], usage=usage)
    yield b"data: [DONE]\n\n"


def _pieces(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


# --- fixtures ---------------------------------------------------------------------------------
def heartbeat_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvtether-heartbeat")]


@pytest.fixture(scope="session")
def _server() -> Iterator[FakeRouter]:
    fake = FakeRouter()
    with serve_app(lambda _port: build_app(fake), name="fake-router", lifespan="off",
                   ws="none", http="h11") as url:
        fake.url = url
        yield fake


@pytest.fixture
def router(_server: FakeRouter) -> Iterator[FakeRouter]:
    _server.reset()
    yield _server
    # Every test must leave no heartbeat running: a leaked thread would renew a lease forever.
    assert heartbeat_threads() == []


@pytest.fixture
def dead_url() -> str:
    """A localhost URL nothing listens on: connections are refused at once."""
    return refused_url()
