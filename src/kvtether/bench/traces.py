"""Recorded coding-agent traces: replayed as bench scenarios, and used to score growth prediction.

The format is kv-cache-tester's (https://github.com/callanjfox/kv-cache-tester, Apache-2.0):
one JSON object per conversation, ``{"id", "block_size", "tool_tokens", "system_tokens",
"requests": [...]}``, each request ``{"t", "type", "model", "in", "out", "hash_ids",
"input_types", "stop", "think_time", "api_time"}``: token counts and hashed 64-token blocks,
no text. ``think_time`` is what the client waited between the previous reply and this request
(a tool running, or a person); ``type`` ``"subagent"`` entries are nested conversations.

Three ways in (:func:`read_traces`):

* one trace file, or a directory of them;
* a bundle, ``{"kv_cache_tester_traces": 1, "source": {...}, "traces": [...]}``: traces with
  each request's ``hash_ids`` replaced by ``hit_blocks`` (the blocks it shares as a prefix with
  the request before), which is all a replay needs. ``tests/fixtures/traces/`` holds one, made
  with :func:`bundle`.

:func:`to_scenario` turns conversations into a :class:`~kvtether.bench.scenario.Scenario` that
a CPU host can compute: each conversation up to its first prefix reset (a request that keeps
less than half of the previous prompt: compaction, an edited history), at most ``max_turns``
turns, its token counts divided by one factor so it ends between ``min_end_tokens`` and
``max_end_tokens`` (per-turn growth keeps its shape), outputs capped, gaps as recorded (capped
at ``max_gap_s``). Text is scenario vocabulary, about one token per word.

:func:`score_prediction` replays the recorded conversations, unscaled and whole, through the
client's :class:`~kvtether.session.GrowthPredictor` and compares its hints (next prompt size,
gap until the next turn) with what the trace did next.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvtether.bench._scenario_model import (
    GapKind,
    Message,
    Scenario,
    ScenarioSession,
    ScenarioTurn,
    read_json,
    vocabulary_text,
)
from kvtether.bench.workload import (
    AgentSession,
    PredictionScores,
    Step,
    score_predictions,
    score_predictions_by_turn,
)
from kvtether.errors import ScenarioError

__all__ = [
    "BUNDLE_VERSION",
    "KV_CACHE_TESTER",
    "TraceConversation",
    "TraceRequest",
    "bundle",
    "is_trace_data",
    "load_trace_scenario",
    "main",
    "prediction_table",
    "read_traces",
    "score_prediction",
    "to_agent_sessions",
    "to_scenario",
]

BUNDLE_VERSION = 1
# Where the traces come from; recorded in every scenario made from them.
KV_CACHE_TESTER: dict[str, str] = {
    "repo": "https://github.com/callanjfox/kv-cache-tester",
    "license": "Apache-2.0",
}
# A request that keeps less than this share of the previous prompt as its prefix starts over
# (compaction, an edited history): an append-only replay cannot follow it.
_RESET_HIT_SHARE = 0.5
_TOOL_NAME = "tool_use"  # the traces do not name tools


@dataclass(frozen=True, slots=True)
class TraceRequest:
    t_s: float  # since the conversation started
    input_tokens: int
    output_tokens: int
    think_s: float  # the client's wait before sending this request
    tool_result: bool  # this request carries a tool's result (else a person's message)
    stop: str  # why the reply ended: "tool_use", "end_turn", ""
    stream: bool
    hit_blocks: int | None  # blocks shared as a prefix with the previous request


@dataclass(frozen=True, slots=True)
class TraceConversation:
    id: str
    file: str
    block_size_tokens: int
    tool_tokens: int
    system_tokens: int
    requests: tuple[TraceRequest, ...]
    subagents: int  # nested conversations left out

    def reset_at(self) -> int | None:
        """Index of the first request that does not extend the one before, if any."""
        for i in range(1, len(self.requests)):
            before, this = self.requests[i - 1], self.requests[i]
            if this.hit_blocks is not None:
                prev_blocks = math.ceil(before.input_tokens / self.block_size_tokens)
                if this.hit_blocks < _RESET_HIT_SHARE * prev_blocks:
                    return i
            elif this.input_tokens < before.input_tokens:
                return i
        return None

    def hit_share(self) -> float | None:
        """Blocks reused from the previous request over blocks sent (request 2 on)."""
        rows = [(r.hit_blocks, math.ceil(r.input_tokens / self.block_size_tokens))
                for r in self.requests[1:] if r.hit_blocks is not None]
        total = sum(n for _, n in rows)
        return sum(h for h, _ in rows) / total if total else None


# --- reading ---------------------------------------------------------------------------------
def is_trace_data(data: Any) -> bool:
    """A kv-cache-tester trace, or a bundle of them."""
    if not isinstance(data, dict):
        return False
    if "kv_cache_tester_traces" in data:
        return True
    requests = data.get("requests")
    return isinstance(requests, list) and "block_size" in data


def _common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _conversation(data: dict[str, Any], file: str) -> TraceConversation:
    requests: list[TraceRequest] = []
    subagents = 0
    previous_ids: list[Any] | None = None
    for n, r in enumerate(data.get("requests") or []):
        if not isinstance(r, dict):
            raise ScenarioError(f"{file}: request {n} is not an object")
        if r.get("type") == "subagent":
            subagents += 1
            continue
        try:
            hash_ids = r.get("hash_ids")
            hit: int | None
            if isinstance(hash_ids, list):
                hit = _common_prefix(previous_ids, hash_ids) if previous_ids is not None else 0
                previous_ids = hash_ids
            else:
                hit = None if r.get("hit_blocks") is None else int(r["hit_blocks"])
            requests.append(TraceRequest(
                t_s=float(r.get("t", 0.0)),
                input_tokens=int(r["in"]),
                output_tokens=int(r["out"]),
                think_s=max(0.0, float(r.get("think_time") or 0.0)),
                tool_result="tool_result" in (r.get("input_types") or []),
                stop=str(r.get("stop") or ""),
                stream=r.get("type") == "s",
                hit_blocks=hit,
            ))
        except (KeyError, TypeError, ValueError) as exc:
            raise ScenarioError(f"{file}: request {n}: {type(exc).__name__}: {exc}") from None
    if requests and requests[0].hit_blocks is not None:
        requests[0] = dataclasses.replace(requests[0], hit_blocks=0)
    return TraceConversation(
        id=str(data.get("id") or Path(file).stem),
        file=file,
        block_size_tokens=int(data.get("block_size") or 64),
        tool_tokens=int(data.get("tool_tokens") or 0),
        system_tokens=int(data.get("system_tokens") or 0),
        requests=tuple(requests),
        subagents=subagents,
    )


def _parse(data: Any, file: str) -> tuple[list[TraceConversation], dict[str, Any]]:
    if isinstance(data, dict) and "kv_cache_tester_traces" in data:
        if data["kv_cache_tester_traces"] != BUNDLE_VERSION:
            raise ScenarioError(f"{file}: trace bundle version {data['kv_cache_tester_traces']!r}"
                                f" (this kvtether reads {BUNDLE_VERSION})")
        items = data.get("traces")
        if not isinstance(items, list) or not all(isinstance(t, dict) for t in items):
            raise ScenarioError(f"{file}: a trace bundle needs a \"traces\" list of objects")
        source = dict(data.get("source") or {})
        return [_conversation(t, f"{file}#{t.get('id', n)}") for n, t in enumerate(items)], source
    if is_trace_data(data):
        return [_conversation(data, file)], {}
    raise ScenarioError(f"{file} is not a kv-cache-tester trace")


def read_traces(paths: Iterable[Path], data: Any = None
                ) -> tuple[list[TraceConversation], dict[str, Any]]:
    """The conversations in trace files, bundles or directories of trace files (``*.json``,
    sorted), and the bundle's ``source`` when there is one. ``data``: the already parsed JSON
    of a single path."""
    conversations: list[TraceConversation] = []
    source: dict[str, Any] = {}
    for path in paths:
        path = Path(path)
        files = sorted(path.glob("*.json")) if path.is_dir() else [path]
        if path.is_dir() and not files:
            raise ScenarioError(f"{path}: no *.json trace files")
        for file in files:
            if data is None or len(files) > 1:
                loaded = read_json(file, "trace file")
            else:
                loaded = data
            found, src = _parse(loaded, file.name)
            conversations.extend(found)
            source = source or src
    return conversations, source


# --- as a scenario ---------------------------------------------------------------------------
def to_scenario(
    conversations: Sequence[TraceConversation],
    *,
    sessions: int = 8,
    max_turns: int = 32,
    min_turns: int = 4,
    min_end_tokens: int = 16384,
    max_end_tokens: int = 32768,
    max_output_tokens: int = 128,
    max_gap_s: float = 900.0,
    arrival_s: float = 60.0,
    stream: bool = True,
    seed: int = 0,
    name: str = "kv-cache-tester-traces",
    source: dict[str, Any] | None = None,
) -> Scenario:
    """The first ``sessions`` conversations that have ``min_turns`` turns before their first
    prefix reset, each cut there and at ``max_turns``, scaled by one factor per session so its
    last prompt plus reply lands between ``min_end_tokens`` and ``max_end_tokens`` (inside that
    range it is replayed at its own size). Every session streams (``stream``), so every turn
    has a TTFT; sessions arrive ``arrival_s`` apart on average (the traces carry no start
    times across conversations)."""
    if sessions < 1 or not (1 <= min_turns <= max_turns) or not (
        0 < min_end_tokens <= max_end_tokens
    ):
        raise ValueError("need sessions >= 1, 1 <= min_turns <= max_turns, "
                         "0 < min_end_tokens <= max_end_tokens")
    chosen, cut_at_reset = _choose(conversations, sessions, min_turns, max_turns,
                                   min_end_tokens, max_end_tokens)
    system_tokens = _shared_system_tokens(chosen)
    rng = random.Random(seed)
    out: list[ScenarioSession] = []
    capped_outputs = 0
    start = 0.0
    for i, (conv, requests, factor) in enumerate(chosen):
        turns, capped = _scaled_turns(requests, factor, random.Random(f"{seed}-{conv.id}"),
                                      system_tokens=system_tokens,
                                      max_output_tokens=max_output_tokens, max_gap_s=max_gap_s)
        capped_outputs += capped
        out.append(ScenarioSession(id=f"t{i:03d}-{conv.id}"[:200], start_s=round(start, 3),
                                   stream=stream, turns=turns))
        start += rng.expovariate(1.0 / arrival_s) if arrival_s > 0 else 0.0
    ends = [r[-1].input_tokens + r[-1].output_tokens for _, r, _ in chosen]
    recorded = {**KV_CACHE_TESTER, **(source or {})}
    recorded.update({
        "format": "kv-cache-tester",
        "conversations": [c.file for c, _, _ in chosen],
        "scaling": {
            "token_factor": [round(f, 3) for _, _, f in chosen],
            "recorded_end_tokens": ends,
            "end_tokens": [min(max(e, min_end_tokens), max_end_tokens) for e in ends],
            "system_tokens": system_tokens,
            "max_turns": max_turns, "min_turns": min_turns,
            "min_end_tokens": min_end_tokens, "max_end_tokens": max_end_tokens,
            "max_output_tokens": max_output_tokens, "outputs_capped": capped_outputs,
            "max_gap_s": max_gap_s, "cut_at_prefix_reset": cut_at_reset,
            "subagents_left_out": sum(c.subagents for c, _, _ in chosen),
            "stream": stream, "arrival_s": arrival_s, "seed": seed,
        },
    })
    system = ("You are a coding agent replaying a recorded Claude Code session. Tools and "
              "instructions: "
              + vocabulary_text(random.Random(f"{seed}-system"), system_tokens - 16))
    return Scenario(name=name, source=recorded, system_prompt=system, sessions=out)


# A conversation chosen for a scenario: its requests up to the cut, and the factor its token
# counts are divided by.
_Chosen = tuple[TraceConversation, tuple[TraceRequest, ...], float]


def _choose(conversations: Sequence[TraceConversation], sessions: int, min_turns: int,
            max_turns: int, min_end_tokens: int, max_end_tokens: int
            ) -> tuple[list[_Chosen], int]:
    """The first ``sessions`` conversations with ``min_turns`` turns before their first prefix
    reset, each cut there and at ``max_turns`` and given its scale factor; and how many were
    cut at a reset."""
    chosen: list[_Chosen] = []
    cut_at_reset = 0
    for conv in conversations:
        reset = conv.reset_at()
        requests = conv.requests[: reset if reset is not None else None][:max_turns]
        if len(requests) < min_turns:
            continue
        cut_at_reset += reset is not None and reset <= max_turns
        end = requests[-1].input_tokens + requests[-1].output_tokens
        target = min(max(end, min_end_tokens), max_end_tokens)
        chosen.append((conv, requests, end / target))
        if len(chosen) == sessions:
            break
    if not chosen:
        raise ScenarioError(f"no trace conversation has {min_turns} turns before a prefix reset")
    return chosen, cut_at_reset


def _shared_system_tokens(chosen: list[_Chosen]) -> int:
    """One system prompt for all: the median conversation's tools and instructions, scaled, at
    most what every session's first prompt holds."""
    system_tokens = min(
        round(statistics.median((c.tool_tokens + c.system_tokens) / f for c, _, f in chosen)),
        *(round(r[0].input_tokens / f) - 16 for _, r, f in chosen),
    )
    return max(system_tokens, 16)


