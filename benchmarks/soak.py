"""Soak: N agent conversations at once, with tool gaps, for M minutes, on the real stack.

    .venv/bin/python -m benchmarks.soak --conversations 16 --minutes 30
    .venv/bin/python -m benchmarks.soak --url http://127.0.0.1:8000 --minutes 10

Without ``--url`` it starts a P/D stack (``--profile cpu-bench``, ``--prefill 1 --decode 1``,
prefill prefix cache off as in ``kvtether bench``, router on ``--port``, state and logs in
``.kvtether/soak``) and stops it at the end, on errors and on Ctrl-C. With ``--url`` it starts
nothing; when ``--state-dir`` (default ``.kvtether/stack``) holds the state file of the stack
serving that URL, it watches that stack's processes and logs too.

Each conversation is an agent on the public client layer: ``AsyncSession`` wrapping
``AsyncOpenAI``, a system prompt every conversation shares (~600 tokens), temperature 0, after
each turn a tool gap (lognormal, median ``--tool-s``, at most 60 s) inside
``session.tool_call(...)`` so heartbeats keep its lease, then ~``--prompt-tokens`` words of tool
output and the model's own answer in the history. After ``--turns MIN MAX`` turns it closes the
session (releasing its KV) and a new conversation takes its slot; a failed turn ends its
conversation too. The SDK does not retry (``max_retries=0``): every failure counts.

Every ``--window-s`` one line: turns finished, TTFT p50/p99 (streamed turns 2+: first content
token), latency p50/p99 (turns 2+), reuse (fired / eligible turns and eligible misses by cause,
the ``X-KVTether-Reuse`` outcome as the session recorded it), failed turns, stall reports found
so far in the stack's logs, RSS in MiB of each stack process (its children included) and of the
soak itself. At ``--minutes`` it starts no more turns and waits for those in flight (each at
most ``--turn-timeout-s``, then failed); Ctrl-C does the same at once, a second Ctrl-C cancels
them. Then a summary; exit status 0 only if turns ran, none failed and no stall was reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx
import psutil

from kvtether.bench._measure import percentile
from kvtether.bench.workload import filler_text
from kvtether.stack import _procs  # pid identity that survives wall-clock steps

SYSTEM_PROMPT_TOKENS = 600
MAX_TOOL_S = 60.0
TOOL_SIGMA = 1.0  # spread of the lognormal tool gaps: p90 is 3.6x the median
TOOLS = ("read_file", "grep", "run_tests", "edit_file", "list_dir")
LAUNCHED_STATE_DIR = Path(".kvtether/soak")
MIB = 1024 * 1024
# What a stuck engine step leaves in an instance log.
STALL_MARKERS = (
    "engine step has run for",  # kvtether.connector._stall.StepWatch's report
    "Timeout (0:",  # faulthandler's native watchdog, when the step holds the GIL
    "No available shared memory broadcast block",  # vLLM: a worker stopped reading its queue
    "RPC call to execute_model timed out",  # vLLM ended the engine after a stuck step
)


@dataclass(frozen=True)
class SoakOptions:
    conversations: int = 16
    duration_s: float = 1800.0
    window_s: float = 60.0
    turns: tuple[int, int] = (4, 8)  # per conversation, drawn uniformly
    tool_median_s: float = 3.0
    prompt_tokens: int = 200  # words of tool output appended per turn
    max_tokens: int = 32
    seed: int = 0
    stream_fraction: float = 0.5  # of conversations
    turn_timeout_s: float = 300.0


@dataclass
class TurnRecord:
    slot: int
    conversation_id: str
    turn: int  # 1-based, within its conversation
    stream: bool
    started_s: float  # since the soak started
    tool_s: float = 0.0  # the tool gap before this turn
    ended_s: float = 0.0
    ttft_s: float | None = None  # streamed turns: the first content token
    latency_s: float | None = None
    outcome: str = "unknown"  # the session's record: fired, miss:<cause>, unknown, error
    eligible: bool = False
    prompt_tokens: int = 0
    reused_tokens: int = 0
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None


def _quantile(values: list[float], q: float) -> float | None:
    return None if not values else round(percentile(values, q), 4)


@dataclass(frozen=True)
class TurnStats:
    """What a window line and the summary say about a set of turns."""

    turns: int
    failed: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    ttft_samples: int
    latency_p50_s: float | None
    latency_p99_s: float | None
    fired: int
    eligible: int
    misses: dict[str, int]  # eligible turns that did not reuse, by cause

    @classmethod
    def of(cls, turns: Sequence[TurnRecord]) -> TurnStats:
        ok = [t for t in turns if not t.failed]
        later = [t for t in ok if t.turn >= 2]
        ttft = [t.ttft_s for t in later if t.stream and t.ttft_s is not None]
        latency = [t.latency_s for t in later if t.latency_s is not None]
        misses = Counter(t.outcome.removeprefix("miss:") for t in ok
                         if t.eligible and t.outcome != "fired")
        return cls(
            turns=len(turns), failed=len(turns) - len(ok),
            ttft_p50_s=_quantile(ttft, 50), ttft_p99_s=_quantile(ttft, 99),
            ttft_samples=len(ttft),
            latency_p50_s=_quantile(latency, 50), latency_p99_s=_quantile(latency, 99),
            fired=sum(t.outcome == "fired" for t in ok), eligible=sum(t.eligible for t in ok),
            misses=dict(misses.most_common()),
        )

    def text(self) -> str:
        misses = ", ".join(f"{cause} {n}" for cause, n in self.misses.items())
        return (f"turns {self.turns:4d}  ttft p50/p99 {_s(self.ttft_p50_s)}/{_s(self.ttft_p99_s)}"
                f" s  latency p50/p99 {_s(self.latency_p50_s)}/{_s(self.latency_p99_s)} s  "
                f"reuse {self.fired}/{self.eligible}" + (f" (miss {misses})" if misses else "")
                + f"  failed {self.failed}")


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _mib(x: float | None) -> str:
    return f"{'-' if x is None else f'{x:.0f}':>8}"


def _say(line: str) -> None:
    print(line, flush=True)


@dataclass
class Window:
    index: int
    start_s: float
    end_s: float
    stats: TurnStats
    stall_reports: int  # found so far
    rss_mib: dict[str, float]

    def line(self) -> str:
        rss = " ".join(f"{name} {mib:.0f}" for name, mib in self.rss_mib.items())
        return (f"[window {self.index} {self.start_s:.0f}-{self.end_s:.0f} s] {self.stats.text()}"
                f"  stalls {self.stall_reports}  rss MiB {rss}")


# --------------------------------------------------------------------------- the stack's side
class _Named(Protocol):
    name: str
    pid: int


class ProcessLike(_Named, Protocol):
    """What the watch reads of a stack process (a ``kvtether.stack`` process record)."""

    create_time: float | None
    log_path: Path


def _tree_rss(pid: int, create_time: float | None, *, children: bool) -> int | None:
    """RSS of ``pid`` (and its descendants: a vLLM API server's engine and workers) in bytes;
    None when it is gone or its pid now belongs to another process."""
    if not _procs.is_alive(pid, create_time):
        return None
    try:
        proc = psutil.Process(pid)
        procs = [proc, *(proc.children(recursive=True) if children else ())]
    except psutil.Error:
        return None
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass  # exited meanwhile
    return total


class StackWatch:
    """The stack's processes (RSS) and logs (stall reports), looked at once per window.

    ``records`` is asked at every look, so a process the supervisor restarted is followed; with
    none, the watch sees the soak's own process only.
    """

    def __init__(self, records: Callable[[], Sequence[ProcessLike]] = lambda: (),
                 source: str = "") -> None:
        self._records = records
        self.source = source
        self._offsets: dict[Path, int] = {}
        self.stalls: list[str] = []  # "<process>: <log line>"
        self.dumps: list[str] = []  # stack dumps taken when a stall was seen (dump_stacks)

    @classmethod
    def for_url(cls, url: str, state_dir: Path) -> StackWatch:
        """The stack recorded in ``state_dir`` when its router serves ``url``; else none.
        Only what its logs say from now on counts."""
        from kvtether.stack import StackError
        from kvtether.stack._state import load_state  # the file `kvtether stack status` reads

        def records() -> Sequence[ProcessLike]:
            try:
                state = load_state(state_dir)
            except StackError:  # unreadable just now: look again next time
                return ()
            return state.processes if state is not None else ()

        try:
            state = load_state(state_dir)
        except StackError:
            state = None
        if state is None or not _same_endpoint(state.router_url, url):
            return cls(source=f"no stack state for {url} in {state_dir}: RSS of the soak only, "
                              "no log scan")
        watch = cls(records, source=f"stack processes and logs from {state_dir}/stack.json")
        watch.skip_existing()
        return watch

    def rss_mib(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for record in self._records():
            rss = _tree_rss(record.pid, record.create_time, children=True)
            if rss is not None:
                out[record.name] = round(rss / MIB, 1)
        own = _tree_rss(os.getpid(), None, children=False)
        out["soak"] = round((own or 0) / MIB, 1)
        return out

    def skip_existing(self) -> None:
        """Count only what the logs say after this call."""
        for record in self._records():
            try:
                self._offsets[Path(record.log_path)] = Path(record.log_path).stat().st_size
            except OSError:
                pass

    def scan_logs(self) -> list[str]:
        """Stall reports written since the last scan (whole lines only)."""
        new: list[str] = []
        for record in self._records():
            path = Path(record.log_path)
            try:
                with path.open("rb") as f:
                    size = f.seek(0, os.SEEK_END)
                    start = self._offsets.get(path, 0)
                    start = 0 if size < start else start  # truncated: a new file
                    f.seek(start)
                    data = f.read(size - start)
            except OSError:
                continue
            end = data.rfind(b"\n") + 1  # a line still being written is read next time
            self._offsets[path] = start + end
            found = [f"{record.name}: {line.strip()[:300]}"
                     for line in data[:end].decode(errors="replace").splitlines()
                     if any(marker in line for marker in STALL_MARKERS)]
            if found:
                self.dumps += dump_stacks(record, path.parent / "stall-dumps")
            new += found
        self.stalls += new
        return new


def _describe(exc: BaseException) -> str:
    """``Type: message``, with the cause the SDK wraps (an APIConnectionError says only
    "Connection error."; its cause says which: refused, reset, a closed keep-alive connection)."""
    said = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__ or exc.__context__
    if cause is not None and cause is not exc:
        said += f" (from {type(cause).__name__}: {cause})"
    return said[:300]


def dump_stacks(record: _Named, out_dir: Path, prefix: str = "") -> list[str]:
    """Every thread's Python and native stack of ``record``'s process and its children, taken
    from outside with py-spy (when installed: the dev extra has it), one file per process,
    vLLM's engine core and worker first; each file starts with the time it was taken.

    From outside, because a stall vLLM reports ("No available shared memory broadcast block")
    can sit where no in-process watch runs: between two steps, in vLLM's RPC queue."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).is_file():
        return []
    try:
        root = psutil.Process(record.pid)
        procs = [root, *root.children(recursive=True)]
        procs.sort(key=lambda p: 0 if p.name().startswith("VLLM::") else 1)
    except psutil.Error:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%H%M%S")
    written = []
    for proc in procs:
        out = out_dir / f"{prefix}{record.name}-{stamp}-{proc.pid}.txt"
        taken = time.strftime("%H:%M:%S")
        try:
            r = subprocess.run([spy, "dump", "--native", "--pid", str(proc.pid)],
                               capture_output=True, text=True, timeout=30)
            out.write_text(f"taken {taken}: {' '.join(proc.cmdline()[:4])}\n{r.stdout}{r.stderr}")
        except (OSError, subprocess.SubprocessError, psutil.Error) as exc:
            out.write_text(f"taken {taken}: py-spy dump failed: {exc!r}\n")
        written.append(str(out))
    return written


def _same_endpoint(a: str | None, b: str) -> bool:
    loopback = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}
    if a is None:
        return False
    ua, ub = urlsplit(a), urlsplit(b)
    hosts = {ua.hostname, ub.hostname}
    return ua.port == ub.port and (len(hosts) == 1 or hosts <= loopback)


