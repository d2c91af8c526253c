"""One conversation at a time on colocated and on kvtether, interleaved session by session.

`kvtether bench --concurrency 1` replays the whole scenario on colocated, then on kvtether: the
two halves run minutes apart, and on a shared host the same turn's compute time moved by 20%
within minutes, which swamps a +50 ms target. Here both deployments are up at once (colocated
on its own port, one instance; kvtether 1P+1D; an idle stack uses ~0.07 cores) and each
scenario session runs on both, turn by turn (``--interleave turn``, the default): turn k on one
deployment, straight away turn k on the other, then turn k+1, one model call at a time, the
order alternating from session to session, so each turn's two TTFTs are taken a second or two
apart. ``--interleave session`` (the first version) ran the whole session on one deployment,
then on the other: each pair tens of seconds apart.

For every fired streamed turn of kvtether it prints the TTFT beside colocated's for the same
turn, the difference and whether it is within ``--margin-ms``; outputs are compared with
colocated's as in the bench. Not part of ``make test``.

Even seconds apart, the same engine's compute of the same turn moves by tens of milliseconds
on a shared host. ``--repeat N`` runs the whole scenario N times (each repeat under a system
prompt of its own, so that no repeat reads another's prefix cache, and with the session order
flipped from one repeat to the next); a turn's figures are then the medians of its N pairs.

Both deployments compute on the same core, and stock vLLM's worker spins there for 1 s after
each step (see ``benchmarks.engine_pairs.SETTLE_S``), so each turn starts ``--settle-s`` after
the turn before it ended, outside its TTFT.

Each row says how the router served the kvtether turn (``path``: see :func:`path`). Between
two of its turns a kvtether replay here waits for colocated's turn and two settles, several
seconds, while ``--compress`` shortens the leases to the bench's floor (12-14 s at 64x): a turn
that comes after its lease ended goes decode's prefix-cache way (``lapsed``), as a conversation
does after a person's pause of a minute at 1x.

    python -m kvtether bench generate --sessions 16 --turns 4 6 --long-tools 0 \\
        --out /tmp/scenario.json
    python -m benchmarks.lone_pairs --scenario /tmp/scenario.json --repeat 3 --json /tmp/lone.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from benchmarks.engine_pairs import SETTLE_S
from kvtether.bench.compare import replay_scenario
from kvtether.bench.metrics import TurnResult, mark_divergence
from kvtether.bench.replay import ReplayResult, TurnGate
from kvtether.bench.scenario import Scenario, load_scenario
from kvtether.bench.strategies import STRATEGIES, StrategyOptions, start_strategy


class Lockstep:
    """Replays of one session on several deployments, turn by turn: turn k on ``order[0]``,
    then on ``order[1]`` ..., then turn k+1, one model call at a time. A replay that ends early
    (a failed turn) is skipped from then on, so the others never wait for it. Each turn starts
    ``settle_s`` after the turn before it ended (see the module's docstring)."""

    def __init__(self, order: Sequence[str], settle_s: float = 0.0) -> None:
        self.order = list(order)
        self.settle_s = settle_s
        self._last_end = -float("inf")
        self._turn, self._pos = 1, 0
        self._ended: set[str] = set()
        self._changed = asyncio.Event()

    def of(self, name: str) -> _LockstepGate:
        """The :class:`~kvtether.bench.replay.TurnGate` for ``name``'s replay."""
        return _LockstepGate(self, name)

    async def _enter(self, name: str, index: int) -> None:
        while not (self._turn == index and self.order[self._pos] == name):
            changed = self._changed
            await changed.wait()
        wait_s = self._last_end + self.settle_s - time.monotonic()
        if wait_s > 0:
            await asyncio.sleep(wait_s)

    def _next(self) -> None:
        self._last_end = time.monotonic()
        for _ in self.order:  # the next slot of a replay that has not ended
            self._pos += 1
            if self._pos == len(self.order):
                self._turn, self._pos = self._turn + 1, 0
            if self.order[self._pos] not in self._ended:
                break
        self._changed.set()
        self._changed = asyncio.Event()

    def _end(self, name: str) -> None:
        self._ended.add(name)
        if self.order[self._pos] == name:
            self._next()


class _LockstepGate:
    def __init__(self, lockstep: Lockstep, name: str) -> None:
        self._lockstep, self._name = lockstep, name

    @asynccontextmanager
    async def turn(self, session: str, index: int) -> AsyncIterator[None]:
        await self._lockstep._enter(self._name, index)
        try:
            yield
        finally:
            self._lockstep._next()

    def ended(self, session: str) -> None:
        self._lockstep._end(self._name)


def path(t: TurnResult) -> str:
    """How the router served a kvtether turn, from its record's stages: ``prefill`` (a prefill
    leg read decode's KV), ``decode`` (decode computed the new tokens on the KV its lease
    held), ``lapsed`` (the lease had ended, or was too close to its end to renew: decode
    computed the turn on what its prefix cache still held) or ``?`` (no record)."""
    stages = t.timings or {}
    if stages.get("prefill_leg") is not None:
        return "prefill"
    if stages.get("plan_prefix_cache") is not None:
        return "lapsed"
    return "decode" if stages else "?"


def pair(colocated: list[TurnResult], kvtether: list[TurnResult],
         margin_s: float) -> list[dict[str, Any]]:
    """Each fired streamed kvtether turn beside colocated's same turn, by new tokens."""
    ref = {(t.session, t.turn): t for t in colocated if t.ttft_s is not None}
    rows = []
    for t in kvtether:
        c = ref.get((t.session, t.turn))
        if not (t.stream and t.fired and t.ttft_s is not None and c is not None):
            continue
        assert c.ttft_s is not None
        diff = t.ttft_s - c.ttft_s
        rows.append({"session": t.session, "turn": t.turn,
                     "new_tokens": t.recomputed_tokens,
                     "colocated_ttft_s": round(c.ttft_s, 4), "kvtether_ttft_s": round(t.ttft_s, 4),
                     "diff_s": round(diff, 4), "within": diff <= margin_s, "path": path(t)})
    return sorted(rows, key=lambda r: r["new_tokens"])


def medians(rows: list[dict[str, Any]], margin_s: float) -> list[dict[str, Any]]:
    """One row per (session, turn) from the rows of several repeats: the medians of its
    colocated and kvtether TTFTs and of its differences (``pairs``: how many repeats had it)."""
    by_turn: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        by_turn.setdefault((r["session"], r["turn"]), []).append(r)
    out = []
    for (session, turn), rs in by_turn.items():
        mid = {f: statistics.median(r[f] for r in rs)
               for f in ("new_tokens", "colocated_ttft_s", "kvtether_ttft_s", "diff_s")}
        out.append({"session": session, "turn": turn, "new_tokens": round(mid["new_tokens"]),
                    "colocated_ttft_s": round(mid["colocated_ttft_s"], 4),
                    "kvtether_ttft_s": round(mid["kvtether_ttft_s"], 4),
                    "diff_s": round(mid["diff_s"], 4), "within": mid["diff_s"] <= margin_s,
                    "pairs": len(rs), "path": "/".join(sorted(r["path"] for r in rs))})
    return sorted(out, key=lambda r: r["new_tokens"])


def by_path(rows: list[dict[str, Any]]) -> str:
    """How many of ``rows`` are within the margin, for each way the router served them."""
    total = Counter(r["path"] for r in rows)
    within = Counter(r["path"] for r in rows if r["within"])
    return ", ".join(f"{name} {within[name]} of {total[name]}" for name in sorted(total))


def summary(rows: list[dict[str, Any]], margin_s: float) -> str:
    if not rows:
        return "no fired streamed turn to compare"
    diffs = [r["diff_s"] for r in rows]
    median = statistics.median(diffs)
    return (f"{sum(r['within'] for r in rows)} of {len(rows)} fired streamed turns within "
            f"+{margin_s * 1000:.0f} ms of colocated; difference median {median:+.3f} s, "
            f"largest {max(diffs):+.3f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", type=Path, required=True)
    parser.add_argument("--profile", default="cpu-bench")
    parser.add_argument("--port", type=int, default=8800,
                        help="kvtether's router; colocated listens at port + 150")
    parser.add_argument("--state-dir", type=Path, default=Path(".kvtether/lone-pairs"))
    parser.add_argument("--prefill-cache", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--compress", type=float, default=16.0)
    parser.add_argument("--turn-timeout-s", type=float, default=600.0)
    parser.add_argument("--margin-ms", type=float, default=50.0)
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the scenario N times; a turn's figures are its N medians")
    parser.add_argument("--interleave", choices=("turn", "session"), default="turn",
                        help="turn: each turn on both deployments before the next (default); "
                             "session: the whole session on one, then on the other")
    parser.add_argument("--settle-s", type=float, default=SETTLE_S,
                        help="with --interleave turn: each turn starts this long after the turn "
                             "before it ended, once the other deployment's spin is over")
    parser.add_argument("--json", type=Path, help="write every turn and the pairs here")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be 1 or more, got {args.repeat}")
    scenario = load_scenario(args.scenario)
    margin_s = args.margin_ms / 1000

    def options(port: int) -> StrategyOptions:
        return StrategyOptions(profile=args.profile, compress=args.compress, port=port,
                               state_dir=args.state_dir, prefill_prefix_caching=args.prefill_cache)

    run_id = uuid.uuid4().hex[:8]
    repeats: list[dict[str, list[TurnResult]]] = []
    with start_strategy(STRATEGIES["colocated"], options(args.port + 50)) as colocated, \
            start_strategy(STRATEGIES["kvtether"], options(args.port)) as kvtether:
        endpoints = {"colocated": colocated, "kvtether": kvtether}
        for rep in range(args.repeat):
            turns: dict[str, list[TurnResult]] = {"colocated": [], "kvtether": []}
            this = repeated(scenario, rep)
            for i, session in enumerate(this.sessions):
                one = this.model_copy(update={"sessions": [session]})
                order = ["colocated", "kvtether"][::1 if (i + rep) % 2 == 0 else -1]
                replayed = asyncio.run(both(one, order, endpoints, args, f"{run_id}-r{rep}"))
                for name in order:
                    turns[name] += replayed[name].turns
                print(f"repeat {rep + 1}/{args.repeat} {session.id}: {len(session.turns)} turns, "
                      f"{' then '.join(order)}", flush=True)
            # Outputs are compared within a repeat: each repeat's prompts are its own.
            mark_divergence(turns["colocated"], turns["kvtether"])
            repeats.append(turns)
    per_repeat = [pair(t["colocated"], t["kvtether"], margin_s) for t in repeats]
    flat = [dict(r, repeat=rep) for rep, rows in enumerate(per_repeat) for r in rows]
    rows = medians(flat, margin_s) if args.repeat > 1 else flat
    print(f"{'session':8} {'turn':>4} {'new tok':>7} {'colocated':>9} {'kvtether':>9} {'diff':>7}"
          "  path")
    for r in rows:
        print(f"{r['session']:8} {r['turn']:>4} {r['new_tokens']:>7} {r['colocated_ttft_s']:>9.3f} "
              f"{r['kvtether_ttft_s']:>9.3f} {r['diff_s']:>+7.3f}  {r['path']}"
              f"{'' if r['within'] else '  over'}")
    print(f"within +{args.margin_ms:.0f} ms by path, every pair: {by_path(flat)}")
    if args.repeat > 1:
        for rep, pr in enumerate(per_repeat):
            print(f"repeat {rep + 1} alone: {summary(pr, margin_s)}")
        print(f"medians of {args.repeat} repeats: ", end="")
    said = summary(rows, margin_s)
    every = [t for by_name in repeats for ts in by_name.values() for t in ts]
    diverged = sum(1 for t in every if t.diverged)
    failed = sum(1 for t in every if t.error is not None)
    print(f"{said}; {diverged} divergent, {failed} failed turns")
    if args.json:
        args.json.write_text(json.dumps({
            "scenario": str(args.scenario), "profile": args.profile, "margin_s": margin_s,
            "repeat": args.repeat, "interleave": args.interleave, "settle_s": args.settle_s,
            "summary": said, "pairs": rows,
            "pairs_per_repeat": flat,
            "turns": [{name: [t.as_dict() for t in ts] for name, ts in by_name.items()}
                      for by_name in repeats],
        }, indent=1))
    return 0 if not failed and not diverged else 1


async def both(one: Scenario, order: list[str], endpoints: dict[str, Any],
               args: argparse.Namespace, run_id: str) -> dict[str, ReplayResult]:
    """``one`` (a single session) on each deployment in ``order``: with ``--interleave turn``
    both replays at once, in :class:`Lockstep`; with ``session`` one after the other."""

    async def replay(name: str, gate: TurnGate | None = None) -> ReplayResult:
        return await replay_scenario(one, endpoints[name], STRATEGIES[name], args, run_id,
                                     lambda n: None, concurrency=1, gate=gate)

    if args.interleave == "session":
        return {name: await replay(name) for name in order}
    lockstep = Lockstep(order, args.settle_s)
    done = await asyncio.gather(*(replay(name, lockstep.of(name)) for name in order))
    return dict(zip(order, done, strict=True))


def repeated(scenario: Scenario, rep: int) -> Scenario:
    """Repeat ``rep``'s scenario: from the second on, under a system prompt of its own (see
    :meth:`Scenario.under_own_prompt`)."""
    return scenario.under_own_prompt(f"Repeat {rep + 1}") if rep else scenario


if __name__ == "__main__":
    sys.exit(main())