def _scaled_turns(requests: Sequence[TraceRequest], factor: float, trng: random.Random, *,
                  system_tokens: int, max_output_tokens: int, max_gap_s: float
                  ) -> tuple[list[ScenarioTurn], int]:
    """One conversation's turns, token counts divided by ``factor``, text drawn from
    ``trng``; and how many outputs ``max_output_tokens`` capped."""
    turns: list[ScenarioTurn] = []
    capped = 0
    previous_max_tokens = 0
    for k, req in enumerate(requests):
        max_tokens = max(4, round(req.output_tokens / factor))
        capped += max_tokens > max_output_tokens
        max_tokens = min(max_tokens, max_output_tokens)
        if k == 0:
            words = max(8, round(req.input_tokens / factor) - system_tokens)
            content = "Task: " + vocabulary_text(trng, words)
        else:
            # The prompt grows by what the trace's did; the model's own answer (up to the
            # previous turn's max_tokens) is part of that growth.
            grown = round((req.input_tokens - requests[k - 1].input_tokens) / factor)
            words = max(4, grown - previous_max_tokens)
            content = vocabulary_text(trng, words)
            if req.tool_result:
                content = f"Result of {_TOOL_NAME}:\n" + content
        gap_s, tool = 0.0, None
        gap_kind: GapKind = "end"
        if k + 1 < len(requests):
            following = requests[k + 1]
            gap_s = round(min(following.think_s, max_gap_s), 3)
            gap_kind = "tool" if following.tool_result else "human"
            tool = _TOOL_NAME if following.tool_result else None
        turns.append(ScenarioTurn(append=[Message(role="user", content=content)],
                                  max_tokens=max_tokens, gap_s=gap_s, gap_kind=gap_kind,
                                  tool=tool))
        previous_max_tokens = max_tokens
    return turns, capped


