"""What an idle P/D stack costs, stock vs kvtether: `kvtether bench idle`, as a script.

    .venv/bin/python -m benchmarks.bench_idle [--profile cpu-tiny] [--json out.json]

Starts the stack twice (vLLM's upstream NixlConnector with its defaults, then kvtether's
defaults) and prints, for each: CPU of the whole stack over 60 s idle with one retained lease,
turn time p50/p90/p99 of a 20-turn conversation with 0-5 s gaps, NIXL read time p50/p99 from
vLLM's own metrics, and reuse fired / eligible turns. See kvtether.bench.idle.
"""

import sys

from kvtether.bench.idle import main

if __name__ == "__main__":
    sys.exit(main())