# --------------------------------------------------------------------------- the agents
def tool_gap_s(rng: random.Random, median_s: float) -> float:
    return min(MAX_TOOL_S, median_s * math.exp(rng.gauss(0.0, TOOL_SIGMA)))


def system_prompt(seed: int) -> str:
    return ("You are a coding agent. Read the tool output you are given and answer in one short "
            "sentence with the next step. Project notes: "
            + filler_text(SYSTEM_PROMPT_TOKENS, seed=seed))


async def served_model(http: httpx.AsyncClient, url: str) -> str:
    r = await http.get(f"{url}/v1/models", timeout=30.0)
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


@dataclass
class SoakResult:
    url: str
    model: str
    options: SoakOptions
    run_id: str
    started_unix_s: float
    elapsed_s: float = 0.0
    conversations: int = 0  # started
    interrupted: bool = False
    turns: list[TurnRecord] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)
    stalls: list[str] = field(default_factory=list)
    stack_dumps: list[str] = field(default_factory=list)  # py-spy dumps taken at stalls
    watch_source: str = ""

    @property
    def failed(self) -> int:
        return sum(t.failed for t in self.turns)

    def exit_code(self) -> int:
        return 0 if self.turns and not self.failed and not self.stalls else 1

    def rss_trend(self) -> dict[str, dict[str, float | None]]:
        """Per process: RSS in the first and the last window, and the highest seen."""
        if not self.windows:
            return {}
        first, last = self.windows[0].rss_mib, self.windows[-1].rss_mib
        names = dict.fromkeys(n for w in self.windows for n in w.rss_mib)
        return {n: {"first_mib": first.get(n), "last_mib": last.get(n),
                    "max_mib": max(w.rss_mib.get(n, 0.0) for w in self.windows)}
                for n in names}

    def summary(self) -> dict[str, Any]:
        return {"elapsed_s": round(self.elapsed_s, 1), "conversations": self.conversations,
                "interrupted": self.interrupted, **asdict(TurnStats.of(self.turns)),
                "stall_reports": len(self.stalls), "rss": self.rss_trend(),
                "errors": dict(Counter(t.error for t in self.turns if t.error).most_common(10)),
                "exit_code": self.exit_code()}

    def as_json(self) -> dict[str, Any]:
        return {"url": self.url, "model": self.model, "run_id": self.run_id,
                "started_unix_s": self.started_unix_s, "options": asdict(self.options),
                "watch": self.watch_source, "summary": self.summary(),
                "windows": [asdict(w) for w in self.windows], "stall_reports": self.stalls,
                "stack_dumps": self.stack_dumps,
                "turns": [asdict(t) for t in self.turns]}

    def text(self) -> str:
        s = TurnStats.of(self.turns)
        lines = [f"soak summary: {s.turns} turns in {self.elapsed_s:.0f} s, "
                 f"{self.conversations} conversations"
                 + (" (interrupted)" if self.interrupted else ""),
                 f"  TTFT p50/p99 (streamed turns 2+, n={s.ttft_samples}): "
                 f"{_s(s.ttft_p50_s)}/{_s(s.ttft_p99_s)} s; latency p50/p99 (turns 2+): "
                 f"{_s(s.latency_p50_s)}/{_s(s.latency_p99_s)} s",
                 f"  reuse: {s.fired}/{s.eligible} eligible turns fired"
                 + "".join(f"; miss {c}: {n}" for c, n in s.misses.items())]
        lines.append(f"  failed turns: {s.failed}")
        lines += [f"    {n}x {error}" for error, n in self.summary()["errors"].items()]
        lines.append(f"  stall reports: {len(self.stalls)}")
        lines += [f"    {line}" for line in self.stalls[:20]]
        if self.stack_dumps:
            lines.append(f"  stack dumps (py-spy) taken at the stalls: "
                         f"{len(self.stack_dumps)} in {Path(self.stack_dumps[0]).parent}")
        lines.append("  RSS MiB, first window -> last window (max):")
        for name, r in self.rss_trend().items():
            first, last = r["first_mib"], r["last_mib"]
            change = f"{last - first:+.0f}" if first is not None and last is not None else "gone"
            lines.append(f"    {name:<12} {_mib(first)} -> {_mib(last)} ({change}, "
                         f"max {r['max_mib']:.0f})")
        verdict = "OK" if self.exit_code() == 0 else "FAILED"
        lines.append(f"result: {verdict} ({s.failed} failed turns, {len(self.stalls)} stall "
                     f"reports{', no turn finished' if not self.turns else ''})")
        return "\n".join(lines)


