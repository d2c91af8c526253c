"""`kvtether demo`: the bundled P/D stack plus a short agent loop, printing per-turn reuse.

The agent is an ordinary OpenAI-SDK tool loop over a tiny in-memory repository. Its client is
wrapped by a kvtether Session, so every turn carries the conversation id, tools heartbeat the
lease while they run, and the session is released at the end. When the small model does not
ask for a tool itself, the loop's scripted plan picks the next one (shown as "plan").
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


logger = logging.getLogger(__name__)

__all__ = ["AgentRun", "main", "run_agent"]

REPO = {
    "README.md": "calc: a tiny calculator package. Run the tests with pytest.",
    "calc/ops.py": "def add(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n",
    "tests/test_ops.py": "from calc.ops import add, mul\n\ndef test_add():\n    assert add(2, 3) == 5\n",
}


def list_files() -> str:
    return "\n".join(sorted(REPO))


def read_file(path: str) -> str:
    return REPO.get(path, f"error: no such file {path!r}")


def run_tests() -> str:
    return (
        "============ 1 failed, 0 passed in 0.02s ============\n"
        "FAILED tests/test_ops.py::test_add - assert -1 == 5\n"
        " +  where -1 = add(2, 3)"
    )


TOOLS: dict[str, Callable[..., str]] = {
    "list_files": list_files,
    "read_file": read_file,
    "run_tests": run_tests,
}
TOOL_SPECS = [
    {"type": "function", "function": {"name": "list_files", "description": "List the files "
     "in the repository.", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "read_file", "description": "Read one file.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                    "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite.",
     "parameters": {"type": "object", "properties": {}}}},
]
# What a careful agent would do next when the model does not pick a tool itself.
PLAN: list[tuple[str, dict[str, Any]]] = [
    ("list_files", {}),
    ("run_tests", {}),
    ("read_file", {"path": "calc/ops.py"}),
    ("read_file", {"path": "tests/test_ops.py"}),
]
SYSTEM = (
    "You are a careful coding agent. Use the tools to inspect the repository, find why the "
    "tests fail, and explain the fix in one or two sentences."
)


@dataclass
class AgentRun:
    session: Any  # the closed kvtether Session, with its per-turn records
    tool_sources: list[str]  # per step: "model" (it asked for the tool) or "plan"
    messages: list[dict[str, Any]]


def run_agent(
    base_url: str, model: str, *, steps: int = 5, tool_seconds: float = 1.0, stream: bool = True
) -> AgentRun:
    """Run the agent loop against a kvtether router."""
    from openai import OpenAI

    from kvtether import Session

    session = Session(base_url=base_url)
    client = session.wrap(OpenAI(base_url=f"{base_url}/v1", api_key="kvtether", max_retries=0))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "The tests fail in this repository. Find out why."},
    ]
    sources: list[str] = []
    with session:
        for step in range(steps):
            reply = _ask(client, model, messages, stream=stream)
            messages.append(reply)
            if step == steps - 1:
                break
            calls = reply.get("tool_calls") or []
            source = "model"
            if not calls:
                name, args = PLAN[step % len(PLAN)]
                calls = [{"id": f"call_{step}", "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args)}}]
                # The model's reply stays exactly as produced: editing it would rewrite the
                # history that the decode instance holds KV for (a prefix break).
                source = "plan"
            sources.append(source)
            for call in calls:
                fn = call["function"]
                name = fn["name"]
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                except json.JSONDecodeError:
                    args = {}
                with session.tool_call(name, eta_s=tool_seconds, args=args):
                    time.sleep(tool_seconds)  # a real tool takes a while; the lease is renewed
                    tool = TOOLS.get(name)
                    try:
                        result = tool(**args) if tool else f"error: unknown tool {name}"
                    except TypeError as exc:
                        result = f"error: {exc}"
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return AgentRun(session, sources, messages)


def _ask(client: Any, model: str, messages: list[dict[str, Any]], *, stream: bool) -> dict:
    kwargs = dict(model=model, messages=messages, tools=TOOL_SPECS, max_tokens=64, temperature=0)
    if not stream:
        msg = client.chat.completions.create(**kwargs).choices[0].message
        out: dict[str, Any] = {"role": "assistant", "content": msg.content or ""}
        if msg.tool_calls:
            out["tool_calls"] = [tc.model_dump() for tc in msg.tool_calls]
        return out
    content, calls = "", {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": tc.id, "type": "function",
                                               "function": {"name": "", "arguments": ""}})
            if tc.id:
                slot["id"] = tc.id
            if tc.function and tc.function.name:
                slot["function"]["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                slot["function"]["arguments"] += tc.function.arguments
    out = {"role": "assistant", "content": content}
    if calls:
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out


def print_report(run: AgentRun, console: Any) -> None:
    """Per-turn reuse as a table that fits an 80-column terminal."""
    from rich import box
    from rich.table import Table

    session, sources = run.session, run.tool_sources
    table = Table(title=f"kvtether demo - conversation {session.conversation_id}",
                  box=box.SIMPLE_HEAD)
    table.add_column("turn", justify="right")
    table.add_column("prompt", justify="right")
    table.add_column("reused", justify="right")
    table.add_column("outcome", no_wrap=True)  # e.g. miss:decode_unavailable, never cut
    table.add_column("TTFT ms", justify="right")
    table.add_column("next tool (chosen by)")
    for i, t in enumerate(session.turns):
        style = "green" if t.outcome == "fired" else "yellow"
        ttft = f"{t.ttft_s * 1000:.0f}" if t.ttft_s is not None else "-"
        nxt = ", ".join(t.tools) if t.tools else "-"
        if i < len(sources):
            nxt += f" ({sources[i]})"
        table.add_row(str(t.turn), str(t.prompt_tokens), str(t.reused_tokens),
                      f"[{style}]{t.outcome}[/{style}]", ttft, nxt)
    console.print(table)
    fired = sum(t.reuse is not None and t.reuse.fired for t in session.turns)
    # Eligible: enough was reusable (the router's definition; misses of the others say why).
    eligible = sum(t.reuse is not None and t.reuse.eligible for t in session.turns)
    reused = sum(t.reused_tokens for t in session.turns)
    prompt = sum(t.prompt_tokens for t in session.turns)
    console.print(
        f"reuse fired on {fired}/{eligible} eligible turns ({len(session.turns)} in all); "
        f"{reused}/{prompt} prompt tokens were not recomputed."
    )


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.logging import RichHandler

    from kvtether.stack.launcher import Stack
    from kvtether.stack.settings import StackSettings

    parser = argparse.ArgumentParser(prog="kvtether demo", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="cpu-smol", help="stack profile (default cpu-smol)")
    parser.add_argument("--steps", type=int, default=5, help="model calls in the agent loop")
    parser.add_argument("--tool-seconds", type=float, default=1.0, help="how long each tool runs")
    parser.add_argument("--no-stream", action="store_true", help="use non-streamed turns")
    parser.add_argument("--router-url", default=None,
                        help="use a running kvtether router instead of starting a stack")
    parser.add_argument("--model", default=None, help="served model name (with --router-url)")
    args = parser.parse_args(argv)
    console = Console()
    logging.basicConfig(level=logging.WARNING, handlers=[RichHandler(console=console)])

    if args.router_url:
        run = run_agent(args.router_url, args.model or "smol", steps=args.steps,
                        tool_seconds=args.tool_seconds, stream=not args.no_stream)
        print_report(run, console)
        return 0
    settings = StackSettings(profile=args.profile)
    console.print(f"[bold]Starting the kvtether stack[/bold] (profile {args.profile}: "
                  f"{settings.prefill} prefill + {settings.decode} decode vLLM, router on "
                  f":{settings.port}) ...")
    with Stack(settings, progress=True, console=console) as stack:
        w = stack.warm_up_report
        if w is not None:
            verdict = ("KV reuse works, NIXL links are open" if w.fired
                       else "no reuse yet: the first turns may recompute")
            console.print(f"Stack healthy. Warm-up turns: {', '.join(w.outcomes) or '-'} "
                          f"({w.seconds:.1f} s): {verdict}.")
        console.print(f"Running a {args.steps}-step agent loop ...")
        run = run_agent(stack.router_url, stack.served_model_name, steps=args.steps,
                        tool_seconds=args.tool_seconds, stream=not args.no_stream)
        print_report(run, console)
        console.print("Stopping the stack ...")
    console.print("Done: every process the demo started has stopped.")
    return 0
