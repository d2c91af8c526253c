"""Router test harness: the kvtether router in-process, in front of fake vLLM P/D instances.

:func:`make_router` builds one (the router tests' fixtures, the load driver and the router
benchmark use it); :class:`Harness` and :class:`Agent` talk to it as clients do.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvtether import protocol as p
from kvtether.router import RouterSettings, create_app

from .fake_vllm import BLOCK_SIZE, Cluster, FakeVLLM, RoutingTransport

SYSTEM_PROMPT = (
    "You are a careful coding agent. You plan, call tools, read their output and answer "
    "briefly. " + " ".join(f"rule{i} applies always" for i in range(30))
)


@dataclass
class Turn:
    """One answer of the router, parsed."""

    response: httpx.Response
    body: dict[str, Any] | None = None  # non-streamed JSON answer
    chunks: list[dict[str, Any]] | None = None  # streamed: every JSON chunk, in order
    lines: list[str] = field(default_factory=list)  # streamed: raw non-empty SSE lines

    @property
    def status(self) -> int:
        return self.response.status_code

    @property
    def headers(self) -> httpx.Headers:
        return self.response.headers

    @property
    def outcome(self) -> str | None:
        return self.headers.get(p.HEADER_REUSE)

    @property
    def reused(self) -> int:
        return int(self.headers[p.HEADER_REUSED_TOKENS])

    @property
    def usage(self) -> dict[str, Any]:
        if self.body is not None:
            return self.body["usage"]
        assert self.chunks is not None
        return next(c["usage"] for c in reversed(self.chunks) if c.get("usage"))

    @property
    def finish_reason(self) -> str | None:
        if self.body is not None:
            return self.body["choices"][0]["finish_reason"]
        assert self.chunks is not None
        return next(c["choices"][0]["finish_reason"] for c in reversed(self.chunks)
                    if c.get("choices") and c["choices"][0].get("finish_reason"))

    def assistant_message(self) -> dict[str, Any]:
        """The assistant message to append to the history (chat)."""
        if self.body is not None:
            m = self.body["choices"][0]["message"]
            out: dict[str, Any] = {"role": "assistant", "content": m.get("content")}
            if m.get("tool_calls"):
                out["tool_calls"] = m["tool_calls"]
            return out
        assert self.chunks is not None
        content, calls = "", []
        for c in self.chunks:
            for ch in c.get("choices") or []:
                d = ch.get("delta") or {}
                content += d.get("content") or ""
                calls += d.get("tool_calls") or []
        out = {"role": "assistant", "content": content or None}
        if calls:
            out["tool_calls"] = [{k: v for k, v in tc.items() if k != "index"} for tc in calls]
        return out

    def text(self) -> str:
        """Completions: the generated text."""
        if self.body is not None:
            return self.body["choices"][0]["text"]
        assert self.chunks is not None
        return "".join(ch.get("text", "") for c in self.chunks for ch in c.get("choices") or [])


def parse_sse(raw: str) -> tuple[list[str], list[dict[str, Any]]]:
    lines = [ln for ln in raw.split("\n") if ln.strip()]
    chunks = [json.loads(ln[6:]) for ln in lines
              if ln.startswith("data: ") and ln != "data: [DONE]"]
    return lines, chunks


class Harness:
    def __init__(self, cluster: Cluster, prefill: list[FakeVLLM], decode: list[FakeVLLM],
                 settings: RouterSettings, app: Any, client: httpx.AsyncClient,
                 transport: RoutingTransport) -> None:
        self.cluster = cluster
        self.prefill = prefill
        self.decode = decode
        self.p = prefill[0]
        self.d = decode[0]
        self.settings = settings
        self.app = app
        self.client = client
        self.transport = transport

    async def post(self, path: str, body: Any, *, conv: str | None = None,
                   headers: dict[str, str] | None = None) -> Turn:
        hdrs = dict(headers or {})
        if conv is not None:
            hdrs[p.HEADER_CONVERSATION_ID] = conv
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        r = await self.client.post(path, content=content,
                                   headers={"content-type": "application/json", **hdrs})
        turn = Turn(r)
        ctype = r.headers.get("content-type", "")
        if r.status_code == 200 and ctype.startswith("text/event-stream"):
            turn.lines, turn.chunks = parse_sse(r.text)
        elif ctype.startswith("application/json"):
            turn.body = r.json()
        return turn

    async def chat(self, messages: list[dict[str, Any]], conv: str | None = None, *,
                   stream: bool = False, headers: dict[str, str] | None = None,
                   **extra: Any) -> Turn:
        body = {"model": "tiny", "messages": messages, **extra}
        if stream:
            body["stream"] = True
        return await self.post("/v1/chat/completions", body, conv=conv, headers=headers)

    async def completion(self, prompt: Any, conv: str | None = None, *, stream: bool = False,
                         **extra: Any) -> Turn:
        body = {"model": "tiny", "prompt": prompt, **extra}
        if stream:
            body["stream"] = True
        return await self.post("/v1/completions", body, conv=conv)

    def conversation(self, cid: str | None, system: str = SYSTEM_PROMPT, *,
                     hints: dict[str, Any] | None = None) -> Agent:
        """A conversation; with ``hints`` (``{}`` will do) every turn carries them, as a
        kvtether client's do: its leases are sized as before harnesses (no answer-based
        lease, ``router.tool_leases``)."""
        return Agent(self, cid, [{"role": "system", "content": system}], hints=hints)

    async def metric(self, name: str, labels: str = "") -> float:
        text = (await self.client.get("/metrics")).text
        return metric_value(text, name, labels)

    def assert_kv_correct(self) -> None:
        """No engine ever read KV that was wrong, freed or misaligned."""
        assert self.cluster.violations == []

    def all_received(self) -> list[dict[str, Any]]:
        return [r.body for inst in (*self.prefill, *self.decode) for r in inst.requests]


def metric_value(text: str, name: str, labels: str = "") -> float:
    want = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == want:
            return float(value)
    return 0.0


class Agent:
    """A client-side conversation: keeps the message history, one turn at a time."""

    def __init__(self, h: Harness, cid: str | None, messages: list[dict[str, Any]], *,
                 hints: dict[str, Any] | None = None) -> None:
        self.h = h
        self.cid = cid
        self.messages = messages
        self.hints = hints  # sent with every turn (a kvtether client), unless a turn says
        self.turns: list[Turn] = []

    async def say(self, text: str, *, stream: bool = False, expect: int = 200,
                  **extra: Any) -> Turn:
        self.messages.append({"role": "user", "content": text})
        if self.hints is not None:
            extra.setdefault(p.BODY_HINTS, self.hints)
        turn = await self.h.chat(list(self.messages), self.cid, stream=stream, **extra)
        assert turn.status == expect, (turn.status, turn.response.text[:500])
        if turn.status == 200:
            self.messages.append(turn.assistant_message())
            self.turns.append(turn)
        else:
            self.messages.pop()
        return turn


@contextlib.asynccontextmanager
async def make_router(
    *, n_prefill: int = 1, n_decode: int = 1, control: bool = False,
    fake: dict[str, Any] | None = None, clock: Any = None, **settings: Any,
) -> AsyncIterator[Harness]:
    """A router app with its lifespan running, in front of fresh fake instances.

    ``clock`` (e.g. ``ManualClock``) is the router's; the fake instances keep real time, but
    tell their leases' deadlines in the router's clock (as a real connector's agree with the
    router's, both being wall clocks).
    """
    cluster = Cluster()
    if clock is not None:
        cluster.now_unix_s = clock.now_unix_s
    fake = fake or {}
    prefill = [
        cluster.add(FakeVLLM(cluster, f"prefill{i}", f"prefill{i}", 8100 + i,
                             side_channel_port=5600 + i, **fake), f"prefill{i}:{8100 + i}")
        for i in range(n_prefill)
    ]
    decode = []
    for i in range(n_decode):
        d = FakeVLLM(cluster, f"decode{i}", f"decode{i}", 8200 + i, control=control,
                     side_channel_port=5700 + i, **fake)
        hostports = [f"decode{i}:{8200 + i}"]
        if control:
            hostports.append(f"decode{i}-control:{8200 + i + 1000}")
        decode.append(cluster.add(d, *hostports))
    settings = {"kv_block_size_tokens": BLOCK_SIZE, "kv_recompute_threshold_tokens": 16,
                **settings}
    if os.environ.get("KVTETHER_TEST_ROUTER_STORE") and "store" not in settings:
        # The whole router suite against a shared store: KVTETHER_TEST_ROUTER_STORE=redis://...
        settings["store"] = os.environ["KVTETHER_TEST_ROUTER_STORE"]
        settings.setdefault("store_key_prefix", f"t{uuid.uuid4().hex[:8]}:")
    rs = RouterSettings(
        prefill_urls=[f.url for f in prefill],
        decode_urls=[d.url for d in decode],
        decode_control_urls=[d.control_url for d in decode] if control else [],
        **settings,
    )
    transport = RoutingTransport(cluster)
    app = create_app(rs, transport=transport, clock=clock)
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
        base_url="http://router",
    )
    async with app.router.lifespan_context(app), client:
        yield Harness(cluster, prefill, decode, rs, app, client, transport)