class _Soak:
    """The conversations of one run, sharing its stop event and its turn list."""

    def __init__(self, result: SoakResult, client: Any, stop: asyncio.Event) -> None:
        self.result = result
        self.opts = result.options
        self.client = client
        self.stop = stop
        self.system_prompt = system_prompt(self.opts.seed)
        self.t0 = time.monotonic()
        self.in_flight = 0
        self._counted = 0  # turns already in a window

    def now_s(self) -> float:
        return time.monotonic() - self.t0

    async def pause(self, seconds: float) -> bool:
        """Sleep ``seconds``, less if the soak stops meanwhile; True when it is stopping."""
        try:
            await asyncio.wait_for(self.stop.wait(), seconds)
        except asyncio.TimeoutError:
            return False
        return True

    async def slot(self, slot: int) -> None:
        """One conversation after another until the soak stops."""
        rng = random.Random(f"{self.opts.seed}:{slot}")
        if await self.pause(rng.uniform(0.0, self.opts.tool_median_s)):  # stagger the starts
            return
        generation = 0
        while not self.stop.is_set():
            generation += 1
            if not await self.conversation(slot, generation, rng):
                # Back off before the next conversation: a router that is down is not hammered.
                if await self.pause(tool_gap_s(rng, self.opts.tool_median_s)):
                    return

    async def conversation(self, slot: int, generation: int, rng: random.Random) -> bool:
        """One agent conversation; False when a turn failed (which ends it)."""
        from kvtether import AsyncSession

        cid = f"soak-{self.result.run_id}-{slot}-{generation}"
        session = AsyncSession(base_url=self.result.url, conversation_id=cid)
        client = session.wrap(self.client)
        stream = rng.random() < self.opts.stream_fraction
        messages: list[dict[str, str]] = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": f"Task {cid}: the test suite fails in module "
                                        f"{filler_text(3, seed=rng.randrange(2**31))}; fix it."},
        ]
        self.result.conversations += 1
        try:
            for n in range(1, rng.randint(*self.opts.turns) + 1):
                tool_s = 0.0
                if n > 1:
                    tool = rng.choice(TOOLS)
                    tool_s = tool_gap_s(rng, self.opts.tool_median_s)
                    async with session.tool_call(tool, eta_s=tool_s):
                        if await self.pause(tool_s):
                            return True
                    output = filler_text(self.opts.prompt_tokens, seed=rng.randrange(2**31))
                    messages.append({"role": "user", "content": f"{tool} returned:\n{output}"})
                if self.stop.is_set():
                    return True
                record, text = await self.turn(session, client, slot, n, stream, messages)
                record.tool_s = round(tool_s, 3)
                if record.failed:
                    return False
                messages.append({"role": "assistant", "content": text})
            return True
        finally:
            await session.aclose()  # releases the conversation's KV; never raises

    async def turn(self, session: Any, client: Any, slot: int, n: int, stream: bool,
                   messages: list[dict[str, str]]) -> tuple[TurnRecord, str]:
        record = TurnRecord(slot=slot, conversation_id=session.conversation_id, turn=n,
                            stream=stream, started_s=round(self.now_s(), 3))
        recorded = len(session.turns)
        text = ""
        started = time.perf_counter()
        self.in_flight += 1
        try:
            text, ttft_s = await asyncio.wait_for(self._ask(client, messages, stream),
                                                  self.opts.turn_timeout_s)
        except asyncio.TimeoutError:
            record.error = f"no answer within {self.opts.turn_timeout_s:g} s"
        except asyncio.CancelledError:
            record.error = "cancelled (Ctrl-C)"
            raise
        except Exception as exc:  # a failed turn is a result, not a crash of the soak
            record.error = _describe(exc)
        else:
            record.latency_s = round(time.perf_counter() - started, 4)
            record.ttft_s = None if ttft_s is None else round(ttft_s, 4)
        finally:
            self.in_flight -= 1
            record.ended_s = round(self.now_s(), 3)
            turns = session.turns
            if len(turns) > recorded:  # the session's record of this request
                last = turns[-1]
                record.outcome, record.eligible = last.outcome, last.eligible
                record.prompt_tokens, record.reused_tokens = last.prompt_tokens, last.reused_tokens
                if record.error is None and last.outcome == "error":
                    record.error = (last.error or "the session recorded an error")[:300]
            self.result.turns.append(record)
        return record, text

    async def _ask(self, client: Any, messages: list[dict[str, str]],
                   stream: bool) -> tuple[str, float | None]:
        """One model call; the reply's text and, when streamed, the time to its first token."""
        kwargs: dict[str, Any] = dict(model=self.result.model, messages=messages,
                                      max_tokens=self.opts.max_tokens, temperature=0)
        if not stream:
            response = await client.chat.completions.create(**kwargs)
            return response.choices[0].message.content or "", None
        started = time.perf_counter()
        ttft_s: float | None = None
        parts: list[str] = []
        chunks = await client.chat.completions.create(**kwargs, stream=True)
        async for chunk in chunks:
            for choice in chunk.choices:
                if choice.delta is not None and choice.delta.content:
                    if ttft_s is None:
                        ttft_s = time.perf_counter() - started
                    parts.append(choice.delta.content)
        return "".join(parts), ttft_s

    def close_window(self, index: int, watch: StackWatch) -> Window:
        new = self.result.turns[self._counted:]
        self._counted += len(new)
        watch.scan_logs()
        window = Window(index=index, start_s=round(index * self.opts.window_s, 1),
                        end_s=round(self.now_s(), 1), stats=TurnStats.of(new),
                        stall_reports=len(watch.stalls), rss_mib=watch.rss_mib())
        self.result.windows.append(window)
        self.result.stalls = list(watch.stalls)
        self.result.stack_dumps = list(watch.dumps)
        return window


