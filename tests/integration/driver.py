"""Concurrent agent conversations against a real stack, each turn checked against a reference.

Used by the load tests (``test_load_real``: 1P+1D; ``test_xpyd_real``: 2P+2D) and by
``python -m tests.integration.driver`` (figures for a closing note). Every conversation starts
at once (a barrier), runs its turns back to back with a heartbeat while its "tool" runs, and
releases its KV at the end. Each turn records what a user would look at: the reuse outcome,
the decode instance, the router replica (behind a front), its wall time, and whether its
tokens equal the colocated reference's.
"""

from __future__ import annotations

import concurrent.futures as cf
import statistics
import threading
import time
import uuid
from dataclasses import dataclass

import httpx

from kvtether import protocol as p

SYSTEM = "you are a helpful agent. use the tools. " * 6


@dataclass(frozen=True)
class TurnResult:
    conversation_id: str
    turn: int  # 1-based
    status: int
    outcome: str  # X-KVTether-Reuse
    reused_tokens: int
    seconds: float
    identical: bool  # token ids equal the reference's
    decode_instance: str
    router: str | None  # X-KVTether-Router (behind a front), else None
    error: str = ""


def run_conversations(
    base_url: str, reference_url: str, model: str, *, conversations: int, turns: int,
    prefix: str = "load", max_tokens: int = 8,
) -> list[TurnResult]:
    """``conversations`` at once, ``turns`` each; every turn's result (failed ones included)."""
    start = threading.Barrier(conversations)
    with cf.ThreadPoolExecutor(conversations) as pool:
        futures = [pool.submit(_conversation, base_url, reference_url, model, i, turns, prefix,
                               max_tokens, start) for i in range(conversations)]
        return [t for f in futures for t in f.result()]


def _conversation(
    base_url: str, reference_url: str, model: str, index: int, turns: int, prefix: str,
    max_tokens: int, start: threading.Barrier,
) -> list[TurnResult]:
    cid = f"{prefix}-{index}-{uuid.uuid4().hex[:6]}"
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"task {index}: run the tests and read file {index}"}]
    out: list[TurnResult] = []
    with httpx.Client(timeout=600, trust_env=False) as client:
        start.wait()
        for turn in range(1, turns + 1):
            body = {"model": model, "messages": msgs, "max_tokens": max_tokens,
                    "temperature": 0, "return_token_ids": True}
            want = client.post(f"{reference_url}/v1/chat/completions", json=body).json()
            t0 = time.perf_counter()
            r = client.post(f"{base_url}/v1/chat/completions", json=body,
                            headers={p.HEADER_CONVERSATION_ID: cid})
            seconds = time.perf_counter() - t0
            if r.status_code != 200:
                out.append(TurnResult(cid, turn, r.status_code, "", 0, seconds, False, "",
                                      r.headers.get(p.HEADER_ROUTER), r.text[:300]))
                break
            got = r.json()["choices"][0]
            out.append(TurnResult(
                cid, turn, 200, r.headers[p.HEADER_REUSE], int(r.headers[p.HEADER_REUSED_TOKENS]),
                seconds, got["token_ids"] == want["choices"][0]["token_ids"],
                r.headers[p.HEADER_DECODE_INSTANCE], r.headers.get(p.HEADER_ROUTER)))
            # The tool runs; the client heartbeats the lease meanwhile.
            hb = client.post(f"{base_url}/v1/sessions/{cid}/heartbeat",
                             json={"phase": "tool_running"})
            assert hb.status_code == 200, hb.text
            msgs = msgs + [{"role": "assistant", "content": got["message"]["content"]},
                           {"role": "tool", "content": f"result {index}.{turn} ok"}]
        client.delete(f"{base_url}/v1/sessions/{cid}")
    return out


