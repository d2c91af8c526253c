"""Replays what a coding-agent harness sent (``tests/fixtures/harnesses/<harness>-<scenario>.json``,
recorded by ``scripts/record-harness-traffic.py`` against a scripted stand-in model) on a
kvtether router, and each request also on a colocated vLLM for reference.

A fixture holds every request the harness made, in arrival order, with the agent that made it
(``main``, ``sub-<name>``, ``side``: a tool-less side request such as OpenCode's title), the
session headers the router reads, the JSON body and the stand-in's answer. The replay sends
each request when those that had ended before it started in the recording have been answered
(an agent's turns in order; parallel subagents at once), streamed as recorded.

The real model answers differently from the stand-in, so before a request is sent each earlier
model answer in its history is replaced by what the stack under test answered to that request:
its text, put where the API keeps an answer's text (Messages: a text block before the answer's
``tool_use`` blocks; Responses: the assistant ``message`` item before its ``function_call``
items; chat: the assistant message's ``content``). The recorded tool calls stay, with their ids,
so the tool results still pair up; everything else stays as recorded. An answer is found in a
later history by what the stand-in answered: its tool-call ids, or its text (each unique).
A subagent's answer quoted in its parent's tool result is not an answer of the parent's and
stays as recorded. The new prompt then extends the sequence decode holds (the previous prompt
and the tokens it generated) as it would in a live session.

The harnesses set no temperature, which leaves sampling to the server's defaults (greedy for
the ``agents`` model, whose generation config says so; sampling at 1.0 for most models): the
replay sets ``temperature`` (0 by default) so that answers are greedy and comparable with the
reference, and sends the stack's model name instead of the stand-in's.
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvtether import protocol as p

__all__ = ["FIXTURES", "Answer", "Fixture", "Recorded", "ReplayedTurn", "fixture_paths",
           "load_fixture", "parse_answer", "replay", "replay_sync", "substitute", "unpack"]

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harnesses"
# Header values that name a conversation: made unique per replay (a stack keeps what a
# conversation retained until its lease ends).
_ID_HEADERS = frozenset({
    "x-conversation-id", "x-parent-conversation-id", "x-session-id", "x-parent-session-id",
    "x-session-affinity", "x-claude-code-session-id", "x-claude-code-agent-id",
    "x-claude-code-parent-agent-id", "thread-id", "thread_id", "session-id", "session_id",
    "x-codex-parent-thread-id",
})


# --------------------------------------------------------------------------- fixtures
@dataclass(frozen=True)
class Recorded:
    """One request of a recording and the stand-in's answer to it."""

    index: int
    path: str  # with its query (Claude Code: /v1/messages?beta=true)
    api: str  # messages / responses / chat
    agent: str
    invocation: int  # which run of the harness (a resume's second run: 1)
    headers: dict[str, str]
    body: dict[str, Any]
    answer_text: str
    answer_tool_ids: tuple[str, ...]
    started_s: float
    ended_s: float


@dataclass(frozen=True)
class Fixture:
    harness: str
    harness_version: str
    scenario: str
    requests: list[Recorded]

    @property
    def name(self) -> str:
        return f"{self.harness}-{self.scenario}"

    def agents(self) -> dict[str, list[Recorded]]:
        """Each agent's requests, in order."""
        out: dict[str, list[Recorded]] = {}
        for r in self.requests:
            out.setdefault(r.agent, []).append(r)
        return out

    def before(self, index: int) -> list[int]:
        """The requests answered before request ``index`` was sent, in the recording."""
        started = self.requests[index].started_s
        return [r.index for r in self.requests
                if r.index != index and r.ended_s <= started]


def unpack(obj: Any, blobs: Mapping[str, Any]) -> Any:
    """A fixture part with its ``{"$blob": key}`` references (parts repeated from request to
    request, stored once) replaced by what they stand for."""
    if isinstance(obj, dict):
        if len(obj) == 1 and "$blob" in obj:
            return unpack(blobs[obj["$blob"]], blobs)
        return {k: unpack(v, blobs) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unpack(v, blobs) for v in obj]
    return obj


def load_fixture(path: Path | str) -> Fixture:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    blobs = data.get("blobs", {})
    requests = [
        Recorded(index=i, path=r["path"], api=r["api"], agent=r["agent"],
                 invocation=r.get("invocation", 0), headers=dict(r["headers"]),
                 body=unpack(r["body"], blobs), answer_text=r["answer"]["text"],
                 answer_tool_ids=tuple(c["id"] for c in r["answer"]["tool_calls"]),
                 started_s=r["started_s"], ended_s=r["ended_s"])
        for i, r in enumerate(data["requests"])
    ]
    return Fixture(data["harness"], data["harness_version"], data["scenario"], requests)