def _write_json(path: Path, result: SoakResult) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result.as_json(), indent=1))
    os.replace(tmp, path)  # a reader (or a soak killed mid-write) never sees half a file


async def run(url: str, opts: SoakOptions, *, watch: StackWatch | None = None,
              json_out: Path | None = None, say: Callable[[str], None] = _say,
              handle_signals: bool = False) -> SoakResult:
    """Soak the router at ``url``; see the module docstring. ``handle_signals``: Ctrl-C (and
    SIGTERM) stop the soak instead of raising (main thread only)."""
    from openai import AsyncOpenAI

    url = url.rstrip("/").removesuffix("/v1")
    watch = watch or StackWatch()
    api_key = os.environ.get("KVTETHER_API_KEY") or "-"
    async with httpx.AsyncClient(trust_env=False, timeout=opts.turn_timeout_s) as http:
        result = SoakResult(url=url, model=await served_model(http, url), options=opts,
                            run_id=uuid.uuid4().hex[:8], started_unix_s=time.time(),
                            watch_source=watch.source)
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0,
                             timeout=opts.turn_timeout_s, http_client=http)
        say(f"soak {result.run_id}: {opts.conversations} conversations of {opts.turns[0]}-"
            f"{opts.turns[1]} turns for {opts.duration_s / 60:g} min, tool gaps median "
            f"{opts.tool_median_s:g} s, +{opts.prompt_tokens} words a turn, "
            f"{opts.stream_fraction:.0%} streamed; {url} ({result.model})")
        if watch.source:
            say(f"  {watch.source}")
        stop = asyncio.Event()
        soak = _Soak(result, client, stop)
        loop = asyncio.get_running_loop()
        deadline = loop.call_later(opts.duration_s, stop.set)
        slots = [asyncio.create_task(soak.slot(i)) for i in range(opts.conversations)]
        everything = asyncio.gather(*slots)

        def on_signal() -> None:
            if not stop.is_set():
                result.interrupted = True
                stop.set()
                say(f"stopping: no new turns, waiting for {soak.in_flight} in flight "
                    "(Ctrl-C again cancels them)")
            else:
                say("cancelling the turns in flight")
                for task in slots:
                    task.cancel()

        signals = (signal.SIGINT, signal.SIGTERM) if handle_signals else ()
        if threading.current_thread() is not threading.main_thread():
            signals = ()
        for sig in signals:
            loop.add_signal_handler(sig, on_signal)
        try:
            index = 0
            while True:
                next_end = soak.t0 + (index + 1) * opts.window_s
                done, _ = await asyncio.wait({everything},
                                             timeout=max(0.0, next_end - time.monotonic()))
                say(soak.close_window(index, watch).line())
                result.elapsed_s = soak.now_s()
                if json_out is not None:
                    _write_json(json_out, result)
                if done:
                    break
                index += 1
        finally:
            deadline.cancel()
            for sig in signals:
                loop.remove_signal_handler(sig)
            for task in slots:
                task.cancel()
            outcomes = await asyncio.gather(*slots, return_exceptions=True)
            if everything.done() and not everything.cancelled():
                everything.exception()  # seen below, through the slots' outcomes
        bugs = [o for o in outcomes if isinstance(o, Exception)]
        if bugs:
            raise bugs[0]
        result.elapsed_s = soak.now_s()
    if json_out is not None:
        _write_json(json_out, result)
    return result


