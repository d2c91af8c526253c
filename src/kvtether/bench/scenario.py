"""Scenario files: the agent sessions `kvtether bench` replays, generated or read.

A scenario is JSON (``kvtether_scenario: 1``): one system prompt (instructions and the tool
schemas, the prefix every session shares) and sessions; each session is a list of turns. A turn
appends messages to the history (the task, a tool's result, the person's next message), asks the
model for at most ``max_tokens`` tokens, and is followed by a gap: a tool running, a person
thinking, or the end. The model's own answers are appended as they come, as an agent does.

Times in a scenario are workload seconds (what the agent would see in production); the replay
divides every duration and TTL by one time-compression factor.

Sources:

* :func:`generate_scenario`: seeded; tool durations and result sizes, output lengths, human
  think time and user message sizes from :mod:`kvtether.bench.workload` (distributions from
  published agent-loop measurements), each session's token counts scaled so it ends at 75-100%
  of ``context_tokens``. Rare long tools are rare in a short run: ``long_tools`` puts that many
  tool calls from the far tail (``long_tool_s``) into the scenario, so it has gaps that outlive
  a fixed TTL; the number is stored in the file.
* :func:`load_scenario` also reads the conversation JSON of vLLM's ``benchmarks/multi_turn``
  tools (a list of ``{"id", "messages": [{"role", "content"}]}``): user messages become turns,
  each assistant message's word count becomes the turn's ``max_tokens``.
* :func:`load_scenario` also reads recorded coding-agent traces (kv-cache-tester's format), scaled
  to a CPU host: :mod:`kvtether.bench.traces`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvtether.bench._scenario_model import (
    GapKind,
    Message,
    Scenario,
    ScenarioSession,
    ScenarioTurn,
    read_json,
    vocabulary_text,
)
from kvtether.bench.traces import is_trace_data, load_trace_scenario
from kvtether.bench.workload import TOOLS, generate_sessions
from kvtether.errors import ScenarioError

__all__ = [
    "GapKind",
    "Message",
    "Scenario",
    "ScenarioError",
    "ScenarioSession",
    "ScenarioTurn",
    "generate_scenario",
    "load_scenario",
    "read_json",
]

def load_scenario(path: Path, *, think_s: float = 60.0, max_tokens_cap: int = 256) -> Scenario:
    """A kvtether scenario file, vLLM ``benchmarks/multi_turn`` conversations, or recorded
    agent traces (a kv-cache-tester trace file, a directory of them, or a bundle; converted
    with :func:`kvtether.bench.traces.to_scenario`'s defaults, outputs capped at
    ``max_tokens_cap``).

    For vLLM's format, which has no timing, every gap between turns is ``think_s`` workload
    seconds of a person thinking, and ``max_tokens`` is the assistant message's word count
    (at most ``max_tokens_cap``).
    """
    path = Path(path)
    if path.is_dir():  # recorded agent traces, one file per conversation
        return load_trace_scenario(path, max_output_tokens=max_tokens_cap)
    data = read_json(path, "scenario file")
    if isinstance(data, dict) and "kvtether_scenario" in data:
        try:
            return Scenario.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            raise ScenarioError(f"{path}: {where}: {first['msg']}") from None
    if isinstance(data, list):
        return _from_vllm_multi_turn(data, path, think_s, max_tokens_cap)
    if is_trace_data(data):
        return load_trace_scenario(path, data, max_output_tokens=max_tokens_cap)
    raise ScenarioError(
        f"{path} is neither a kvtether scenario (an object with \"kvtether_scenario\": 1), "
        "vLLM multi-turn conversations (a list of {\"id\", \"messages\"}) nor kv-cache-tester "
        "traces (an object with \"requests\" and \"block_size\", or a trace bundle)"
    )


def _from_vllm_multi_turn(
    data: list[Any], path: Path, think_s: float, max_tokens_cap: int
) -> Scenario:
    sessions: list[ScenarioSession] = []
    system = ""
    for n, item in enumerate(data):
        if not isinstance(item, dict) or not isinstance(item.get("messages"), list):
            raise ScenarioError(f"{path}: conversation {n} has no \"messages\" list")
        cid = str(item.get("id") or f"conv-{n}")
        turns: list[ScenarioTurn] = []
        pending: list[Message] = []
        for m, msg in enumerate(item["messages"]):
            if not isinstance(msg, dict) or not isinstance(msg.get("content"), str):
                raise ScenarioError(f"{path}: conversation {cid!r} message {m} has no content")
            role = msg.get("role")
            if role == "system" and not turns and not pending:
                system = system or msg["content"]
            elif role == "user":
                pending.append(Message(role="user", content=msg["content"]))
            elif role == "assistant":
                if not pending:
                    continue  # an answer to nothing: the replay gets the model's own answers
                words = max(1, len(msg["content"].split()))
                turns.append(ScenarioTurn(append=pending, max_tokens=min(words, max_tokens_cap),
                                          gap_s=think_s, gap_kind="human"))
                pending = []
            else:
                raise ScenarioError(
                    f"{path}: conversation {cid!r} message {m} has role {role!r} "
                    "(expected system, user or assistant)"
                )
        if pending:
            turns.append(ScenarioTurn(append=pending, max_tokens=min(64, max_tokens_cap)))
        if not turns:
            continue
        last = turns[-1].model_copy(update={"gap_s": 0.0, "gap_kind": "end"})
        sessions.append(ScenarioSession(id=cid, turns=[*turns[:-1], last]))
    if not sessions:
        raise ScenarioError(f"{path}: no conversation with a user message")
    return Scenario(
        name=path.stem,
        source={"format": "vllm-multi-turn", "file": path.name, "think_s": think_s},
        system_prompt=system or "You are a helpful assistant.",
        sessions=sessions,
    )


# --- the generator -------------------------------------------------------------------------
def _system_prompt(rng: random.Random, tokens: int) -> str:
    """Instructions plus the tool schemas, as an agent framework renders them."""
    schemas = [
        {"type": "function", "function": {
            "name": t.name,
            "description": f"{t.name.replace('_', ' ')}: {vocabulary_text(rng, 12)}",
            "parameters": {"type": "object", "properties": {t.arg_name: {"type": "string"}},
                           "required": [t.arg_name]}}}
        for t in TOOLS
    ]
    head = "You are a coding agent. Call tools to inspect and change the repository. Tools:\n"
    body = json.dumps(schemas, separators=(",", ":"))
    words = max(0, tokens - len(body) // 3 - 20)
    return f"{head}{body}\nGuidelines: {vocabulary_text(rng, words)}"


def generate_scenario(
    sessions: int = 8,
    *,
    seed: int = 0,
    turns: tuple[int, int] = (4, 8),
    context_tokens: int = 2048,
    system_tokens: int = 600,
    max_output_tokens: int = 128,
    long_tools: int = 2,
    long_tool_s: tuple[float, float] = (540.0, 900.0),
    max_gap_s: float = 900.0,
    stream_fraction: float = 0.5,
    arrival_s: float = 60.0,
    name: str | None = None,
) -> Scenario:
    """``sessions`` seeded agent sessions, each ending at 75-100% of ``context_tokens``.

    Shapes come from :func:`kvtether.bench.workload.generate_sessions` (tool mix, durations,
    result sizes, output lengths, person turns and think times); each session's token counts
    are scaled by one factor so it fits (its shape kept), gaps are capped at ``max_gap_s``,
    ``long_tools`` tool gaps are drawn from ``long_tool_s`` instead (the tail a short run would
    otherwise miss), sessions arrive ``arrival_s`` apart on average (exponential) and
    ``stream_fraction`` of them stream.
    """
    if sessions < 1 or not (1 <= turns[0] <= turns[1]):
        raise ValueError("need sessions >= 1 and 1 <= turns[0] <= turns[1]")
    if context_tokens <= system_tokens + 64:
        raise ValueError("context_tokens must leave room after the system prompt")
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    scales: list[float] = []
    start = 0.0
    tool_slots: list[tuple[int, int]] = []
    for i, shape in enumerate(generate_sessions(sessions, seed=seed, steps=turns)):
        # Each session ends between 75% and 100% of the context: its own shape (which steps
        # grow it most), one scale.
        session_turns, scale = _scaled_session(
            shape, random.Random(f"{seed}-{i}"), room_tokens=context_tokens - system_tokens - 32,
            max_output_tokens=max_output_tokens, max_gap_s=max_gap_s)
        scales.append(scale)
        tool_slots += [(i, k) for k, turn in enumerate(session_turns) if "tool" in turn]
        out.append({"id": f"s{i:03d}", "start_s": round(start, 3),
                    "stream": rng.random() < stream_fraction, "turns": session_turns})
        start += rng.expovariate(1.0 / arrival_s) if arrival_s > 0 else 0.0
    # The tail: a few tool calls run long (pytest suites, builds), spread over sessions.
    for i, k in rng.sample(tool_slots, min(long_tools, len(tool_slots))):
        out[i]["turns"][k]["gap_s"] = rng.uniform(*long_tool_s)
    for session in out:
        for turn in session["turns"]:
            turn["gap_s"] = round(turn["gap_s"], 3)
    return Scenario(
        name=name or f"agents-{sessions}x{turns[0]}-{turns[1]}-seed{seed}",
        source={
            "generator": "kvtether.bench.scenario.generate_scenario",
            "seed": seed, "sessions": sessions, "turns": list(turns),
            "context_tokens": context_tokens, "system_tokens": system_tokens,
            "max_output_tokens": max_output_tokens, "long_tools": long_tools,
            "long_tool_s": list(long_tool_s), "max_gap_s": max_gap_s,
            "stream_fraction": stream_fraction, "arrival_s": arrival_s,
            "token_scale": [round(min(scales), 4), round(max(scales), 4)],
        },
        system_prompt=_system_prompt(random.Random(seed), system_tokens),
        sessions=[ScenarioSession.model_validate(s) for s in out],
    )


def _growth(shape: Any) -> float:
    """Tokens a session adds after the system prompt, its last answer included."""
    steps = shape.steps
    return steps[-1].prompt_tokens - steps[0].prompt_tokens + steps[-1].output_tokens


def _scaled_session(shape: Any, srng: random.Random, *, room_tokens: int,
                    max_output_tokens: int, max_gap_s: float
                    ) -> tuple[list[dict[str, Any]], float]:
    """One session's turns (as scenario-turn fields) from its generated shape, token counts
    scaled so it ends between 75% and 100% of ``room_tokens``, text drawn from ``srng``; and
    the scale."""
    room = room_tokens * srng.uniform(0.75, 1.0)
    first_user = max(8, round(room * 0.15))  # the task message: 15% of the room
    scale = (room - first_user) / max(_growth(shape), 1.0)
    turns: list[dict[str, Any]] = []
    append = [Message(role="user", content="Task: " + vocabulary_text(srng, first_user))]
    for step in shape.steps:
        max_tokens = max(4, min(max_output_tokens, round(step.output_tokens * scale)))
        turn: dict[str, Any] = {"append": append, "max_tokens": max_tokens,
                                "gap_s": min(step.gap_s, max_gap_s), "gap_kind": step.action}
        if step.action == "end":
            turn["gap_s"] = 0.0
        words = max(4, round(step.appended_tokens * scale))
        if step.action == "tool":
            turn["tool"] = step.tool_name
            args = json.dumps(step.tool_args)
            append = [Message(role="user", content=f"Result of {step.tool_name}({args}):\n"
                              + vocabulary_text(srng, words))]
        elif step.action == "user":
            turn["gap_kind"] = "human"
            append = [Message(role="user", content=vocabulary_text(srng, words))]
        turns.append(turn)
    return turns, scale
