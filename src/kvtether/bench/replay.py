"""Replay a scenario's sessions concurrently through the OpenAI SDK, as agents would.

Sessions start at their scenario arrival times, or, with ``concurrency=N`` (the bench's
concurrency sweep), in scenario order as soon as one of N slots is free: at most N sessions run
at once and arrival times are ignored. Each session is one agent: it appends its turn's
messages, calls the model (streamed or not, as the scenario says), appends the model's own
answer, then waits out the gap (a tool running, a person thinking), every duration divided by
the time-compression factor. For the ``kvtether`` strategy the OpenAI client is wrapped by
:class:`kvtether.AsyncSession`, the tool gaps run inside ``session.tool_call(...)`` (heartbeats
renew the lease) and the session is closed (its KV released) at the end; the other strategies
use the plain SDK, the way they are deployed.

Per turn it records TTFT (streamed turns: first token), TPOT and the gaps between tokens
(streamed turns: :func:`_call`), latency, prompt and output token ids (``return_token_ids``),
the cached tokens the server reports and the router's outcome label, and from the token ids
the turn's honest reuse outcome (:mod:`kvtether.bench.metrics`). A sampler reads
``vllm:kv_cache_usage_perc`` of the instances that hold KV every ``sample_every_s`` for the
retained-KV curve, and keeps sampling after the last session until that KV is gone (so a
fixed TTL's tail is counted).

Per replay it also records the CPU time of every process the strategy started (all are
descendants of the bench process: :class:`~kvtether.bench._measure.DescendantCPU`, polled with
each KV sample), over the sessions and over the drain after them, and the NIXL reads of the
instances named in ``nixl_urls`` (their ``vllm:nixl_bytes_transferred`` and
``vllm:nixl_xfer_time_seconds`` histograms, scraped before and after), with the served model's
KV bytes per token (its ``config.json``, found through ``/v1/models``' ``root``).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from kvtether import protocol as p
from kvtether.bench._measure import (
    DescendantCPU,
    NixlTotals,
    kv_bytes_per_token,
    metric_families,
    nixl_totals,
)
from kvtether.bench.metrics import TurnResult, classify
from kvtether.bench.scenario import Scenario, ScenarioSession
from kvtether.bench.strategies import Endpoints, Strategy

__all__ = ["KVSample", "ReplayResult", "TurnGate", "replay"]

logger = logging.getLogger(__name__)


@dataclass
class KVSample:
    t_s: float  # wall seconds since the replay started
    tokens: float  # KV tokens held, summed over the sampled instances


class TurnGate(Protocol):
    """Holds each model call until another replay lets it go (``benchmarks.lone_pairs``
    runs two deployments' replays of one session turn by turn, one call at a time)."""

    def turn(self, session: str, index: int) -> AbstractAsyncContextManager[None]:
        """Entered before turn ``index`` (1-based) of ``session`` is sent, left after its
        answer (or failure)."""
        ...

    def ended(self, session: str) -> None:
        """``session`` sends no more turns (its last one ran, or one failed)."""
        ...


@dataclass
class ReplayResult:
    turns: list[TurnResult] = field(default_factory=list)
    kv: list[KVSample] = field(default_factory=list)
    wall_s: float = 0.0  # first session start to last session end
    drain_s: float = 0.0  # after that, until the held KV was gone (or the cap)
    kv_capacity_tokens: dict[str, int] = field(default_factory=dict)
    not_run: int = 0  # turns after a failed turn in the same session
    # CPU seconds (user + system) of the processes the strategy started, over wall_s and over
    # drain_s (not this client's own).
    core_s: float | None = None
    drain_core_s: float | None = None
    # Per role of ``nixl_urls`` ("decode": P->D reads; "prefill": D->P reads): NIXL reads
    # during the replay, NixlTotals.summary().
    nixl: dict[str, dict[str, Any]] = field(default_factory=dict)
    kv_bytes_per_token: int | None = None  # the served model's, from its config.json


async def _kv_capacity(client: httpx.AsyncClient, url: str) -> int:
    """KV capacity of one instance in tokens, from ``vllm:cache_config_info``."""
    text = (await client.get(f"{url}/metrics")).text
    for family in metric_families(text, "vllm:cache_config_info"):
        for sample in family.samples:
            blocks = sample.labels.get("num_gpu_blocks")
            size = sample.labels.get("block_size")
            if blocks and blocks != "None" and size:
                return int(blocks) * int(size)
    return 0


async def _kv_bytes_per_token(client: httpx.AsyncClient, url: str) -> int | None:
    """The served model's KV bytes per token, from the ``config.json`` in the directory vLLM
    reports as the model's ``root`` (the bench runs on the serving host); None when unknown."""
    try:
        models = (await client.get(f"{url}/v1/models")).json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    root = models[0].get("root") if models and isinstance(models[0], dict) else None
    return kv_bytes_per_token(Path(root)) if root else None


async def _kv_usage(client: httpx.AsyncClient, url: str) -> float:
    text = (await client.get(f"{url}/metrics")).text
    return sum(s.value for family in metric_families(text, "vllm:kv_cache_usage_perc")
               for s in family.samples)


class _Sampler:
    def __init__(self, urls: list[str], capacity: dict[str, int], every_s: float) -> None:
        self.urls, self.capacity, self.every_s = urls, capacity, every_s
        self.samples: list[KVSample] = []
        self.cpu = DescendantCPU()
        self.t0 = time.monotonic()

    async def sample(self, client: httpx.AsyncClient) -> float:
        values = await asyncio.gather(*(_kv_usage(client, u) for u in self.urls),
                                      return_exceptions=True)
        tokens = sum(v * self.capacity.get(u, 0) for u, v in zip(self.urls, values, strict=True)
                     if isinstance(v, float))
        self.samples.append(KVSample(round(time.monotonic() - self.t0, 3), round(tokens, 1)))
        # Off the event loop: walking the process tree takes a few milliseconds, which would
        # land in the first-token and inter-token times the loop measures.
        await asyncio.to_thread(self.cpu.poll)
        return tokens

    async def run(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.sample(client)
            try:
                await asyncio.wait_for(stop.wait(), self.every_s)
            except TimeoutError:
                pass


def _ids_digest(ids: list[int]) -> str:
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:16]


def _extra(obj: Any, name: str) -> Any:
    extra = getattr(obj, "model_extra", None) or {}
    return extra.get(name, getattr(obj, name, None))


async def _parsed(raw: Any) -> Any:
    """``raw.parse()``: a value in openai 2.x's async client, awaitable in others."""
    value = raw.parse()
    return await value if inspect.isawaitable(value) else value


def token_times(arrivals: list[tuple[float, int]]) -> tuple[float | None, list[float]]:
    """TPOT and the inter-token gaps of one streamed answer, from its chunks that carried
    tokens: (arrival time, how many tokens).

    TPOT: from the first token's chunk to the last one's, over the tokens after the first
    (vLLM's own benchmark's definition; None below two tokens). Gaps: one per chunk after the
    first, the time since the chunk before, not divided among a chunk's tokens: a chunk of
    several tokens after a stall is one stall, as a reader of the stream sees it.
    """
    tokens = sum(n for _, n in arrivals)
    tpot = ((arrivals[-1][0] - arrivals[0][0]) / (tokens - 1)) if tokens >= 2 else None
    gaps = [b[0] - a[0] for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return tpot, gaps


async def _call(client: Any, endpoints: Endpoints, strategy: Strategy, cid: str,
                messages: list[dict[str, str]], max_tokens: int, stream: bool
                ) -> tuple[dict[str, Any], Any]:
    """One model call; returns what the turn record needs, and the response headers.

    A streamed call records when each chunk that carries tokens (``token_ids`` over its
    choices; one chunk may carry several) arrived, for :func:`token_times`."""
    extra_body: dict[str, Any] = {"return_token_ids": True}
    if strategy.body_conversation_id:
        extra_body[p.BODY_CONVERSATION_ID] = cid
    kwargs: dict[str, Any] = dict(model=endpoints.served_model_name, messages=messages,
                                  max_tokens=max_tokens, temperature=0, stream=stream,
                                  extra_body=extra_body)
    if stream:
        kwargs["stream_options"] = {"include_usage": True}
    if strategy.session_header:  # what a session-affinity router hashes (colocated-dp)
        kwargs["extra_headers"] = {strategy.session_header: cid}
    sent_unix_s = time.time()  # against the router's clock (same host): client_to_router
    start = time.perf_counter()
    raw = await client.chat.completions.with_raw_response.create(**kwargs)
    out: dict[str, Any] = {"ttft_s": None, "prompt_ids": None, "output_ids": [], "text": "",
                           "usage": None, "sent_unix_s": sent_unix_s, "tpot_s": None,
                           "itl_s": None}
    if stream:
        chunks = await _parsed(raw)
        parts: list[str] = []
        arrivals: list[tuple[float, int]] = []
        async for chunk in chunks:
            now = time.perf_counter()
            if out["prompt_ids"] is None and _extra(chunk, "prompt_token_ids"):
                out["prompt_ids"] = list(_extra(chunk, "prompt_token_ids"))
            carried = 0
            for choice in chunk.choices:
                ids = _extra(choice, "token_ids") or []
                content = choice.delta.content if choice.delta else None
                if out["ttft_s"] is None and (ids or content):
                    out["ttft_s"] = now - start
                out["output_ids"].extend(ids)
                carried += len(ids)
                if content:
                    parts.append(content)
            if carried:
                arrivals.append((now, carried))
            if chunk.usage is not None:
                out["usage"] = chunk.usage
        out["text"] = "".join(parts)
        if arrivals:
            out["tpot_s"], out["itl_s"] = token_times(arrivals)
    else:
        resp = await _parsed(raw)
        choice = resp.choices[0]
        out["prompt_ids"] = list(_extra(resp, "prompt_token_ids") or [])
        out["output_ids"] = list(_extra(choice, "token_ids") or [])
        out["text"] = choice.message.content or ""
        out["usage"] = resp.usage
    out["latency_s"] = time.perf_counter() - start
    return out, raw.headers


async def _session(
    s: ScenarioSession, scenario: Scenario, endpoints: Endpoints, strategy: Strategy,
    compress: float, run_id: str, t0: float, results: list[TurnResult],
    advance: Callable[[int], None], timeout_s: float, gate: TurnGate | None = None,
) -> int:
    """One agent session, from its first turn; returns how many of its turns did not run
    after a failure."""
    from openai import AsyncOpenAI

    from kvtether import AsyncSession

    cid = f"bench-{run_id}-{s.id}"
    http = httpx.AsyncClient(trust_env=False, timeout=timeout_s)
    client: Any = AsyncOpenAI(base_url=endpoints.openai_base_url, api_key="-", max_retries=0,
                              timeout=timeout_s, http_client=http)
    session = None
    if strategy.client == "kvtether":
        session = AsyncSession(base_url=endpoints.router_url, conversation_id=cid)
        client = session.wrap(client)
    messages: list[dict[str, str]] = [{"role": "system", "content": scenario.system_prompt}]
    built: list[int] | None = None
    sent: dict[int, float] = {}  # turn -> when the client sent it (unix seconds)
    try:
        for index, turn in enumerate(s.turns, start=1):
            messages.extend(m.model_dump() for m in turn.append)
            started = time.monotonic() - t0
            try:
                async with gate.turn(s.id, index) if gate is not None else nullcontext():
                    started = time.monotonic() - t0  # once the gate let it go
                    out, headers = await _call(client, endpoints, strategy, cid, messages,
                                               turn.max_tokens, s.stream)
            except Exception as exc:  # a failed turn is a result, not a crash of the bench
                results.append(TurnResult(
                    session=s.id, turn=index, stream=s.stream, started_s=round(started, 3),
                    error=f"{type(exc).__name__}: {exc}"[:300]))
                advance(len(s.turns) - index + 1)
                return len(s.turns) - index
            sent[index] = out["sent_unix_s"]
            usage = out["usage"]
            cached = None
            if usage is not None and getattr(usage, "prompt_tokens_details", None) is not None:
                cached = usage.prompt_tokens_details.cached_tokens
            reused_header = headers.get(p.HEADER_REUSED_TOKENS)
            reused = int(reused_header) if reused_header is not None else (cached or 0)
            prompt_ids = out["prompt_ids"] or []
            result = TurnResult(
                session=s.id, turn=index, stream=s.stream, started_s=round(started, 3),
                ttft_s=None if out["ttft_s"] is None else round(out["ttft_s"], 4),
                latency_s=round(out["latency_s"], 4),
                tpot_s=None if out["tpot_s"] is None else round(out["tpot_s"], 5),
                itl_s=None if out["itl_s"] is None else [round(g, 5) for g in out["itl_s"]],
                prompt_tokens=len(prompt_ids) or (usage.prompt_tokens if usage else 0),
                output_tokens=len(out["output_ids"]),
                reused_tokens=min(reused, len(prompt_ids) or reused),
                router_outcome=headers.get(p.HEADER_REUSE),
                output_digest=_ids_digest(out["output_ids"]),
                gap_kind=turn.gap_kind, gap_s=turn.gap_s,
            )
            classify(result, built, prompt_ids, block_size=endpoints.block_size,
                     threshold=endpoints.recompute_threshold)
            results.append(result)
            advance(1)
            built = prompt_ids + out["output_ids"]
            messages.append({"role": "assistant", "content": out["text"]})
            gap = turn.gap_s / compress
            if turn.gap_kind == "tool" and session is not None:
                async with session.tool_call(turn.tool or "tool"):
                    await asyncio.sleep(gap)
            elif gap > 0:
                await asyncio.sleep(gap)
        return 0
    finally:
        if gate is not None:
            gate.ended(s.id)
        if endpoints.router_url is not None:
            await _attach_timings(http, endpoints.router_url, cid, s.id, results, sent)
        if session is not None:
            await session.aclose()
        await http.aclose()


async def _attach_timings(http: httpx.AsyncClient, router_url: str, cid: str, session_id: str,
                          results: list[TurnResult], sent: dict[int, float]) -> None:
    """Each turn's :class:`~kvtether.protocol.TurnTimings`, from the router's records, plus
    the two stages only the client sees (streamed turns; router and client on one host, one
    clock): ``client_to_router``, from the client sending the request until the router had
    read it, and ``router_to_client``, from the router relaying the first token until the
    client had parsed it."""
    try:
        r = await http.get(f"{router_url}/v1/sessions/{cid}")
        status = p.SessionStatus.model_validate(r.json()) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as exc:
        logger.warning("turn timings of %s not read: %r", cid, exc)
        return
    if status is None:
        return
    records = {t.turn: t for t in status.turns}
    for result in results:
        record = records.get(result.turn)
        if result.session != session_id or result.error is not None or record is None:
            continue
        result.timings = record.timings.stages()
        sent_unix_s = sent.get(result.turn)
        if sent_unix_s is None or result.ttft_s is None or record.ttft_s is None:
            continue
        result.timings["client_to_router"] = round(record.started_unix_s - sent_unix_s, 4)
        result.timings["router_to_client"] = round(
            sent_unix_s + result.ttft_s - record.started_unix_s - record.ttft_s, 4)


async def _on_arrival(sessions: list[ScenarioSession],
                      run_session: Callable[[ScenarioSession], Awaitable[int]], t0: float,
                      compress: float) -> list[int]:
    """Each session at its (compressed) arrival time, all of them concurrently."""

    async def arrive(s: ScenarioSession) -> int:
        await asyncio.sleep(max(0.0, t0 + s.start_s / compress - time.monotonic()))
        return await run_session(s)

    return list(await asyncio.gather(*(arrive(s) for s in sessions)))


async def _in_slots(sessions: list[ScenarioSession],
                    run_session: Callable[[ScenarioSession], Awaitable[int]],
                    slots: int) -> list[int]:
    """The sessions in order, at most ``slots`` at once: a slot takes the next session as soon
    as its previous one has ended (one shared iterator, so no session runs twice)."""
    pending = iter(sessions)
    not_run: list[int] = []

    async def slot() -> None:
        for s in pending:
            not_run.append(await run_session(s))

    await asyncio.gather(*(slot() for _ in range(min(slots, len(sessions)))))
    return not_run


async def replay(
    scenario: Scenario,
    endpoints: Endpoints,
    strategy: Strategy,
    *,
    compress: float,
    run_id: str,
    sample_every_s: float = 0.5,
    drain_cap_s: float = 60.0,
    timeout_s: float = 900.0,
    advance: Callable[[int], None] = lambda n: None,
    concurrency: int | None = None,
    gate: TurnGate | None = None,
    nixl_urls: Mapping[str, Sequence[str]] | None = None,
) -> ReplayResult:
    """Run every session of ``scenario`` against ``endpoints``; see the module docstring.

    ``concurrency``: None starts each session at its arrival time; N runs the sessions in
    scenario order, at most N at once. ``run_id`` goes into every conversation id, so two
    replays with different ids never share a conversation's KV. ``gate``: see
    :class:`TurnGate`. ``nixl_urls``: role -> instances whose NIXL reads are counted
    (default for a P/D strategy: decode's reads of prefill's KV, and prefill's reads of decode's
    on reuse).
    """
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, not {concurrency}")
    if nixl_urls is None:
        nixl_urls = ({} if strategy.colocated else
                     {"decode": endpoints.kv_urls, "prefill": endpoints.prefill_urls})
    out = ReplayResult()
    async with httpx.AsyncClient(trust_env=False, timeout=30.0) as probe:
        for url in endpoints.kv_urls:
            out.kv_capacity_tokens[url] = await _kv_capacity(probe, url)
        if endpoints.kv_urls:
            out.kv_bytes_per_token = await _kv_bytes_per_token(probe, endpoints.kv_urls[0])
        nixl_before = {role: await nixl_totals(probe, list(urls))
                       for role, urls in nixl_urls.items() if urls}
        sampler = _Sampler(endpoints.kv_urls, out.kv_capacity_tokens, sample_every_s)
        baseline = await sampler.sample(probe)
        stop = asyncio.Event()
        sampling = asyncio.create_task(sampler.run(probe, stop))
        t0 = sampler.t0

        def run_session(s: ScenarioSession) -> Awaitable[int]:
            return _session(s, scenario, endpoints, strategy, compress, run_id, t0, out.turns,
                            advance, timeout_s, gate)

        try:
            if concurrency is None:
                not_run = await _on_arrival(scenario.sessions, run_session, t0, compress)
            else:
                not_run = await _in_slots(scenario.sessions, run_session, concurrency)
            out.not_run = sum(not_run)
            out.wall_s = time.monotonic() - t0
            out.core_s = round(await asyncio.to_thread(sampler.cpu.poll), 2)
            # Held KV after the last turn counts too (a fixed TTL's tail): wait until it is
            # gone, or the cap.
            drain_start = time.monotonic()
            while time.monotonic() - drain_start < drain_cap_s:
                await asyncio.sleep(sample_every_s)
                if sampler.samples and sampler.samples[-1].tokens <= baseline:
                    break
            out.drain_s = time.monotonic() - drain_start
            out.drain_core_s = round(await asyncio.to_thread(sampler.cpu.poll) - out.core_s, 2)
        finally:
            stop.set()
            await sampling
        out.kv = sampler.samples
        for role, before in nixl_before.items():
            after: NixlTotals = await nixl_totals(probe, list(nixl_urls[role]))
            out.nixl[role] = after.since(before).summary()
    out.turns.sort(key=lambda t: (t.session, t.turn))
    return out
