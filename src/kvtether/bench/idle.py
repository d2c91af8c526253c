"""`kvtether bench idle`: what an idle P/D stack costs, and how steady its turns are.

Starts the bundled stack twice in one run and measures each the same way:

* ``stock``: vLLM's upstream ``NixlConnector`` with vLLM's and NIXL's defaults (the engine steps
  while it holds KV for a remote reader, NIXL's progress thread busy-polls);
* ``kvtether``: the profile's defaults (``IdleSleepScheduler``, progress-thread delay, short RPC
  spin, UCX mutex; see :mod:`kvtether.stack.profiles`).

For each: a ``--turns``-turn conversation through the router with seeded gaps of 0 to
``--max-gap-s`` seconds between turns (non-streamed, so upstream's router path keeps its handle
too); per-turn wall time and reuse outcome; NIXL read time from vLLM's own
``vllm:nixl_xfer_time_seconds`` histograms (every instance, scraped before and after); then the
CPU of every process of the stack over ``--idle-s`` seconds while the conversation's last turn
is still retained on decode (its lease outlives the measurement). Outputs of the two variants
are compared token for token (greedy decoding: both must equal the colocated answer).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvtether import protocol as p
from kvtether.bench._measure import (
    CPUMeter,
    histogram_quantile,
    percentile,
    scrape_gauge,
    scrape_histogram,
)

__all__ = ["IdleBenchResult", "VariantResult", "main", "run"]

logger = logging.getLogger(__name__)

VARIANTS = ("stock", "kvtether")
_WORDS = (
    "agent tool result file test read write patch diff error trace call model step plan "
    "repository function class module value token cache decode prefill lease handle"
).split()


@dataclass
class Turn:
    index: int
    seconds: float
    ttft_s: float | None  # streamed turns only: time to the first content chunk
    outcome: str
    prompt_tokens: int
    reused_tokens: int
    gap_s: float
    text: str

    @property
    def reuse(self) -> p.ReuseOutcome | None:
        return p.parse_reuse_header(self.outcome)


@dataclass
class VariantResult:
    name: str
    turns: list[Turn] = field(default_factory=list)
    idle_cores: float = 0.0
    idle_s: float = 0.0
    idle_per_process: dict[str, float] = field(default_factory=dict)
    retained_during_idle: bool | None = None
    nixl_reads: int = 0
    nixl_read_p50_ms: float | None = None
    nixl_read_p99_ms: float | None = None
    startup_s: float = 0.0

    def percentile(self, q: float) -> float:
        return percentile([t.seconds for t in self.turns], q)

    def ttftpercentile(self, q: float) -> float | None:
        values = [t.ttft_s for t in self.turns if t.ttft_s is not None]
        return percentile(values, q) if values else None

    @property
    def prefix_breaks(self) -> int:
        return sum(t.outcome == "miss:prefix_break" for t in self.turns)

    @property
    def eligible(self) -> int:
        """Turns 2+ that had something to reuse: fired, or a miss that lost KV (the router's
        labels, docs/wire-contract.md: ``first_turn``, ``no_conversation_id``,
        ``below_threshold`` and ``prefix_break`` are not eligible)."""
        return sum(t.reuse is not None and t.reuse.eligible for t in self.turns[1:])

    @property
    def fired(self) -> int:
        return sum(t.outcome == "fired" for t in self.turns[1:])

    def _first_latency(self) -> float | None:
        if not self.turns:
            return None
        first = self.turns[0]
        return first.ttft_s if first.ttft_s is not None else first.seconds

    def fired_faster_than_first(self) -> int:
        """Fired turns whose TTFT (turn time when not streamed) beat turn 1's."""
        first = self._first_latency()
        if first is None:
            return 0
        return sum((t.ttft_s if t.ttft_s is not None else t.seconds) < first
                   for t in self.turns if t.outcome == "fired")

    def summary(self) -> dict[str, Any]:
        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 4)

        return {
            "idle_cores": round(self.idle_cores, 4),
            "turn_p50_s": r(self.percentile(50)),
            "turn_p90_s": r(self.percentile(90)),
            "turn_p99_s": r(self.percentile(99)),
            "ttft_p50_s": r(self.ttftpercentile(50)),
            "ttft_p90_s": r(self.ttftpercentile(90)),
            "ttft_p99_s": r(self.ttftpercentile(99)),
            "first_turn_ttft_s": r(self._first_latency()),
            "fired_turns_faster_than_first": self.fired_faster_than_first(),
            "fired": self.fired,
            "eligible": self.eligible,
            "prefix_breaks": self.prefix_breaks,
            "nixl_reads": self.nixl_reads,
            "nixl_read_p50_ms": self.nixl_read_p50_ms,
            "nixl_read_p99_ms": self.nixl_read_p99_ms,
            "retained_during_idle": self.retained_during_idle,
            "startup_s": round(self.startup_s, 1),
        }