def fixture_paths() -> list[Path]:
    return sorted(FIXTURES.glob("*.json"))


# --------------------------------------------------------------------------- substitution
@dataclass(frozen=True)
class _Earlier:
    index: int
    text: str  # the stand-in's
    tool_ids: tuple[str, ...]
    real: str  # what the stack under test answered


def substitute(body: dict[str, Any], api: str,
               earlier: Mapping[int, tuple[Recorded, str]]) -> tuple[dict[str, Any], list[int]]:
    """``body`` with each earlier answer (``{index: (recorded request, real text)}``) found in
    its history carrying the real text instead of the stand-in's; and the indices found.
    ``body`` itself is left as it is."""
    answers = [_Earlier(i, r.answer_text, r.answer_tool_ids, real)
               for i, (r, real) in earlier.items()]
    by_tool = {t: a for a in answers for t in a.tool_ids}
    by_text = {a.text: a for a in answers if a.text and not a.tool_ids}
    body = copy.deepcopy(body)
    found: list[int] = []
    if api == "responses":
        body["input"] = _responses(body["input"], by_tool, by_text, found)
    elif api == "messages":
        body["messages"] = [_message(m, by_tool, by_text, found) for m in body["messages"]]
    else:
        body["messages"] = [_chat(m, by_tool, by_text, found) for m in body["messages"]]
    return body, sorted(set(found))


def _message(m: dict[str, Any], by_tool: dict[str, _Earlier], by_text: dict[str, _Earlier],
             found: list[int]) -> dict[str, Any]:
    """Anthropic Messages: an assistant message's text blocks."""
    content = m.get("content")
    if m.get("role") != "assistant":
        return m
    if isinstance(content, str):
        if (a := by_text.get(content)) is None:
            return m
        found.append(a.index)
        return {**m, "content": a.real or "."}  # Anthropic refuses an empty text
    if not isinstance(content, list):
        return m
    owner = next((by_tool[b["id"]] for b in content
                  if b.get("type") == "tool_use" and b.get("id") in by_tool), None)
    if owner is None:
        owner = next((by_text[b["text"]] for b in content
                      if b.get("type") == "text" and b.get("text") in by_text), None)
    if owner is None:
        return m
    found.append(owner.index)
    out: list[dict[str, Any]] = []
    for b in content:
        if b.get("type") == "text" and owner.text and b.get("text") == owner.text:
            out.append({**b, "text": owner.real or "."})
            continue
        if (b.get("type") == "tool_use" and b.get("id") in owner.tool_ids and owner.real
                and not any(x.get("type") == "text" for x in out)):
            out.append({"type": "text", "text": owner.real})  # text streams before tool_use
        out.append(b)
    return {**m, "content": out}


def _responses(items: list[Any], by_tool: dict[str, _Earlier], by_text: dict[str, _Earlier],
               found: list[int]) -> list[Any]:
    """Responses: the assistant message item of an answer (inserted before its function calls
    when the stand-in's answer had no text)."""
    out: list[Any] = []
    inserted: set[int] = set()
    for it in items:
        kind = it.get("type", "message") if isinstance(it, dict) else None
        if kind == "message" and it.get("role") == "assistant":
            text = "".join(c.get("text", "") for c in it.get("content") or []
                           if isinstance(c, dict) and c.get("type") == "output_text")
            if (a := by_text.get(text)) is not None:
                found.append(a.index)
                content = [{**c, "text": a.real} if c.get("type") == "output_text" else c
                           for c in it["content"]]
                out.append({**it, "content": content})
                continue
        if kind == "function_call" and (a := by_tool.get(it.get("call_id"))) is not None:
            found.append(a.index)
            if a.real and a.index not in inserted:
                inserted.add(a.index)
                out.append({"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": a.real, "annotations": []}]})
        out.append(it)
    return out


def _chat(m: dict[str, Any], by_tool: dict[str, _Earlier], by_text: dict[str, _Earlier],
          found: list[int]) -> dict[str, Any]:
    """Chat completions: the assistant message's content."""
    if m.get("role") != "assistant":
        return m
    owner = next((by_tool[tc["id"]] for tc in m.get("tool_calls") or []
                  if tc.get("id") in by_tool), None)
    if owner is None and isinstance(m.get("content"), str):
        owner = by_text.get(m["content"])
    if owner is None:
        return m
    found.append(owner.index)
    return {**m, "content": owner.real}


