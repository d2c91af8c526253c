"""Record what Claude Code, Codex and OpenCode send through a tool loop, two parallel subagents
and a resume, as fixtures that tests/support/harness_replay.py replays on a real stack.

    python scripts/record-harness-traffic.py                      # every harness and scenario
    python scripts/record-harness-traffic.py --harness codex --scenario subagents
    python scripts/record-harness-traffic.py --bin-dir /tmp/h/node_modules/.bin --out DIR

CPU models rarely call tools, so the model here is a scripted stand-in on loopback: it speaks
each harness's API as it streams (Anthropic Messages SSE, also on ``/v1/messages?beta=true``;
Responses SSE; chat-completions SSE with ``include_usage``) and answers from the scenario's
script, deciding from the request itself: which agent asks (the ``#kvt-...`` marker of the
prompt that started it) and how many of its own answers the history already holds after that
prompt. Every request is recorded (method, path with query, the session and agent headers the
router reads, the JSON body) with the answer given, scrubbed (the run's directories, host name,
date, session ids and keys become placeholders) and written to
``tests/fixtures/harnesses/<harness>-<scenario>.json``. Stdlib only; needs Node (the harnesses),
``rg`` (OpenCode) and nothing beyond loopback: telemetry, update checks and plugin syncs are off.

Re-record when a pinned harness version moves (``HARNESS_VERSIONS``; the script refuses another
installed version unless ``--any-version``), and say what changed in the commit message.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import http.server
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "harnesses"
FORMAT_VERSION = 1
# The versions `make test` installs (scripts/setup-harnesses.sh) are the ones recorded.
_PINNED = json.loads((ROOT / "scripts" / "harnesses" / "package.json").read_text())
HARNESS_VERSIONS = {"claude": _PINNED["dependencies"]["@anthropic-ai/claude-code"],
                    "codex": _PINNED["dependencies"]["@openai/codex"],
                    "opencode": _PINNED["dependencies"]["opencode-ai"]}
HARNESS_DIR = Path(os.environ.get("KVTETHER_HARNESS_DIR", ROOT / ".kvtether" / "harnesses"))
SCENARIOS = ("tool-loop", "subagents", "resume")
MODEL = "standin"
SUBAGENTS = ("alpha", "beta")
RUN_TIMEOUT_S = 240.0

# The headers the router reads to tell conversations apart (kvtether.router.identity), and the
# ones the harnesses send next to them (notes/coding-harnesses.md). Nothing else is recorded:
# keys, user agents and versions stay out of the fixtures.
IDENTITY_HEADERS = (
    "x-conversation-id", "x-parent-conversation-id", "x-session-id", "x-parent-session-id",
    "x-session-affinity", "x-claude-code-session-id", "x-claude-code-agent-id",
    "x-claude-code-parent-agent-id", "thread-id", "thread_id", "session-id", "session_id",
    "x-codex-parent-thread-id", "x-openai-subagent", "x-kvtether-end",
)
API_PATHS = {"/v1/messages": "messages", "/v1/responses": "responses",
             "/v1/chat/completions": "chat"}


# --------------------------------------------------------------------------- scrubbing
# Ids that change from one recording to the next: uuids (Claude Code's session and device ids,
# Codex's thread, turn and item ids), OpenCode's ses_/msg_/prt_ ids, 64-hex device ids.
_ID = re.compile(
    r"(?<![0-9A-Za-z])(?:[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
    r"|(?:ses|msg|prt)_[0-9a-f]{12}[0-9A-Za-z]{14}|[0-9a-f]{64}|a[0-9a-f]{16})(?![0-9A-Za-z])"
)  # a + 16 hex: Claude Code's agent ids
_KEY = re.compile(r"\b(?:sk|key)-[A-Za-z0-9_-]{6,}\b")
_UNIX_MS = re.compile(r"(?<![0-9])1[0-9]{12}(?![0-9])")


class Scrubber:
    """Replaces what is of this machine or this run with placeholders, the same way in every
    request of a recording, so that a request still extends the one before it.

    ``paths``: (literal, placeholder), longest first. Ids (uuids, OpenCode's ``ses_`` ids) each
    become ``id-<n>`` in order of appearance; the date, host name and keys their placeholders.
    """

    def __init__(self, paths: list[tuple[str, str]], *, day: dt.date | None = None,
                 host: str | None = None, os_release: str | None = None) -> None:
        self.literals = sorted(((a, b) for a, b in paths if a), key=lambda ab: -len(ab[0]))
        if host:
            self.literals.append((host, "<HOST>"))
        if os_release:
            self.literals.append((os_release, "<OS-RELEASE>"))
        if day is not None:
            for text in _date_forms(day):
                self.literals.append((text, "<DATE>"))
        self.ids: dict[str, str] = {}
        self.now_ms = time.time() * 1000

    def text(self, s: str) -> str:
        for literal, placeholder in self.literals:
            if literal in s:
                s = s.replace(literal, placeholder)
        s = _ID.sub(self._id, s)
        s = _UNIX_MS.sub(self._time, s)
        return _KEY.sub("<KEY>", s)

    def _time(self, m: re.Match[str]) -> str:
        # A Unix time in ms within a day of the recording (Codex's turn metadata).
        return "<UNIX-MS>" if abs(int(m.group(0)) - self.now_ms) < 86_400_000 else m.group(0)

    def _id(self, m: re.Match[str]) -> str:
        value = m.group(0)
        if value not in self.ids:
            prefix = value[:4] if value[3:4] == "_" else ""
            self.ids[value] = f"{prefix}id-{len(self.ids) + 1}"
        return self.ids[value]

    def __call__(self, obj: Any) -> Any:
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, list):
            return [self(v) for v in obj]
        if isinstance(obj, dict):
            return {self.text(k) if isinstance(k, str) else k: self(v) for k, v in obj.items()}
        return obj


def _date_forms(day: dt.date) -> list[str]:
    d = dt.datetime(day.year, day.month, day.day)
    return [day.isoformat(), d.strftime("%a %b %d %Y"), d.strftime("%A, %B %-d, %Y"),
            d.strftime("%B %-d, %Y"), d.strftime("%Y/%m/%d"), d.strftime("%m/%d/%Y")]


# --------------------------------------------------------------------------- packing
BLOB_MIN_CHARS = 1024  # smaller repeated parts stay inline


def _canonical(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def pack(bodies: list[Any]) -> tuple[list[Any], dict[str, Any]]:
    """Every part of ``bodies`` (a string, list or object of at least ``BLOB_MIN_CHARS``
    characters of JSON) that occurs more than once is stored once, in ``blobs``, and replaced
    by ``{"$blob": key}``: a harness resends its system prompt, tools and history each turn.
    ``harness_replay.unpack`` restores the bodies exactly (key order included)."""
    counts: dict[str, int] = {}

    def count(obj: Any) -> None:
        if isinstance(obj, (str, list, dict)):
            text = _canonical(obj)
            if len(text) >= BLOB_MIN_CHARS:
                counts[text] = counts.get(text, 0) + 1
                if counts[text] > 1:
                    return  # its parts were counted with its first occurrence
        for child in (obj.values() if isinstance(obj, dict) else
                      obj if isinstance(obj, list) else ()):
            count(child)

    blobs: dict[str, Any] = {}

    def encode(obj: Any) -> Any:
        if isinstance(obj, (str, list, dict)):
            text = _canonical(obj)
            if len(text) >= BLOB_MIN_CHARS and counts.get(text, 0) > 1:
                key = hashlib.sha256(text.encode()).hexdigest()[:16]
                if key not in blobs:
                    blobs[key] = None  # reserved before its parts, so parents come first
                    blobs[key] = encode_parts(obj)
                return {"$blob": key}
        return encode_parts(obj)

    def encode_parts(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: encode(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [encode(v) for v in obj]
        return obj

    for body in bodies:
        count(body)
    return [encode(body) for body in bodies], blobs


# --------------------------------------------------------------------------- the stand-in
@dataclass
class ToolCall:
    call_id: str
    name: str
    arguments: dict[str, Any]
    namespace: str | None = None  # Responses: a tool of a namespace (Codex's multi_agent_v1)


@dataclass
class Answer:
    agent: str  # main / sub-alpha / sub-beta / side
    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    number: int = 0  # the stand-in's answers are numbered in the order it gave them


_MARK = re.compile(r"#kvt-(main|sub-[a-z]+)\b")
_ANSWER_ID = re.compile(r"kvt[_-]a(\d{4})")


@dataclass
class View:
    """A request as the stand-in reads it, whatever its API."""

    tools: dict[str, dict[str, Any]]  # name -> JSON schema of its arguments
    namespaces: dict[str, str]  # Responses: tool name -> its namespace
    items: list[tuple[str, str]]  # (role, text) in order: user / assistant / tool
    results: dict[str, str]  # call id -> tool output


def view_of(api: str, body: dict[str, Any]) -> View:
    tools: dict[str, dict[str, Any]] = {}
    namespaces: dict[str, str] = {}
    items: list[tuple[str, str]] = []
    results: dict[str, str] = {}
    for t in body.get("tools") or []:
        if api == "messages":
            if "name" in t:
                tools[t["name"]] = t.get("input_schema") or {}
        elif api == "chat":
            fn = t.get("function") or {}
            if "name" in fn:
                tools[fn["name"]] = fn.get("parameters") or {}
        elif t.get("type") == "namespace":
            for tt in t.get("tools") or []:
                tools[tt["name"]] = tt.get("parameters") or {}
                namespaces[tt["name"]] = t["name"]
        elif "name" in t:
            tools[t["name"]] = t.get("parameters") or {}
    if api == "responses":
        for it in body.get("input") or []:
            kind = it.get("type", "message")
            if kind == "message":
                items.append((it.get("role", ""), _text(it.get("content"))))
            elif kind in ("function_call", "custom_tool_call"):
                items.append(("assistant", f"{it.get('call_id')} {it.get('name')}"))
            elif kind in ("function_call_output", "custom_tool_call_output"):
                out = _text(it.get("output"))
                results[it.get("call_id", "")] = out
                items.append(("tool", out))
        return View(tools, namespaces, items, results)
    for m in body.get("messages") or []:
        role, content = m.get("role", ""), m.get("content")
        if api == "messages" and isinstance(content, list):
            for b in content:
                if b.get("type") == "tool_result":
                    out = _text(b.get("content"))
                    results[b.get("tool_use_id", "")] = out
                    items.append(("tool", out))
                elif b.get("type") == "tool_use":
                    items.append(("assistant", f"{b.get('id')} {b.get('name')}"))
                elif b.get("type") == "text":
                    items.append((role, b.get("text", "")))
            continue
        if role == "tool":
            results[m.get("tool_call_id", "")] = _text(content)
        items.append((role, _text(content)))
        for tc in m.get("tool_calls") or []:
            items.append(("assistant", f"{tc.get('id')} {(tc.get('function') or {}).get('name')}"))
    return View(tools, namespaces, items, results)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_text(c) for c in content)
    if isinstance(content, dict):
        for key in ("text", "content", "output"):
            if key in content:
                return _text(content[key])
    return ""


class Script:
    """What the stand-in answers, per scenario and agent, one step at a time.

    A step is the number of the stand-in's own answers the history holds after the prompt that
    started the agent (the last ``#kvt-...`` marker in a user message).
    """

    def __init__(self, harness: str, scenario: str) -> None:
        self.harness = harness
        self.scenario = scenario
        self.invocation = 0  # which run of the harness asks (resume: 0, then 1)
        self._next = 0
        self._lock = threading.Lock()

    def answer_number(self) -> int:
        with self._lock:
            self._next += 1
            return self._next

    def decide(self, api: str, body: dict[str, Any]) -> Answer:
        n = self.answer_number()
        answer = self._decide(view_of(api, body), n)
        answer.number = n
        return answer

    def _decide(self, v: View, n: int) -> Answer:
        start, agent = 0, None
        for i, (role, text) in enumerate(v.items):
            if role == "user" and (m := _MARK.findall(text)):
                start, agent = i, m[-1]
        if not v.tools or agent is None:
            # A side request (OpenCode's title, any tool-less call): one line of text.
            return Answer("side", f"Recorded session (kvt-a{n:04d})")
        answered = {a for role, text in v.items[start + 1:] if role == "assistant"
                    for a in _ANSWER_ID.findall(text)}
        step = len(answered)
        if agent.startswith("sub-"):
            name = agent[4:]
            if step == 0:
                return Answer(agent, "", [self._shell(v, n, 1, f"echo subagent {name} ran")])
            return Answer(agent, f"Subagent {name} found its marker (kvt-a{n:04d}).")
        if self.scenario == "tool-loop":
            if step == 0:
                return Answer(agent, "", [self._shell(v, n, 1, "ls")])
            if step == 1:
                return Answer(agent, "", [self._shell(v, n, 1, "echo tool loop step two")])
            return Answer(agent, f"Both commands ran; the loop is done (kvt-a{n:04d}).")
        if self.scenario == "resume":
            if step == 0:
                command = "echo first run" if self.invocation == 0 else "echo continued run"
                return Answer(agent, "", [self._shell(v, n, 1, command)])
            return Answer(agent, f"The command ran (kvt-a{n:04d}).")
        return self._orchestrate(agent, v, step, n)

    def _orchestrate(self, agent: str, v: View, step: int, n: int) -> Answer:
        spawn = _first(v.tools, ("Agent", "Task", "task", "spawn_agent"))
        if spawn is None:  # no subagent tool: two tool calls in one answer instead
            if step == 0:
                return Answer(agent, "", [self._shell(v, n, 1, "echo parallel one"),
                                          self._shell(v, n, 2, "echo parallel two")])
            return Answer(agent, f"Both commands ran in parallel (kvt-a{n:04d}).")
        if step == 0:
            return Answer(agent, "", [self._spawn(v, spawn, n, i + 1, name)
                                      for i, name in enumerate(SUBAGENTS)])
        if spawn == "spawn_agent" and "wait_agent" in v.tools:
            # Codex: spawn_agent answers at once with the agent's id; wait_agent returns when
            # one of the agents it names finished (so does a <subagent_notification>). Wait
            # until both have.
            spawned, finished = _codex_agents(v)
            pending = [i for i in spawned if i not in finished]
            if pending and step < 5:
                return Answer(agent, "", [ToolCall(_call_id(n, 1), "wait_agent",
                                                   {"targets": pending, "timeout_ms": 60000},
                                                   v.namespaces.get("wait_agent"))])
        # The main agent's last word. Claude Code runs its agents in the background: this ends
        # the turn that started them, and answers each agent's report, which comes back later
        # as a notification in a user message.
        return Answer(agent, f"Noted what the subagents said so far (kvt-a{n:04d}).")

    def _shell(self, v: View, n: int, k: int, command: str) -> ToolCall:
        name = _first(v.tools, ("Bash", "bash", "exec_command", "shell_command", "shell"))
        if name is None:
            raise RuntimeError(f"no shell tool among {sorted(v.tools)}")
        props = (v.tools[name].get("properties") or {})
        args: dict[str, Any] = {}
        if "cmd" in props:
            args["cmd"] = command
        elif (props.get("command") or {}).get("type") == "array":
            args["command"] = ["bash", "-lc", command]
        else:
            args["command"] = command
        if "description" in props:
            args["description"] = f"Run {command.split()[0]}"
        return ToolCall(_call_id(n, k), name, args)

    def _spawn(self, v: View, tool: str, n: int, k: int, name: str) -> ToolCall:
        prompt = (f"#kvt-sub-{name} You are subagent {name}. Run `echo subagent {name} ran` "
                  "with your shell tool, then report what it printed in one sentence.")
        props = (v.tools[tool].get("properties") or {})
        args: dict[str, Any] = {}
        if tool == "spawn_agent":
            args["message"] = prompt
            if "fork_context" in props:
                args["fork_context"] = False
            return ToolCall(_call_id(n, k), tool, args, v.namespaces.get(tool))
        # Claude Code's Agent / Task, OpenCode's task.
        args = {"description": f"Subagent {name}", "prompt": prompt}
        if "subagent_type" in props:
            types = props["subagent_type"].get("enum") or []
            default = "general-purpose" if self.harness == "claude" else "general"
            args["subagent_type"] = types[0] if types else default
        return ToolCall(_call_id(n, k), tool, args)


def _first(tools: dict[str, Any], names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in tools), None)


def _codex_agents(v: View) -> tuple[list[str], set[str]]:
    """Codex: the agents spawn_agent started, and those that wait_agent or a notification
    reported finished."""
    spawned: list[str] = []
    finished: set[str] = set()
    texts = list(v.results.values()) + [
        t.split("<subagent_notification>", 1)[1].split("</subagent_notification>", 1)[0]
        for role, t in v.items if role == "user" and "<subagent_notification>" in t]
    for text in texts:
        try:
            data = json.loads(text)
        except ValueError:
            continue
        if not isinstance(data, dict):
            continue
        if isinstance(data.get("agent_id"), str):
            spawned.append(data["agent_id"])
        status = data.get("status")
        if isinstance(status, dict):
            if "agent_path" in data:
                status = {data["agent_path"]: status}
            finished |= {k for k, s in status.items()
                         if isinstance(s, dict) and ("completed" in s or "errored" in s)}
    return spawned, finished


def _call_id(n: int, k: int) -> str:
    return f"call_kvt_a{n:04d}_{k}"


# --------------------------------------------------------------------------- the wire
def _tool_id(api: str, call: ToolCall) -> str:
    return call.call_id.replace("call_", "toolu_", 1) if api == "messages" else call.call_id


def answer_events(api: str, answer: Answer, stream_options: dict[str, Any] | None,
                  prompt_chars: int) -> list[tuple[str | None, Any]]:
    """The answer as the API's stream: (event name or None, data) frames."""
    rid = f"{answer.agent}-a{answer.number:04d}"
    input_tokens = max(1, prompt_chars // 4)
    out_tokens = max(1, len(answer.text.split()) + 8 * len(answer.tool_calls))
    frames: list[tuple[str | None, Any]] = []
    if api == "messages":
        frames.append(("message_start", {"type": "message_start", "message": {
            "id": f"msg_{rid}", "type": "message", "role": "assistant", "model": MODEL,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 1}}}))
        index = 0
        if answer.text:
            frames += [
                ("content_block_start", {"type": "content_block_start", "index": 0,
                                         "content_block": {"type": "text", "text": ""}}),
                ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                         "delta": {"type": "text_delta", "text": answer.text}}),
                ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ]
            index = 1
        for call in answer.tool_calls:
            frames += [
                ("content_block_start", {"type": "content_block_start", "index": index,
                                         "content_block": {"type": "tool_use",
                                                           "id": _tool_id(api, call),
                                                           "name": call.name, "input": {}}}),
                ("content_block_delta", {"type": "content_block_delta", "index": index,
                                         "delta": {"type": "input_json_delta",
                                                   "partial_json": json.dumps(call.arguments)}}),
                ("content_block_stop", {"type": "content_block_stop", "index": index}),
            ]
            index += 1
        frames += [
            ("message_delta", {"type": "message_delta", "delta": {
                "stop_reason": "tool_use" if answer.tool_calls else "end_turn",
                "stop_sequence": None}, "usage": {"output_tokens": out_tokens}}),
            ("message_stop", {"type": "message_stop"}),
        ]
        return frames
    if api == "responses":
        seq = iter(range(1000))
        resp = {"id": f"resp_{rid}", "object": "response", "created_at": 0, "model": MODEL,
                "status": "in_progress", "output": []}
        frames.append(("response.created", {"type": "response.created",
                                            "sequence_number": next(seq), "response": resp}))
        output = []
        if answer.text:
            item = {"type": "message", "id": f"msg_{rid}", "role": "assistant",
                    "status": "completed", "content": [{"type": "output_text",
                                                        "text": answer.text, "annotations": []}]}
            index = len(output)
            frames += [
                ("response.output_item.added", {
                    "type": "response.output_item.added", "sequence_number": next(seq),
                    "output_index": index, "item": {**item, "status": "in_progress",
                                                    "content": []}}),
                ("response.output_text.delta", {
                    "type": "response.output_text.delta", "sequence_number": next(seq),
                    "item_id": item["id"], "output_index": index, "content_index": 0,
                    "delta": answer.text}),
                ("response.output_item.done", {
                    "type": "response.output_item.done", "sequence_number": next(seq),
                    "output_index": index, "item": item}),
            ]
            output.append(item)
        for k, call in enumerate(answer.tool_calls):
            item = {"type": "function_call", "id": f"fc_{rid}_{k}", "call_id": call.call_id,
                    "name": call.name, "arguments": json.dumps(call.arguments),
                    "status": "completed"}
            if call.namespace:
                item["namespace"] = call.namespace
            frames += [
                ("response.output_item.added", {
                    "type": "response.output_item.added", "sequence_number": next(seq),
                    "output_index": len(output), "item": {**item, "arguments": "",
                                                          "status": "in_progress"}}),
                ("response.output_item.done", {
                    "type": "response.output_item.done", "sequence_number": next(seq),
                    "output_index": len(output), "item": item}),
            ]
            output.append(item)
        frames.append(("response.completed", {
            "type": "response.completed", "sequence_number": next(seq), "response": {
                **resp, "status": "completed", "output": output, "usage": {
                    "input_tokens": input_tokens, "output_tokens": out_tokens,
                    "total_tokens": input_tokens + out_tokens,
                    "input_tokens_details": {"cached_tokens": 0},
                    "output_tokens_details": {"reasoning_tokens": 0}}}}))
        return frames
    base = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": 0,
            "model": MODEL}
    frames.append((None, {**base, "choices": [{"index": 0, "delta": {
        "role": "assistant", "content": ""}, "finish_reason": None}]}))
    if answer.text:
        frames.append((None, {**base, "choices": [{"index": 0, "delta": {
            "content": answer.text}, "finish_reason": None}]}))
    for k, call in enumerate(answer.tool_calls):
        frames.append((None, {**base, "choices": [{"index": 0, "delta": {"tool_calls": [{
            "index": k, "id": call.call_id, "type": "function", "function": {
                "name": call.name, "arguments": json.dumps(call.arguments)}}]},
            "finish_reason": None}]}))
    frames.append((None, {**base, "choices": [{"index": 0, "delta": {}, "finish_reason":
                                               "tool_calls" if answer.tool_calls else "stop"}]}))
    if (stream_options or {}).get("include_usage"):
        frames.append((None, {**base, "choices": [], "usage": {
            "prompt_tokens": input_tokens, "completion_tokens": out_tokens,
            "total_tokens": input_tokens + out_tokens}}))
    frames.append((None, "[DONE]"))
    return frames