@dataclass
class IdleBenchResult:
    profile: str
    turns: int
    stream: bool
    max_gap_s: float
    idle_s: float
    seed: int
    variants: dict[str, VariantResult]
    outputs_identical: bool | None

    def as_json(self) -> dict[str, Any]:
        return {
            "profile": self.profile, "turns": self.turns, "stream": self.stream,
            "max_gap_s": self.max_gap_s,
            "idle_s": self.idle_s, "seed": self.seed,
            "outputs_identical": self.outputs_identical,
            "summary": {k: v.summary() for k, v in self.variants.items()},
            "variants": {k: asdict(v) for k, v in self.variants.items()},
        }


# --- one variant ------------------------------------------------------------------------------
def _user_message(rng: random.Random, index: int, words: int) -> str:
    body = " ".join(rng.choice(_WORDS) for _ in range(words))
    return f"Tool output {index}: {body}. What next?"


def _turn(client: httpx.Client, router_url: str, model: str, cid: str,
          messages: list[dict[str, str]], max_tokens: int, *, stream: bool) -> Turn:
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens,
                            "temperature": 0, "stream": stream}
    headers = {p.HEADER_CONVERSATION_ID: cid}
    url = f"{router_url}/v1/chat/completions"
    start = time.perf_counter()
    ttft: float | None = None
    if stream:
        parts: list[str] = []
        with client.stream("POST", url, headers=headers, json=body) as r:
            if r.status_code != 200:
                r.read()
                r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices") or ():
                    delta = (choice.get("delta") or {}).get("content")
                    if delta:
                        ttft = ttft if ttft is not None else time.perf_counter() - start
                        parts.append(delta)
            response_headers = r.headers
        text = "".join(parts)
    else:
        r = client.post(url, headers=headers, json=body)
        r.raise_for_status()
        text = r.json()["choices"][0]["message"]["content"] or ""
        response_headers = r.headers
    return Turn(
        index=0, seconds=time.perf_counter() - start, ttft_s=ttft,
        outcome=response_headers.get(p.HEADER_REUSE, ""),
        prompt_tokens=int(response_headers.get(p.HEADER_PROMPT_TOKENS) or 0),
        reused_tokens=int(response_headers.get(p.HEADER_REUSED_TOKENS) or 0),
        gap_s=0.0, text=text,
    )



def _variant_settings(name: str, args: argparse.Namespace, state_dir: Path) -> Any:
    from kvtether.stack.settings import StackSettings

    common: dict[str, Any] = dict(
        profile=args.profile, state_dir=state_dir, port=args.port, base_port=args.port + 100,
        side_channel_base_port=args.port - 2400, control_base_port=args.port + 200,
        # The idle measurement needs the last turn still retained: leases outlive it.
        lease_ttl_s=max(120.0, args.idle_s * 2 + 60), health_timeout_s=900,
    )
    if name == "stock":
        return StackSettings(
            **common, connector="nixl", idle_sleep=False, progress_thread_delay_us=None,
            rpc_busy_loop_s=None, vllm_env={},
        )
    return StackSettings(**common, connector="kvtether")


