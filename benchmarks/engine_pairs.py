"""One turn's TTFT three ways, seconds apart: colocated vLLM, kvtether's decode engine asked
directly, and kvtether through its router.

`benchmarks.lone_pairs` compares whole turns, colocated against kvtether. This splits
kvtether's side in two. Each round is one conversation per way, under a system prompt of its
own (so that no way reads another's prefix cache): a first turn of ``--prefix-words`` words,
then one turn per ``--new-words`` value, each adding a user message of that many words (and
the previous answer), streamed, as an agent's turns do. Every addition is sent on the three ways
one after another (each ``--settle-s`` after the turn before it ended, see :data:`SETTLE_S`),
the order rotating with the round (:func:`order`), and each TTFT is taken to the first content
chunk, as the bench does.

- ``colocated``: the colocated vLLM (prefix cache on), the bench's baseline;
- ``decode``: a plain chat request straight to kvtether's decode vLLM, no router, no
  ``kv_transfer_params``: the same engine computes the turn on its own prefix cache, so what
  differs from colocated is only how the engine is configured (kvtether's connector, scheduler
  and worker classes, NIXL's memory registration and threads);
- ``kvtether``: through the router with a conversation id: the real path (tokenize, plan,
  decode's leased KV, the relay).

Each turn also records what the engine that computed it measured, from its ``/metrics``
before and after (turns run one at a time, so the deltas are that turn's): vLLM's own TTFT
(from when its input processor took the request), its queue time, its prefill time (scheduled
to first token: the compute) and how many engine steps ran. The client's TTFT less vLLM's is
what happened outside the engine (HTTP, chat template and tokenizing, the router, streaming).

    python -m benchmarks.engine_pairs --rounds 9 --json /tmp/engine.json

Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from kvtether import protocol as p
from kvtether.bench._measure import metric_families
from kvtether.bench.strategies import STRATEGIES, StrategyOptions, start_strategy

WAYS = ("colocated", "decode", "kvtether")
# The differences each addition records, (a, b) as "a_minus_b".
DIFFS = (("decode", "colocated"), ("kvtether", "decode"), ("kvtether", "colocated"))
_WORDS = ("river stone garden window engine paper orange silver market winter planet "
          "signal copper forest bridge candle harbor lantern meadow pocket thunder velvet "
          "anchor basket cobalt desert ember falcon glacier hollow island jasper").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def chat(client: httpx.Client, url: str, model: str, messages: list[dict[str, str]],
         max_tokens: int, headers: dict[str, str]) -> tuple[float, str]:
    """(TTFT to the first content chunk, the answer) of one streamed turn."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "return_token_ids": True}
    start = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    with client.stream("POST", f"{url}/chat/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if first is None and (content or choice.get("token_ids")):
                    first = time.perf_counter() - start
                parts.append(content or "")
    assert first is not None, "no token streamed"
    return first, "".join(parts)


# Stock vLLM's worker spins (sched_yield) for 1 s after every step it ran
# (SpinCondition.busy_loop_s), pinned to its core. The colocated baseline computes on decode's
# core, so a turn sent on kvtether straight after one on colocated shares that core with the
# spin for up to a second (and not the other way round: kvtether's instances spin 20 ms,
# `rpc_busy_loop_s`). Each turn waits this long first, as an agent's turn waits for its tool.
SETTLE_S = 1.5

# What the engine measured per turn: the deltas of these series around it.
ENGINE_SERIES = {
    "vllm_ttft": "vllm:time_to_first_token_seconds_sum",
    "queue": "vllm:request_queue_time_seconds_sum",
    "prefill": "vllm:request_prefill_time_seconds_sum",
    "steps": "vllm:iteration_tokens_total_count",
}


def order(rnd: int, addition: int) -> tuple[str, ...]:
    """The ways in the order they compute addition ``addition`` of round ``rnd``: rotated by
    the round, so that over any three rounds each way goes first, second and third on every
    addition, however many additions a round has."""
    k = (rnd + addition) % len(WAYS)
    return WAYS[k:] + WAYS[:k]


def engine_clock(client: httpx.Client, base_url: str) -> dict[str, float]:
    """The running totals of :data:`ENGINE_SERIES` on one vLLM (``base_url`` without /v1),
    summed over labels."""
    totals = dict.fromkeys(ENGINE_SERIES, 0.0)
    wanted = {series: key for key, series in ENGINE_SERIES.items()}
    families = {series.rpartition("_")[0] for series in wanted}  # x_sum, x_count: family x
    for family in metric_families(client.get(f"{base_url}/metrics").text, *families):
        for sample in family.samples:
            key = wanted.get(sample.name)
            if key is not None:
                totals[key] += sample.value
    return totals


def engine_table(rows: list[dict[str, Any]]) -> list[str]:
    """Per way and addition size, medians of the client's TTFT and of what the engine that
    computed the turn measured (``outside``: client TTFT less vLLM's)."""
    keys = ("ttft", "vllm_ttft", "outside", "queue", "prefill", "steps")
    out = [f"{'new words':>9} {'way':>9} " + " ".join(f"{k:>9}" for k in keys)
           + "  (medians, s; steps: count)"]
    for n in sorted({r["new_words"] for r in rows}):
        for w in WAYS:
            es = [r["engine"][w] for r in rows if r["new_words"] == n and w in r["engine"]]
            if not es:
                continue
            cells = [f"{statistics.median(e[k] for e in es):>9.3f}" for k in keys]
            out.append(f"{n:>9} {w:>9} " + " ".join(cells))
    return out


def after_table(rows: list[dict[str, Any]]) -> list[str]:
    """Per addition size, decode's and kvtether's TTFT less colocated's, split by whether the
    turn ran right after colocated's (see :data:`SETTLE_S`): medians, with how many turns."""
    out = ["new words      way  right after colocated  not after colocated  (median s, turns)"]
    for n in sorted({r["new_words"] for r in rows}):
        for w in WAYS[1:]:
            cells = []
            for after in (True, False):
                ds = [r[w] - r["colocated"] for r in rows if r["new_words"] == n
                      and (r["engine"][w].get("after") == "colocated") == after]
                cells.append(f"{statistics.median(ds):+.3f} ({len(ds)})" if ds else "-")
            out.append(f"{n:>9} {w:>8} {cells[0]:>22} {cells[1]:>20}")
    return out


def table(rows: list[dict[str, Any]]) -> list[str]:
    """Per addition size, then over all, the medians of each way's TTFT and of each of
    :data:`DIFFS`."""
    out = [f"{'new words':>9} {'colocated':>9} {'decode':>8} {'kvtether':>8} "
           f"{'decode-col':>10} {'kvt-decode':>10} {'kvt-col':>8}  (medians, s)"]
    widths = [9, 8, 8] + [10, 10, 8]
    keys = list(WAYS) + [f"{a}_minus_{b}" for a, b in DIFFS]
    for n in sorted({r["new_words"] for r in rows}) + [None]:
        rs = [r for r in rows if n is None or r["new_words"] == n]
        cells = [f"{statistics.median(r[k] for r in rs):>{'+' if '_minus_' in k else ''}{w}.3f}"
                 for k, w in zip(keys, widths, strict=True)]
        out.append(f"{'all' if n is None else n:>9} " + " ".join(cells))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="cpu-bench")
    parser.add_argument("--port", type=int, default=8800,
                        help="kvtether's router; colocated listens at port + 150")
    parser.add_argument("--state-dir", type=Path, default=Path(".kvtether/engine-pairs"))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prefix-words", type=int, default=500)
    parser.add_argument("--new-words", type=int, nargs="+", default=[200, 80, 240, 50])
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--settle-s", type=float, default=SETTLE_S,
                        help="pause before each turn (see SETTLE_S)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be 1 or more, got {args.rounds}")

    def options(port: int) -> StrategyOptions:
        return StrategyOptions(profile=args.profile, compress=1.0, port=port,
                               state_dir=args.state_dir)

    rng = random.Random(7)
    run_id = uuid.uuid4().hex[:8]
    rows: list[dict[str, Any]] = []
    sessions: list[Any] = []
    with start_strategy(STRATEGIES["colocated"], options(args.port + 50)) as colocated, \
            start_strategy(STRATEGIES["kvtether"], options(args.port)) as kvtether, \
            httpx.Client(timeout=600) as client:
        urls = {"colocated": colocated.openai_base_url, "decode": f"{kvtether.kv_urls[0]}/v1",
                "kvtether": kvtether.openai_base_url}
        model = kvtether.served_model_name
        # The engine each way's turns are computed on (kvtether's: decode, which computes
        # additions up to local_prefill_max_tokens itself; of a turn through prefill, these
        # would be the decode leg's figures).
        engines = {"colocated": colocated.openai_base_url.removesuffix("/v1"),
                   "decode": kvtether.kv_urls[0], "kvtether": kvtether.kv_urls[0]}
        for rnd in range(args.rounds):
            first_user = words(rng, args.prefix_words)
            additions = [words(rng, n) for n in args.new_words]
            history = {w: [{"role": "system", "content": f"Round {rnd:04d}, way {w[0]}: "
                                                         "answer briefly."},
                           {"role": "user", "content": first_user}] for w in WAYS}
            headers = {w: {} for w in WAYS}
            headers["kvtether"] = {p.HEADER_CONVERSATION_ID: f"engine-pairs-{run_id}-{rnd}"}
            for w in WAYS:
                _, answer = chat(client, urls[w], model, history[w], args.max_tokens,
                                 headers[w])
                history[w].append({"role": "assistant", "content": answer})
            last = WAYS[-1]  # the way whose turn ran last (``after``)
            for i, (n, text) in enumerate(zip(args.new_words, additions, strict=True)):
                got, engine = {}, {}
                for w in order(rnd, i):
                    time.sleep(args.settle_s)
                    history[w].append({"role": "user", "content": text})
                    before = engine_clock(client, engines[w])
                    ttft, answer = chat(client, urls[w], model, history[w], args.max_tokens,
                                        headers[w])
                    after = engine_clock(client, engines[w])
                    history[w].append({"role": "assistant", "content": answer})
                    got[w] = ttft
                    engine[w] = {"ttft": round(ttft, 4), **{
                        key: round(after[key] - before[key], 4) for key in ENGINE_SERIES}}
                    engine[w]["outside"] = round(ttft - engine[w]["vllm_ttft"], 4)
                    engine[w]["after"], last = last, w
                row = {"round": rnd, "addition": i + 1, "new_words": n,
                       **{w: round(got[w], 4) for w in WAYS},
                       **{f"{a}_minus_{b}": round(got[a] - got[b], 4) for a, b in DIFFS},
                       "engine": engine}
                rows.append(row)
                print(f"round {rnd} +{n:>4} words: " + ", ".join(
                    f"{w} {got[w]:.3f}" for w in WAYS), flush=True)
            # What the router recorded: each turn's outcome and stage timings.
            cid = headers["kvtether"][p.HEADER_CONVERSATION_ID]
            sessions.append(client.get(f"{kvtether.router_url}/v1/sessions/{cid}").json())
    lines = table(rows) + [""] + engine_table(rows) + [""] + after_table(rows)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows, "table": lines, "sessions": sessions},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
