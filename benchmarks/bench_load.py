"""200 agent conversations at once through the router (fake vLLM P/D), heartbeats every second.

Prints turn latency, the router's overhead per turn (latency minus the fakes' own time for the
turn's prefill and decode legs) and heartbeat latency, p50 and p99.

    python -m benchmarks.bench_load [--conversations 200] [--turns 4] [--fakes-in-process]

(from the repository root: it drives tests.support.load)
"""

from __future__ import annotations

import argparse
import asyncio

from tests.support.load import run_load

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--conversations", type=int, default=200)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--fakes-in-process", action="store_true",
                        help="run the fakes on the router's event loop (default: own process)")
    args = parser.parse_args()
    result = asyncio.run(run_load(args.conversations, args.turns,
                                  fakes_in_process=args.fakes_in_process))
    print(result.summary())