def run_variant(name: str, args: argparse.Namespace, progress: Any = None) -> VariantResult:
    from kvtether.stack.launcher import Stack

    state_dir = Path(args.state_dir) / name
    settings = _variant_settings(name, args, state_dir)
    result = VariantResult(name=name)
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    with Stack(settings) as stack, httpx.Client(timeout=args.turn_timeout_s,
                                                 trust_env=False) as client:
        result.startup_s = time.monotonic() - t0
        engines = stack.prefill_urls + stack.decode_urls
        before = {u: scrape_histogram(client, u) for u in engines}
        cid = f"bench-idle-{name}-{uuid.uuid4().hex[:8]}"
        messages: list[dict[str, str]] = [
            {"role": "system", "content": "You are an agent. Answer briefly."},
        ]
        task = progress.add_task(f"{name}: turns", total=args.turns) if progress else None
        for index in range(1, args.turns + 1):
            gap = 0.0 if index == 1 else rng.uniform(0, args.max_gap_s)
            time.sleep(gap)
            messages.append({"role": "user",
                             "content": _user_message(rng, index, args.words_per_turn)})
            turn = _turn(client, stack.router_url, stack.served_model_name, cid, messages,
                         args.max_tokens, stream=args.stream)
            turn.index, turn.gap_s = index, round(gap, 3)
            messages.append({"role": "assistant", "content": turn.text})
            result.turns.append(turn)
            if progress:
                progress.advance(task)
        after = {u: scrape_histogram(client, u) for u in engines}
        buckets: dict[float, float] = {}
        for url in engines:
            for bound, count in after[url].items():
                buckets[bound] = buckets.get(bound, 0.0) + count - before[url].get(bound, 0.0)
        pairs = sorted(buckets.items())
        result.nixl_reads = int(pairs[-1][1]) if pairs else 0
        for q, attr in ((0.5, "nixl_read_p50_ms"), (0.99, "nixl_read_p99_ms")):
            value = histogram_quantile(q, pairs)
            setattr(result, attr, None if value is None else round(value * 1e3, 2))

        # Idle: the last turn's KV stays on decode (lease / upstream TTL longer than this).
        assert stack.state is not None
        meter = CPUMeter({rec.name: rec.pid for rec in stack.state.processes})
        time.sleep(2.0)  # let the last turn's own work settle
        cpu0, w0 = meter.sample(), time.monotonic()
        if progress:
            task = progress.add_task(f"{name}: idle", total=args.idle_s)
            while time.monotonic() - w0 < args.idle_s:
                time.sleep(min(1.0, args.idle_s - (time.monotonic() - w0)))
                progress.update(task, completed=min(args.idle_s, time.monotonic() - w0))
        else:
            time.sleep(args.idle_s)
        cpu1, w1 = meter.sample(), time.monotonic()
        result.idle_s = w1 - w0
        result.idle_per_process = {k: round((cpu1[k] - cpu0[k]) / result.idle_s, 4)
                                   for k in cpu0}
        result.idle_cores = sum(result.idle_per_process.values())
        usage = [scrape_gauge(client, u, "vllm:kv_cache_usage_perc") for u in stack.decode_urls]
        result.retained_during_idle = any((u or 0) > 0 for u in usage)
    return result


def run(args: argparse.Namespace) -> IdleBenchResult:
    from rich.progress import Progress

    variants: dict[str, VariantResult] = {}
    with Progress() as progress:
        for name in args.variants:
            variants[name] = run_variant(name, args, progress)
    identical = None
    if len(variants) > 1:
        texts = [[t.text for t in v.turns] for v in variants.values()]
        identical = all(t == texts[0] for t in texts[1:])
    return IdleBenchResult(args.profile, args.turns, args.stream, args.max_gap_s, args.idle_s,
                           args.seed, variants, identical)


