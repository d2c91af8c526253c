"""The beater: a detached process that heartbeats one conversation while one tool runs.

A hook must return at once (the harness waits for it, or runs it in the background and may
kill it), so the tool-start hook leaves the heartbeats to this process. It stops, whichever
comes first, when the tool's marker says the tool ended or the conversation was forgotten
(:mod:`._state`), when the router answers no for good (404, 410, ...), when the harness's
process is gone (``--watch-pid``), or after ``max_lease_s``. Its first heartbeat waits
``first_beat_after_s``: most tool calls (reads, edits) end sooner and need none.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvtether.harness._router import RouterClient
from kvtether.harness._settings import HookSettings
from kvtether.harness._state import ToolMarker

__all__ = ["beat", "main", "spawn"]


def spawn(settings: HookSettings, conversation_id: str, marker: ToolMarker,
          tool_name: str | None = None, watch_pid: int | None = None) -> subprocess.Popen[bytes]:
    """Start a beater for the tool call behind ``marker``, detached from the hook: its own
    session (the harness's signals to the hook's group do not reach it), no inherited stdio
    (a harness that reads the hook's output to its end does not wait for it)."""
    cmd = [sys.executable, "-m", "kvtether.harness", "beat", conversation_id, str(marker.run)]
    if tool_name:
        cmd += ["--tool", tool_name]
    if watch_pid:
        cmd += ["--watch-pid", str(watch_pid)]
    return subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, **settings.beater_env()}, cwd=os.path.abspath(os.sep),
        start_new_session=True, close_fds=True,
    )


def alive(pid: int | None) -> bool:
    if not pid:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def beat(settings: HookSettings, conversation_id: str, marker: ToolMarker, *,
         tool_name: str | None = None, watch_pid: int | None = None,
         client: RouterClient | None = None, clock: Callable[[], float] = time.monotonic,
         sleep: Callable[[float], None] = time.sleep) -> int:
    """Heartbeat until the tool ends (or another reason to stop, above); the heartbeats the
    router accepted."""
    client = client or RouterClient(settings)
    start = clock()
    next_beat = start + settings.first_beat_after_s
    accepted = 0
    try:
        while marker.running() and clock() - start < settings.max_lease_s and alive(watch_pid):
            if clock() >= next_beat:
                reply = client.heartbeat(conversation_id, tool_name)
                if reply.final:
                    break
                interval = settings.max_beat_interval_s
                remaining = reply.body.get("lease_remaining_s")
                if reply.ok:
                    accepted += 1
                    if isinstance(remaining, (int, float)) and remaining > 0:
                        interval = min(interval, remaining / 3)  # two more tries before it lapses
                next_beat = clock() + max(interval, settings.poll_s)
            sleep(settings.poll_s)
    finally:
        marker.clear()
    return accepted


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtether.harness beat")
    parser.add_argument("conversation_id")
    parser.add_argument("marker", type=Path, help="the tool call's .run marker")
    parser.add_argument("--tool", default=None)
    parser.add_argument("--watch-pid", type=int, default=None)
    args = parser.parse_args(argv)
    beat(HookSettings.from_env(), args.conversation_id, ToolMarker(args.marker),
         tool_name=args.tool, watch_pid=args.watch_pid)
    return 0