def load_trace_scenario(path: Path, data: Any = None, *, max_output_tokens: int = 128
                        ) -> Scenario:
    """:func:`to_scenario` with its defaults, for ``kvtether bench --scenario PATH``."""
    path = Path(path)
    conversations, source = read_traces([path], data)
    source = {**source, "file": path.name}
    return to_scenario(conversations, max_output_tokens=max_output_tokens,
                       name=f"traces-{path.stem}", source=source)


# --- growth prediction -----------------------------------------------------------------------
def to_agent_sessions(conversations: Sequence[TraceConversation]) -> list[AgentSession]:
    """The conversations as the predictor's scoring reads them, unscaled and whole: a request
    followed by a tool result is a tool step whose gap is the next request's wait, one followed
    by a person's message is a user step."""
    out: list[AgentSession] = []
    for conv in conversations:
        steps: list[Step] = []
        reqs = conv.requests
        for k, req in enumerate(reqs):
            action: Literal["tool", "user", "end"] = "end"
            gap_s = 0.0
            appended = 0
            if k + 1 < len(reqs):
                following = reqs[k + 1]
                action = "tool" if following.tool_result else "user"
                gap_s = following.think_s
                appended = max(0, following.input_tokens - req.input_tokens - req.output_tokens)
            steps.append(Step(
                index=k, prompt_tokens=req.input_tokens, output_tokens=req.output_tokens,
                generation_s=0.0, action=action,
                tool_name=_TOOL_NAME if action == "tool" else None,
                gap_s=gap_s, appended_tokens=appended,
            ))
        if len(steps) >= 2:
            out.append(AgentSession(session_id=conv.id, steps=tuple(steps)))
    return out