def render(result: IdleBenchResult) -> None:
    from rich.console import Console
    from rich.table import Table

    mode = "streamed" if result.stream else "non-streamed"
    table = Table(title=f"kvtether bench idle — profile {result.profile}, {result.turns} "
                  f"{mode} turns, gaps 0-{result.max_gap_s:g} s, idle {result.idle_s:g} s")
    table.add_column("")
    for name in result.variants:
        table.add_column(name, justify="right")

    def row(label: str, fmt: Any) -> None:
        table.add_row(label, *(fmt(v) for v in result.variants.values()))

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    row("idle CPU, whole stack (cores)", lambda v: f"{v.idle_cores:.3f}")
    row("KV still retained while idle", lambda v: str(v.retained_during_idle))
    def sec(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    if result.stream:
        row("turn 1 TTFT (s)", lambda v: sec(v.turns[0].ttft_s if v.turns else None))
        row("TTFT p50 (s)", lambda v: sec(v.ttftpercentile(50)))
        row("TTFT p99 (s)", lambda v: sec(v.ttftpercentile(99)))
    row("turn 1 (s)", lambda v: f"{v.turns[0].seconds:.3f}" if v.turns else "-")
    row("turn p50 (s)", lambda v: f"{v.percentile(50):.3f}")
    row("turn p90 (s)", lambda v: f"{v.percentile(90):.3f}")
    row("turn p99 (s)", lambda v: f"{v.percentile(99):.3f}")
    row("p99 / p50", lambda v: f"{v.percentile(99) / v.percentile(50):.2f}")
    row("fired turns faster than turn 1" + (" (TTFT)" if result.stream else ""),
        lambda v: f"{v.fired_faster_than_first()}/{v.fired}")
    row("reuse fired / eligible turns", lambda v: f"{v.fired}/{v.eligible}")
    row("prefix breaks, nothing reusable (not eligible)", lambda v: str(v.prefix_breaks))
    row("NIXL reads", lambda v: str(v.nixl_reads))
    row("NIXL read p50 (ms)", lambda v: ms(v.nixl_read_p50_ms))
    row("NIXL read p99 (ms)", lambda v: ms(v.nixl_read_p99_ms))
    row("stack start (s)", lambda v: f"{v.startup_s:.0f}")
    console = Console()
    console.print(table)
    if result.stream and "stock" in result.variants:
        console.print("stock: vLLM 0.32 returns no KV handle on streamed turns, so the stock "
                      "router cannot reuse decode-held KV on them (--no-stream compares reuse "
                      "on non-streamed turns)")
    if result.outputs_identical is not None:
        console.print("outputs identical across variants: "
                      f"{'yes' if result.outputs_identical else 'NO'}")
    names = list(result.variants)
    if names[:2] == ["stock", "kvtether"]:
        s, k = result.variants["stock"], result.variants["kvtether"]
        if k.idle_cores > 0:
            console.print(f"idle CPU stock/kvtether: {s.idle_cores / k.idle_cores:.1f}x; "
                          f"turn p50 stock/kvtether: {s.percentile(50) / k.percentile(50):.1f}x; "
                          f"turn p99: {s.percentile(99) / k.percentile(99):.1f}x")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtether bench idle",
        description="Start the stack stock and with kvtether's defaults; measure idle CPU with "
        "a retained lease, turn times, NIXL read times and reuse.",
    )
    parser.add_argument("--profile", default="cpu-tiny", help="stack profile (default cpu-tiny)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--max-gap-s", type=float, default=5.0, help="gaps drawn from 0..this")
    parser.add_argument("--idle-s", type=float, default=60.0, help="idle CPU window")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per turn")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                        help="streamed turns (TTFT measured); default on")
    parser.add_argument("--words-per-turn", type=int, default=24, help="new user words a turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8400, help="router port (instances above)")
    parser.add_argument("--turn-timeout-s", type=float, default=600.0)
    parser.add_argument("--state-dir", default=".kvtether/bench-idle")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.turns < 2:
        build_parser().error("--turns must be at least 2 (turn 1 cannot reuse)")
    result = run(args)
    render(result)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.as_json(), indent=2))
        print(f"results: {args.json}")
    return 0