# --------------------------------------------------------------------------- the command
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="soak.py", description="N agent conversations with tool gaps for M minutes on the "
        "real stack; per-window statistics, exit 1 on failed turns or stall reports")
    parser.add_argument("--url", default=None,
                        help="a running kvtether router (then nothing is started)")
    parser.add_argument("--profile", default="cpu-bench",
                        help="stack profile when it starts one (default cpu-bench)")
    parser.add_argument("--port", type=int, default=8800,
                        help="router port of the stack it starts; instances above it")
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--prefill-cache", action=argparse.BooleanOptionalAction, default=False,
                        help="prefix cache on the prefill instances (default off, as in "
                        "`kvtether bench`)")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help=f"stack state and logs (default {LAUNCHED_STATE_DIR} for the stack "
                        "it starts; with --url, where `kvtether stack up` wrote its state, "
                        "default .kvtether/stack)")
    parser.add_argument("--conversations", type=int, default=16, help="at once (default 16)")
    parser.add_argument("--minutes", type=float, default=30.0,
                        help="start turns for this long (default 30)")
    parser.add_argument("--window-s", type=float, default=60.0, help="one line per window")
    parser.add_argument("--turns", type=int, nargs=2, default=[4, 8], metavar=("MIN", "MAX"),
                        help="turns per conversation before it ends (default 4 8)")
    parser.add_argument("--tool-s", type=float, default=3.0,
                        help=f"median tool gap, lognormal, at most {MAX_TOOL_S:g} s (default 3)")
    parser.add_argument("--prompt-tokens", type=int, default=200,
                        help="words of tool output appended per turn (default 200)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--stream-fraction", type=float, default=0.5,
                        help="share of conversations that stream (default 0.5)")
    parser.add_argument("--turn-timeout-s", type=float, default=300.0,
                        help="a turn with no answer by then fails (default 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None,
                        help="write every turn and window here (rewritten every window)")
    return parser


