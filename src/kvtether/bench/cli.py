"""`kvtether bench`: benchmarks that start real stacks.

* ``kvtether bench [options]`` (or ``kvtether bench compare``) — replay agent sessions against
  every strategy side by side (:mod:`kvtether.bench.compare`).
* ``kvtether bench generate --out FILE`` — write a seeded scenario file.
* ``kvtether bench crossover`` — context length x concurrency: where P/D + kvtether beats a
  colocated vLLM on this host (:mod:`kvtether.bench.crossover`).
* ``kvtether bench traces PATH... [--predict] [--out FILE]`` — recorded coding-agent traces:
  the client's growth prediction scored on them, or a scaled scenario made from them
  (:mod:`kvtether.bench.traces`).
* ``kvtether bench idle`` — idle CPU, turn times and NIXL read times, stock vs kvtether
  (:mod:`kvtether.bench.idle`).
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["idle"]:
        from kvtether.bench.idle import main as idle_main

        return idle_main(args[1:])
    if args[:1] == ["crossover"]:
        from kvtether.bench.crossover import main as crossover_main

        return crossover_main(args[1:])
    if args[:1] == ["traces"]:
        from kvtether.bench.traces import main as traces_main

        return traces_main(args[1:])
    if args[:1] == ["generate"]:
        from kvtether.bench.compare import generate_main

        return generate_main(args[1:])
    from kvtether.bench.compare import main as compare_main

    return compare_main(args[1:] if args[:1] == ["compare"] else args)