def answer_json(api: str, answer: Answer, prompt_chars: int) -> dict[str, Any]:
    """The answer unstreamed (harnesses stream; kept for a side request that does not)."""
    if api == "messages":
        content: list[dict[str, Any]] = ([{"type": "text", "text": answer.text}]
                                         if answer.text else [])
        content += [{"type": "tool_use", "id": _tool_id(api, c), "name": c.name,
                     "input": c.arguments} for c in answer.tool_calls]
        return {"id": f"msg_{answer.agent}-a{answer.number:04d}", "type": "message",
                "role": "assistant",
                "model": MODEL, "content": content,
                "stop_reason": "tool_use" if answer.tool_calls else "end_turn",
                "stop_sequence": None,
                "usage": {"input_tokens": max(1, prompt_chars // 4), "output_tokens": 8}}
    frames = answer_events(api, answer, {"include_usage": True}, prompt_chars)
    if api == "responses":
        return frames[-1][1]["response"]
    message: dict[str, Any] = {"role": "assistant", "content": answer.text or None}
    if answer.tool_calls:
        message["tool_calls"] = [{"id": c.call_id, "type": "function", "function": {
            "name": c.name, "arguments": json.dumps(c.arguments)}} for c in answer.tool_calls]
    return {"id": f"chatcmpl-{answer.agent}-a{answer.number:04d}", "object": "chat.completion",
            "created": 0, "model": MODEL, "choices": [{"index": 0, "message": message,
                                                       "finish_reason": "stop"}],
            "usage": frames[-2][1].get("usage")}


def recorded_answer(api: str, answer: Answer) -> dict[str, Any]:
    """How the fixture keeps an answer: what the replayer looks for in later requests."""
    return {"text": answer.text, "tool_calls": [
        {"id": _tool_id(api, c), "name": c.name, "arguments": c.arguments}
        for c in answer.tool_calls]}


class Recorder:
    """The stand-in's HTTP server state: the script and every exchange, in arrival order."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.exchanges: list[dict[str, Any]] = []
        self.invocation = 0
        self._lock = threading.Lock()
        self._t0 = time.monotonic()

    def now(self) -> float:
        return round(time.monotonic() - self._t0, 3)


def _handler(rec: Recorder) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _body(self) -> bytes:
            if self.headers.get("transfer-encoding", "").lower() == "chunked":
                data = b""
                while True:
                    size = int(self.rfile.readline().strip().split(b";")[0], 16)
                    if size == 0:
                        self.rfile.readline()
                        return data
                    data += self.rfile.read(size)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("content-length") or 0))

        def _send_json(self, status: int, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            rec.exchanges.append({"method": "GET", "path": self.path, "unexpected": True})
            if path.endswith("/models"):
                self._send_json(200, {"object": "list", "data": [
                    {"id": MODEL, "object": "model", "created": 0, "owned_by": "kvtether"}],
                    "models": []})
            else:
                self._send_json(404, {"error": {"message": "not here"}})

        def do_POST(self) -> None:
            started = rec.now()
            raw = self._body()
            path = self.path.split("?", 1)[0]
            api = API_PATHS.get(path)
            headers = {k.lower(): v for k, v in self.headers.items()
                       if k.lower() in IDENTITY_HEADERS}
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            if api is None or not isinstance(body, dict):
                rec.exchanges.append({"method": "POST", "path": self.path, "unexpected": True,
                                      "bytes": len(raw),
                                      "encoding": self.headers.get("content-encoding")})
                self._send_json(404, {"error": {"message": f"no {self.path} here"}})
                return
            answer = rec.script.decide(api, body)
            exchange = {"method": "POST", "path": self.path, "api": api, "agent": answer.agent,
                        "invocation": rec.invocation, "headers": headers, "body": body,
                        "answer": recorded_answer(api, answer), "started_s": started}
            with rec._lock:
                rec.exchanges.append(exchange)
            chars = len(raw)
            if not body.get("stream"):
                self._send_json(200, answer_json(api, answer, chars))
            else:
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("cache-control", "no-cache")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                for event, data in answer_events(api, answer, body.get("stream_options"),
                                                 chars):
                    payload = data if isinstance(data, str) else json.dumps(data)
                    frame = (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"
                    chunk = frame.encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            exchange["ended_s"] = rec.now()

    return Handler


@contextlib.contextmanager
def standin_server(rec: Recorder) -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(rec))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# --------------------------------------------------------------------------- the harnesses
PROMPTS = {
    "tool-loop": [("#kvt-main List the files here with your shell tool, then echo a line, "
                   "then say you are done.")],
    "subagents": [("#kvt-main Start two subagents in parallel, one answer with both calls; "
                   "each runs one shell command. Then summarise what they found.")],
    "resume": ["#kvt-main Run one shell command, then say what it printed.",
               "#kvt-main Continue: run one more shell command, then say what it printed."],
}


@dataclass
class Run:
    """One harness invocation's environment."""

    root: Path  # the recording's scratch directory
    home: Path
    cwd: Path
    base_url: str
    bin_dir: Path

    def env(self) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items()
                if k in ("PATH", "LANG", "LC_ALL", "TERM", "SHELL", "USER", "LOGNAME")}
        path = keep.get("PATH", "/usr/bin:/bin")
        return {**keep, "HOME": str(self.home), "TMPDIR": str(self.root / "tmp"),
                "XDG_CONFIG_HOME": str(self.home / ".config"),
                "XDG_DATA_HOME": str(self.home / ".local" / "share"),
                "XDG_CACHE_HOME": str(self.home / ".cache"),
                "XDG_STATE_HOME": str(self.home / ".local" / "state"),
                "PATH": f"{self.bin_dir}:{path}", "NO_COLOR": "1", "CI": "1",
                "TZ": "UTC", "no_proxy": "*", "NO_PROXY": "*"}


def claude_commands(run: Run, scenario: str) -> tuple[dict[str, str], list[list[str]]]:
    env = {**run.env(), "ANTHROPIC_BASE_URL": run.base_url,
           "ANTHROPIC_API_KEY": "sk-recording-only", "ANTHROPIC_MODEL": MODEL,
           "ANTHROPIC_SMALL_FAST_MODEL": MODEL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
           "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL, "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL,
           "CLAUDE_CODE_SUBAGENT_MODEL": MODEL,
           "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
           "DISABLE_BUG_COMMAND": "1", "IS_SANDBOX": "1"}
    base = [str(run.bin_dir / "claude"), "--output-format", "stream-json", "--verbose",
            "--dangerously-skip-permissions", "--model", MODEL]
    prompts = PROMPTS[scenario]
    cmds = [[*base, "-p", prompts[0]]]
    if len(prompts) > 1:
        cmds.append([*base, "-c", "-p", prompts[1]])
    return env, cmds


def codex_commands(run: Run, scenario: str) -> tuple[dict[str, str], list[list[str]]]:
    codex_home = run.home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    features = ["plugins = false", "remote_plugin = false"]
    if scenario == "subagents":
        features.append("multi_agent = true")
    (codex_home / "config.toml").write_text("\n".join([
        'model_provider = "standin"', f'model = "{MODEL}"', 'approval_policy = "never"',
        'sandbox_mode = "danger-full-access"', "check_for_update_on_startup = false", "",
        "[model_providers.standin]", 'name = "standin"', f'base_url = "{run.base_url}/v1"',
        'wire_api = "responses"', 'env_key = "STANDIN_API_KEY"', "request_max_retries = 0",
        "stream_max_retries = 0", "", "[features]", *features, "",
        "[analytics]", "enabled = false", "", "[otel]", 'exporter = "none"', "",
    ]))
    env = {**run.env(), "CODEX_HOME": str(codex_home), "STANDIN_API_KEY": "sk-recording-only"}
    base = [str(run.bin_dir / "codex"), "exec"]
    flags = ["--json", "--skip-git-repo-check"]
    prompts = PROMPTS[scenario]
    cmds = [[*base, *flags, prompts[0]]]
    if len(prompts) > 1:
        cmds.append([*base, "resume", "--last", *flags, prompts[1]])
    return env, cmds


def opencode_commands(run: Run, scenario: str) -> tuple[dict[str, str], list[list[str]]]:
    config_dir = run.home / ".config" / "opencode"
    config_dir.mkdir(parents=True, exist_ok=True)
    # @opencode-ai/plugin pre-installed next to the config, with the lock file that says so:
    # OpenCode runs npm against the registry otherwise (Npm.install: a node_modules folder and
    # every package.json dependency in package-lock.json's root package).
    plugin = run.bin_dir.parent / "@opencode-ai" / "plugin"
    version = json.loads((plugin / "package.json").read_text())["version"]
    deps = {"@opencode-ai/plugin": version}
    (config_dir / "package.json").write_text(json.dumps({"dependencies": deps}))
    (config_dir / "package-lock.json").write_text(json.dumps(
        {"lockfileVersion": 3, "packages": {"": {"dependencies": deps}}}))
    (config_dir / "node_modules" / "@opencode-ai").mkdir(parents=True)
    for name in ("plugin", "sdk"):
        (config_dir / "node_modules" / "@opencode-ai" / name).symlink_to(
            run.bin_dir.parent / "@opencode-ai" / name, target_is_directory=True)
    config = {"$schema": "https://opencode.ai/config.json", "model": f"standin/{MODEL}",
              "small_model": f"standin/{MODEL}", "autoupdate": False, "share": "disabled",
              "permission": {"bash": "allow", "edit": "allow", "webfetch": "deny"},
              "provider": {"standin": {"npm": "@ai-sdk/openai-compatible", "name": "standin",
                                       "options": {"baseURL": f"{run.base_url}/v1",
                                                   "apiKey": "sk-recording-only"},
                                       "models": {MODEL: {"name": MODEL}}}}}
    (config_dir / "opencode.json").write_text(json.dumps(config, indent=1))
    env = {**run.env(), "OPENCODE_CONFIG": str(config_dir / "opencode.json"),
           "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
           "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
           "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1"}
    base = [str(run.bin_dir / "opencode"), "run", "--format", "json"]
    prompts = PROMPTS[scenario]
    cmds = [[*base, prompts[0]]]
    if len(prompts) > 1:
        cmds.append([*base, "--continue", prompts[1]])
    return env, cmds


COMMANDS = {"claude": claude_commands, "codex": codex_commands, "opencode": opencode_commands}


def installed_version(bin_dir: Path, harness: str) -> str:
    out = subprocess.run([str(bin_dir / harness), "--version"], capture_output=True, text=True,
                         check=False, timeout=120,
                         env={**os.environ, "DISABLE_AUTOUPDATER": "1"},
                         stdin=subprocess.DEVNULL).stdout
    m = re.search(r"\d+\.\d+\.\d+", out)
    if m is None:
        raise SystemExit(f"{harness} --version said {out!r}")
    return m.group(0)


_CONNECT = re.compile(r'connect\(\d+, \{sa_family=AF_INET6?, sin6?_port=htons\((\d+)\), '
                      r'(?:sin_addr=inet_addr\("([^"]+)"\)|[^}]*inet_pton\(AF_INET6, "([^"]+)")')


def outside_connections(trace: Path) -> list[str]:
    """The connect() calls of an strace log that left loopback."""
    found = []
    for line in trace.read_text(errors="replace").splitlines():
        m = _CONNECT.search(line)
        if m:
            addr = m.group(2) or m.group(3)
            if addr not in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
                found.append(f"{addr}:{m.group(1)}")
    return sorted(set(found))


def record(harness: str, scenario: str, bin_dir: Path, *, keep: bool = False,
           verbose: bool = False, trace: bool = False) -> dict[str, Any]:
    """Run ``harness`` through ``scenario`` against the stand-in; the fixture's content.

    ``trace``: run each invocation under ``strace -e trace=connect`` and fail on a
    connection that left loopback."""
    version = installed_version(bin_dir, harness)
    rec = Recorder(Script(harness, scenario))
    root = Path(tempfile.mkdtemp(prefix=f"kvt-rec-{harness}-")).resolve()
    home, cwd = root / "home", root / "project"
    for d in (home, cwd, root / "tmp"):
        d.mkdir(parents=True)
    (cwd / "README.md").write_text("# demo\n\nA small project the recording runs in.\n")
    (cwd / "notes.txt").write_text("alpha\nbeta\n")
    outputs: list[dict[str, Any]] = []
    try:
        with standin_server(rec) as base_url:
            run = Run(root, home, cwd, base_url, bin_dir)
            env, cmds = COMMANDS[harness](run, scenario)
            for i, cmd in enumerate(cmds):
                rec.invocation = rec.script.invocation = i
                log = root / f"connect-{i}.txt"
                if trace:
                    cmd = ["strace", "-f", "-qq", "-e", "trace=connect", "-o", str(log), *cmd]
                proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                                      check=False,
                                      timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
                outputs.append({"rc": proc.returncode, "stdout": proc.stdout[-4000:],
                                "stderr": proc.stderr[-4000:]})
                if verbose or proc.returncode != 0:
                    print(f"--- {harness} {scenario} #{i}: rc {proc.returncode}\n"
                          f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}", file=sys.stderr)
                if proc.returncode != 0:
                    raise SystemExit(f"{harness} {scenario}: invocation {i} failed")
                if trace and (outside := outside_connections(log)):
                    raise SystemExit(f"{harness} {scenario}: left loopback: {outside}")
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    unexpected = [e for e in rec.exchanges if e.get("unexpected")]
    scrub = Scrubber([(str(cwd), "<CWD>"), (str(home), "<HOME>"), (str(root), "<TMP>"),
                      # Claude Code names a project's folders after its path, / and . as -
                      (re.sub(r"[^A-Za-z0-9]", "-", str(cwd)), "-CWD-"),
                      (root.name, "<TMP-NAME>"),
                      (str(bin_dir.parent.resolve()), "<HARNESS>"),
                      (str(bin_dir.parent), "<HARNESS>"), (str(ROOT), "<REPO>")],
                     day=dt.datetime.now(dt.timezone.utc).date(), host=socket.gethostname(),
                     os_release=platform.release())
    exchanges = [scrub(e) for e in rec.exchanges if not e.get("unexpected")]
    exchanges.sort(key=lambda e: e["started_s"])
    bodies, blobs = pack([e["body"] for e in exchanges])
    for e, body in zip(exchanges, bodies, strict=True):
        e["body"] = body
    return {
        "format": FORMAT_VERSION,
        "harness": harness,
        "harness_version": version,
        "scenario": scenario,
        "recorded_by": "scripts/record-harness-traffic.py",
        "model": MODEL,
        "prompts": PROMPTS[scenario],
        "invocations": len(outputs),
        "unexpected_requests": [{"method": e["method"], "path": e["path"]} for e in unexpected],
        "requests": exchanges,
        "blobs": blobs,
    }


def summary(fixture: dict[str, Any]) -> str:
    counts: dict[str, int] = {}
    for r in fixture["requests"]:
        counts[r["agent"]] = counts.get(r["agent"], 0) + 1
    size = len(json.dumps(fixture))
    return (f"{fixture['harness']} {fixture['harness_version']} {fixture['scenario']}: "
            + ", ".join(f"{a} {n}" for a, n in counts.items()) + f" ({size // 1024} KB)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--harness", nargs="+", choices=sorted(COMMANDS), default=sorted(COMMANDS))
    ap.add_argument("--scenario", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    ap.add_argument("--bin-dir", type=Path, default=HARNESS_DIR / "node_modules" / ".bin",
                    help="the harnesses' npm bins (default: where scripts/setup-harnesses.sh "
                         "installs them, $KVTETHER_HARNESS_DIR or .kvtether/harnesses)")
    ap.add_argument("--out", type=Path, default=FIXTURES)
    ap.add_argument("--any-version", action="store_true",
                    help="record whatever version is installed (then update HARNESS_VERSIONS)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directories")
    ap.add_argument("--trace-connections", action="store_true",
                    help="run the harnesses under strace and fail if one leaves loopback")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the harnesses' output")
    args = ap.parse_args(argv)
    bin_dir = args.bin_dir.absolute()
    for harness in args.harness:
        version = installed_version(bin_dir, harness)
        if version != HARNESS_VERSIONS[harness] and not args.any_version:
            raise SystemExit(f"{harness} {version} is installed, the fixtures pin "
                             f"{HARNESS_VERSIONS[harness]}: install that, or pass --any-version")
    args.out.mkdir(parents=True, exist_ok=True)
    for harness in args.harness:
        for scenario in args.scenario:
            fixture = record(harness, scenario, bin_dir, keep=args.keep, verbose=args.verbose,
                             trace=args.trace_connections)
            path = args.out / f"{harness}-{scenario}.json"
            path.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
            print(summary(fixture), flush=True)
            if fixture["unexpected_requests"]:
                print(f"  unexpected: {fixture['unexpected_requests']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