def score_prediction(
    source: Sequence[TraceConversation] | Sequence[AgentSession],
    turn_edges: Sequence[int] = (1, 5, 20),
) -> dict[str, Any]:
    """The client's growth hints against what happened next, on recorded conversations.

    ``"request"``: hints sent with each model request; ``"tool"``: hints sent while a tool
    runs (the traces do not name tools, so every tool is one). Each point has ``"all"`` and one
    entry per turn bucket (``turn_edges``), each a :class:`PredictionScores` as a dict; plus
    facts about the traces (``"traces"``)."""
    if source and isinstance(source[0], TraceConversation):
        conversations = [c for c in source if isinstance(c, TraceConversation)]
        sessions = to_agent_sessions(conversations)
        hits = [h for h in (c.hit_share() for c in conversations) if h is not None]
        facts: dict[str, Any] = {
            "conversations": len(conversations),
            "requests": sum(len(c.requests) for c in conversations),
            "subagents_left_out": sum(c.subagents for c in conversations),
            "with_prefix_reset": sum(c.reset_at() is not None for c in conversations),
            "prefix_hit_share_median": round(statistics.median(hits), 4) if hits else None,
        }
    else:
        sessions = [s for s in source if isinstance(s, AgentSession)]
        facts = {"sessions": len(sessions)}
    steps = [s for x in sessions for s in x.steps[:-1]]
    facts["tool_steps"] = sum(s.action == "tool" for s in steps)
    facts["user_steps"] = sum(s.action == "user" for s in steps)
    overall = score_predictions(sessions)
    by_turn = score_predictions_by_turn(sessions, turn_edges)
    return {
        "traces": facts,
        **{point: {"all": _asdict(overall[point]),
                   **{label: _asdict(s) for label, s in by_turn[point].items()}}
           for point in ("request", "tool")},
    }