def options_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> SoakOptions:
    low, high = args.turns
    problems = [
        (args.conversations < 1, "--conversations must be at least 1"),
        (args.minutes <= 0, "--minutes must be positive"),
        (args.window_s <= 0, "--window-s must be positive"),
        (not 1 <= low <= high, "--turns needs 1 <= MIN <= MAX"),
        (args.tool_s < 0, "--tool-s cannot be negative"),
        (args.prompt_tokens < 0, "--prompt-tokens cannot be negative"),
        (args.max_tokens < 1, "--max-tokens must be at least 1"),
        (not 0 <= args.stream_fraction <= 1, "--stream-fraction must be within 0..1"),
        (args.turn_timeout_s <= 0, "--turn-timeout-s must be positive"),
    ]
    for bad, message in problems:
        if bad:
            parser.error(message)
    return SoakOptions(
        conversations=args.conversations, duration_s=args.minutes * 60, window_s=args.window_s,
        turns=(low, high), tool_median_s=args.tool_s, prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens, seed=args.seed, stream_fraction=args.stream_fraction,
        turn_timeout_s=args.turn_timeout_s,
    )


def stack_settings(args: argparse.Namespace) -> Any:
    """The stack the soak starts without ``--url`` (ports laid out as `kvtether bench` does)."""
    from kvtether.stack import StackSettings

    port = args.port
    return StackSettings(
        profile=args.profile, state_dir=args.state_dir or LAUNCHED_STATE_DIR, port=port,
        base_port=port + 100, side_channel_base_port=port - 2400, control_base_port=port + 200,
        prefill=args.prefill, decode=args.decode, prefill_prefix_caching=args.prefill_cache,
        health_timeout_s=900.0,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    opts = options_from(args, parser)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    def soak(url: str, watch: StackWatch) -> SoakResult:
        return asyncio.run(run(url, opts, watch=watch, json_out=args.json, handle_signals=True))

    try:
        if args.url is not None:
            state_dir = args.state_dir or Path(".kvtether/stack")
            result = soak(args.url, StackWatch.for_url(args.url, state_dir))
        else:
            from kvtether.stack import Stack

            settings = stack_settings(args)
            print(f"starting the stack ({args.profile}, {args.prefill}P+{args.decode}D, logs in "
                  f"{settings.state_dir}/logs)", flush=True)
            # SIGTERM while the stack starts stops what it started, as Ctrl-C does (the run
            # installs its own handlers later); die_with_parent: a soak killed outright (SIGKILL)
            # still takes its stack down.
            signal.signal(signal.SIGTERM, _interrupt)
            with Stack(settings, progress=True, die_with_parent=True) as stack:
                watch = StackWatch(lambda: stack.state.processes if stack.state else (),
                                   source=f"stack processes and logs in {settings.state_dir}")
                result = soak(stack.router_url, watch)
    except KeyboardInterrupt:  # while the stack was starting; it stopped what it started
        print("interrupted", file=sys.stderr)
        return 130
    print(result.text())
    if args.json is not None:
        print(f"results: {args.json}")
    return result.exit_code()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
