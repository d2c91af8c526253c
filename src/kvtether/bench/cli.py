"""`kvtether bench`: benchmarks that start real stacks.

* ``kvtether bench idle`` — idle CPU, turn times and NIXL read times, stock vs kvtether
  (:mod:`kvtether.bench.idle`).
"""

from __future__ import annotations

import sys

__all__ = ["main"]

_USAGE = """usage: kvtether bench idle [options]   (see `kvtether bench idle --help`)

  idle   start the stack stock and with kvtether's defaults; measure idle CPU with a
         retained lease, turn times, NIXL read times and reuse
"""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["idle"]:
        from kvtether.bench.idle import main as idle_main

        return idle_main(args[1:])
    if args[:1] in (["-h"], ["--help"]):
        print(_USAGE)
        return 0
    print(_USAGE, file=sys.stderr)
    if args:
        print(f"error: unknown benchmark {args[0]!r}", file=sys.stderr)
    else:
        print("error: the strategy comparison (`kvtether bench` replaying agent sessions) is "
              "not available yet; `kvtether bench idle` is", file=sys.stderr)
    return 2