# --------------------------------------------------------------------------- answers
def _events(raw: str) -> list[tuple[str | None, Any]]:
    """An SSE body's (event name, JSON data) frames; ``[DONE]`` left out."""
    out = []
    for frame in raw.replace("\r\n", "\n").split("\n\n"):
        event, data = None, []
        for line in frame.split("\n"):
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if not data or data == ["[DONE]"]:
            continue
        try:
            out.append((event, json.loads("\n".join(data))))
        except ValueError:
            out.append((event, {"unparsed": "\n".join(data)}))
    return out


@dataclass(frozen=True)
class Answer:
    """A response body read in its API's shape, streamed or not."""

    text: str
    output_tokens: int | None  # from the answer's usage, where it has one
    error: str | None  # an error answer, or an error event that ended the stream


def parse_answer(api: str, content_type: str, raw: str) -> Answer:
    if not content_type.startswith("text/event-stream"):
        try:
            data = json.loads(raw)
        except ValueError:
            return Answer("", None, f"not JSON: {raw[:200]}")
        if not isinstance(data, dict):
            return Answer("", None, f"unexpected answer: {raw[:200]}")
        if "error" in data:
            return Answer("", None, json.dumps(data["error"])[:500])
        usage = data.get("usage") or {}
        if api == "messages":
            return Answer("".join(b.get("text", "") for b in data.get("content") or []
                                  if b.get("type") == "text"), usage.get("output_tokens"), None)
        if api == "responses":
            return Answer(_output_text(data.get("output") or []), usage.get("output_tokens"),
                          None)
        choice = (data.get("choices") or [{}])[0]
        return Answer((choice.get("message") or {}).get("content") or "",
                      usage.get("completion_tokens"), None)
    text, final, tokens, error = "", None, None, None
    for event, data in _events(raw):
        kind = data.get("type") if isinstance(data, dict) else None
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        if event == "error" or kind in ("error", "response.failed") or "unparsed" in data \
                or (api == "chat" and "error" in data):
            error = json.dumps(data)[:500]
        elif api == "messages" and kind == "content_block_delta":
            text += (data.get("delta") or {}).get("text", "")
        elif api == "messages" and kind == "message_delta":
            tokens = usage.get("output_tokens", tokens)
        elif api == "responses" and kind == "response.output_text.delta":
            text += data.get("delta", "")
        elif api == "responses" and kind == "response.completed":
            response = data.get("response") or {}
            final = _output_text(response.get("output") or [])
            tokens = (response.get("usage") or {}).get("output_tokens")
        elif api == "chat":
            for choice in data.get("choices") or []:
                text += (choice.get("delta") or {}).get("content") or ""
            tokens = usage.get("completion_tokens", tokens)
    return Answer(final if final is not None else text, tokens, error)


def _output_text(output: list[Any]) -> str:
    return "".join(c.get("text", "") for it in output if it.get("type") == "message"
                   for c in it.get("content") or [] if c.get("type") == "output_text")


# --------------------------------------------------------------------------- replay
@dataclass
class ReplayedTurn:
    """What the stack answered to one recorded request (and the reference, if asked)."""

    index: int
    agent: str
    api: str
    status: int
    text: str
    output_tokens: int | None
    error: str | None
    reuse: str | None  # X-KVTether-Reuse
    reused_tokens: int | None
    reusable_tokens: int | None
    prompt_tokens: int | None
    salvaged_tokens: int | None  # only when the prompt diverged from what decode held
    conversation_id: str | None
    substituted: list[int]  # the earlier answers put into this request's history
    body: dict[str, Any] = field(repr=False)  # what was sent
    reference_status: int | None = None
    reference_text: str | None = None
    reference_error: str | None = None


def _int(headers: httpx.Headers, name: str) -> int | None:
    value = headers.get(name)
    return int(value) if value is not None and value.lstrip("-").isdigit() else None


def _headers(recorded: Mapping[str, str], tag: str) -> dict[str, str]:
    out = {"content-type": "application/json"}
    for name, value in recorded.items():
        out[name] = f"{tag}-{value}" if name in _ID_HEADERS else value
    return out


