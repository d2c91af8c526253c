"""What ``python -m kvtether.harness`` runs."""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]

USAGE = "usage: python -m kvtether.harness {claude-code | beat CONVERSATION MARKER [...]}"


def main(argv: Sequence[str]) -> int:
    command, rest = (argv[0], list(argv[1:])) if argv else ("", [])
    if command == "claude-code":
        from kvtether.harness.claude_code import main as hook

        return hook()
    if command == "beat":
        from kvtether.harness._beater import main as beat

        return beat(rest)
    # Not 2: Claude Code reads exit code 2 from a PreToolUse hook as "block this tool call".
    print(USAGE, file=sys.stderr)
    return 1