def _asdict(scores: PredictionScores) -> dict[str, float]:
    return {name: (round(v, 4) if isinstance(v, float) else v)
            for name, v in dataclasses.asdict(scores).items()}


def prediction_table(result: dict[str, Any]) -> str:
    """``score_prediction``'s result as a Markdown table."""
    def pct(v: float | None) -> str:
        if v is None or math.isnan(v):
            return "-"
        return f"{v:.1%}" if v < 0.1 else f"{v:.0%}"

    lines = [
        ("| hint | turns | n | next prompt: median / p90 rel. error (naive) | "
         "growth: median / p90 rel. error | next gap: median / p90 rel. error (naive) |"),
        "|---|---|---:|---|---|---|",
    ]
    for point in ("request", "tool"):
        for label, s in result[point].items():
            if not s["samples"]:
                continue
            lines.append(
                f"| {point} | {label} | {s['samples']} | "
                f"{pct(s['tokens_median_rel_error'])} / {pct(s['tokens_p90_rel_error'])} "
                f"({pct(s['tokens_median_rel_error_naive'])} / "
                f"{pct(s['tokens_p90_rel_error_naive'])}) | "
                f"{pct(s['growth_median_rel_error'])} / {pct(s['growth_p90_rel_error'])} | "
                f"{pct(s['gap_median_rel_error'])} / {pct(s['gap_p90_rel_error'])} "
                f"({pct(s['gap_median_rel_error_naive'])} / {pct(s['gap_p90_rel_error_naive'])})"
                " |")
    return "\n".join(lines)