def reused(result: TurnResult) -> bool:
    """A later turn reused KV: read from decode (``fired``), or already on prefill and too few
    new tokens to be worth a read (``miss:below_threshold``, reused locally)."""
    return result.outcome in ("fired", "miss:below_threshold") and result.reused_tokens > 0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(results: list[TurnResult]) -> str:
    """Lines for a closing note: spread over decode instances, reuse, turn times per index."""
    homes: dict[str, str] = {}
    for r in results:
        homes.setdefault(r.conversation_id, r.decode_instance)
    spread = {d: list(homes.values()).count(d) for d in sorted(set(homes.values()))}
    later = [r for r in results if r.turn > 1]
    lines = [
        f"{len(homes)} conversations, {len(results)} turns, "
        f"{sum(r.status == 200 for r in results)} answered, "
        f"{sum(r.identical for r in results)} token-identical to the reference",
        "new conversations per decode instance: "
        + ", ".join(f"{d} {n}" for d, n in spread.items()),
        f"later turns reusing KV: {sum(reused(r) for r in later)}/{len(later)} "
        f"({sum(r.outcome == 'fired' for r in later)} fired)",
    ]
    for turn in sorted({r.turn for r in results}):
        secs = [r.seconds for r in results if r.turn == turn]
        lines.append(f"turn {turn}: p50 {percentile(secs, 0.5):.2f} s, "
                     f"p90 {percentile(secs, 0.9):.2f} s, mean {statistics.mean(secs):.2f} s "
                     f"({len(secs)} turns)")
    routers = sorted({r.router for r in results if r.router})
    if routers:
        lines.append("router replicas: " + ", ".join(
            f"{name} {sum(r.router == name for r in results)}" for name in routers))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Drive a running stack (``ROUTER_URL REFERENCE_URL``) or, with ``--start``, a cpu-tiny
    stack of ``--prefill`` x ``--decode`` instances and a reference it starts and stops itself:

    ``python -m tests.integration.driver --start --prefill 2 --decode 2``
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.integration.driver")
    parser.add_argument("router_url", nargs="?")
    parser.add_argument("reference_url", nargs="?", help="a colocated vLLM (kvtether.stack."
                        "start_reference_vllm) that answers with the same model")
    parser.add_argument("--start", action="store_true",
                        help="start a cpu-tiny stack and a reference (ports from "
                        "KVTETHER_TEST_PORT_BASE, default 18000, + 500)")
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args(argv)
    if not args.start and not (args.router_url and args.reference_url):
        parser.error("give ROUTER_URL and REFERENCE_URL, or --start")

    def drive(router_url: str, reference_url: str, model: str) -> int:
        results = run_conversations(router_url, reference_url, model,
                                    conversations=args.conversations, turns=args.turns,
                                    prefix="bench")
        print(summary(results))
        return 0 if all(r.status == 200 and r.identical for r in results) else 1

    if not args.start:
        return drive(args.router_url, args.reference_url, args.model)
    return _with_stack(args.prefill, args.decode, drive)


def _with_stack(prefill: int, decode: int, drive) -> int:  # noqa: ANN001
    import tempfile

    from kvtether.stack import Stack, StackSettings, start_reference_vllm
    from tests.support.stacks import PORT_BASE

    base = PORT_BASE + 500
    with tempfile.TemporaryDirectory(prefix="kvtether-driver-") as tmp:
        settings = StackSettings(
            profile="cpu-tiny", prefill=prefill, decode=decode, port=base, base_port=base + 10,
            side_channel_base_port=base - 1700, control_base_port=base + 40, state_dir=tmp,
            health_timeout_s=900)
        t0 = time.perf_counter()
        with start_reference_vllm(settings, port=base + 1) as reference, \
                Stack(settings, die_with_parent=True) as stack:
            report = stack.warm_up_report
            print(f"{prefill}P+{decode}D and a reference healthy and warm after "
                  f"{time.perf_counter() - t0:.0f} s (warm-up: {report.outcomes if report else '-'})")
            return int(drive(stack.router_url, reference, stack.served_model_name))


if __name__ == "__main__":
    raise SystemExit(main())