async def _post(client: httpx.AsyncClient, r: Recorded, body: dict[str, Any],
                headers: dict[str, str]) -> tuple[httpx.Response, Answer]:
    response = await client.post(r.path, content=json.dumps(body, ensure_ascii=False).encode(),
                                 headers=headers)
    raw = response.text
    if response.status_code != 200:
        return response, Answer("", None, raw[:1000])
    return response, parse_answer(r.api, response.headers.get("content-type", ""), raw)


async def replay(fixture: Fixture, router: httpx.AsyncClient,
                 reference: httpx.AsyncClient | None = None, *, model: str,
                 temperature: float | None = 0.0, tag: str | None = None,
                 substitute_answers: bool = True, tool_gap_s: float = 0.0) -> list[ReplayedTurn]:
    """Replay ``fixture`` through ``router`` (a client whose base URL is a kvtether router),
    and each request also through ``reference`` (a colocated vLLM) when given; one
    :class:`ReplayedTurn` per recorded request, in recorded order.

    ``model``: the served model name sent instead of the stand-in's. ``temperature``: set on
    every request (None: as recorded). ``tag``: prefixed to every session id the harness sent
    (default: a fresh one), so that replays do not continue each other's conversations.
    ``substitute_answers=False`` leaves the stand-in's answers in the histories (to show what
    the substitution is for: the prompts then diverge from what decode holds). ``tool_gap_s``:
    how long each agent's tools "run" before its next request (nothing is sent meanwhile).
    """
    tag = tag or f"replay{uuid.uuid4().hex[:8]}"
    answered = {r.index: asyncio.Event() for r in fixture.requests}
    real: dict[int, str] = {}
    results: dict[int, ReplayedTurn] = {}

    async def one(r: Recorded) -> None:
        try:
            deps = fixture.before(r.index)
            for j in deps:
                await answered[j].wait()
            if tool_gap_s and any(fixture.requests[j].agent == r.agent for j in deps):
                await asyncio.sleep(tool_gap_s)
            earlier = {j: (fixture.requests[j], real[j]) for j in deps}
            body, found = substitute(r.body, r.api, earlier if substitute_answers else {})
            body["model"] = model
            if temperature is not None:
                body["temperature"] = temperature
            response, answer = await _post(router, r, body, _headers(r.headers, tag))
            h = response.headers
            turn = ReplayedTurn(
                index=r.index, agent=r.agent, api=r.api, status=response.status_code,
                text=answer.text, output_tokens=answer.output_tokens, error=answer.error,
                reuse=h.get(p.HEADER_REUSE),
                reused_tokens=_int(h, p.HEADER_REUSED_TOKENS),
                reusable_tokens=_int(h, p.HEADER_REUSABLE_TOKENS),
                prompt_tokens=_int(h, p.HEADER_PROMPT_TOKENS),
                salvaged_tokens=_int(h, p.HEADER_SALVAGED_TOKENS),
                conversation_id=h.get(p.HEADER_CONVERSATION_ID), substituted=found, body=body)
            if reference is not None:
                ref, ref_answer = await _post(reference, r, body,
                                              {"content-type": "application/json"})
                turn.reference_status = ref.status_code
                turn.reference_text, turn.reference_error = ref_answer.text, ref_answer.error
            results[r.index] = turn
            # A failed request leaves the stand-in's answer in the histories that follow.
            if response.status_code == 200 and answer.error is None:
                real[r.index] = answer.text
        finally:
            real.setdefault(r.index, r.answer_text)
            answered[r.index].set()

    await asyncio.gather(*(one(r) for r in fixture.requests))
    return [results[i] for i in sorted(results)]


def replay_sync(fixture: Fixture, router_url: str, reference_url: str | None = None, *,
                model: str, temperature: float | None = 0.0, timeout_s: float = 900.0,
                tag: str | None = None, tool_gap_s: float = 0.0) -> list[ReplayedTurn]:
    """:func:`replay` against base URLs, from synchronous code (the real-stack tests)."""

    async def run() -> list[ReplayedTurn]:
        timeout = httpx.Timeout(timeout_s)
        async with httpx.AsyncClient(base_url=router_url, timeout=timeout) as router:
            if reference_url is None:
                return await replay(fixture, router, model=model, temperature=temperature,
                                    tag=tag, tool_gap_s=tool_gap_s)
            async with httpx.AsyncClient(base_url=reference_url, timeout=timeout) as ref:
                return await replay(fixture, router, ref, model=model,
                                    temperature=temperature, tag=tag, tool_gap_s=tool_gap_s)

    return asyncio.run(run())