# --- bundles ---------------------------------------------------------------------------------
def bundle(conversations: Sequence[TraceConversation], source: dict[str, Any],
           max_requests: int | None = None) -> dict[str, Any]:
    """Conversations in the bundle format (token counts and prefix hits, no hashes), each cut
    to ``max_requests``: small enough to commit, everything :func:`to_scenario` and
    :func:`score_prediction` read."""
    traces = []
    for c in conversations:
        requests = [
            {"t": round(r.t_s, 3), "type": "s" if r.stream else "n", "in": r.input_tokens,
             "out": r.output_tokens, "hit_blocks": r.hit_blocks,
             "input_types": ["tool_result"] if r.tool_result else ["text"], "stop": r.stop,
             "think_time": r.think_s}
            for r in c.requests[:max_requests]
        ]
        traces.append({"id": c.id, "block_size": c.block_size_tokens,
                       "tool_tokens": c.tool_tokens, "system_tokens": c.system_tokens,
                       "subagents_left_out": c.subagents, "requests": requests})
    return {"kv_cache_tester_traces": BUNDLE_VERSION, "source": source, "traces": traces}


# --- CLI -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """``kvtether bench traces PATH... [--predict] [--out SCENARIO] [--bundle-out FILE]``."""
    parser = argparse.ArgumentParser(
        prog="kvtether bench traces",
        description="Recorded coding-agent traces (kv-cache-tester format: trace files, "
        "directories of them, or a bundle): score the client's growth prediction on them "
        "(--predict), write them as a scaled scenario for `kvtether bench --scenario` (--out), "
        "or write a bundle (--bundle-out). Without an action: what a scenario would hold.")
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--predict", action="store_true",
                        help="score next-prompt-size and next-gap hints on the whole traces")
    parser.add_argument("--json", action="store_true", help="with --predict: print JSON")
    parser.add_argument("--out", type=Path, default=None, help="scenario file to write")
    parser.add_argument("--bundle-out", type=Path, default=None,
                        help="write the traces as a bundle (no hashes), e.g. for a fixture")
    parser.add_argument("--bundle-max-requests", type=int, default=None)
    parser.add_argument("--bundle-source", type=str, default=None,
                        help="JSON object recorded as the bundle's source (repo, commit, ...)")
    g = parser.add_argument_group("scenario")
    g.add_argument("--sessions", type=int, default=8)
    g.add_argument("--max-turns", type=int, default=32)
    g.add_argument("--min-turns", type=int, default=4)
    g.add_argument("--min-end-tokens", type=int, default=16384)
    g.add_argument("--max-end-tokens", type=int, default=32768)
    g.add_argument("--max-output-tokens", type=int, default=128)
    g.add_argument("--max-gap-s", type=float, default=900.0)
    g.add_argument("--arrival-s", type=float, default=60.0)
    g.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        conversations, source = read_traces(args.paths)
        if args.bundle_out is not None:
            extra = json.loads(args.bundle_source) if args.bundle_source else {}
            data = bundle(conversations, {**source, **extra}, args.bundle_max_requests)
            args.bundle_out.parent.mkdir(parents=True, exist_ok=True)
            args.bundle_out.writevocabulary_text(json.dumps(data, separators=(",", ":")) + "\n")
            print(f"wrote {args.bundle_out}: {len(conversations)} conversations")
        if args.predict:
            result = score_prediction(conversations)
            if args.json:
                print(json.dumps(result, indent=1))
            else:
                print(json.dumps(result["traces"]))
                print(prediction_table(result))
        if args.out is not None or not (args.predict or args.bundle_out):
            scenario = to_scenario(
                conversations, sessions=args.sessions, max_turns=args.max_turns,
                min_turns=args.min_turns, min_end_tokens=args.min_end_tokens,
                max_end_tokens=args.max_end_tokens, max_output_tokens=args.max_output_tokens,
                max_gap_s=args.max_gap_s, arrival_s=args.arrival_s, seed=args.seed,
                source=source)
            if args.out is not None:
                scenario.save(args.out)
                print(f"wrote {args.out}")
            print(json.dumps({**scenario.summary(), "scaling": scenario.source["scaling"]}))
    except (ScenarioError, ValueError, json.JSONDecodeError) as exc:
        print(f"kvtether bench traces: {exc}", file=sys.stderr)
        return 2
    return 0
