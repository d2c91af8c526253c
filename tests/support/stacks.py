"""Helpers of the real-vLLM tests (``tests/integration``): what a test knows of a running
stack, the port range of the suite, supervision of a stack as a foreground ``kvtether stack up``
does, the trouble its logs report, and more routers served in-process over a stack's vLLM
instances. The fixtures that start the stacks are in ``tests/integration/conftest.py``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .servers import serve_app

# Offset from the defaults so a `kvtether stack up` a developer left running does not collide.
# The shared stack uses PORT_BASE - 2000 .. PORT_BASE + 299; tests that start stacks of their
# own offset from here.
PORT_BASE = int(os.environ.get("KVTETHER_TEST_PORT_BASE", "18000"))


@dataclass(frozen=True)
class StackHandle:
    base_url: str  # a kvtether router
    model: str
    lease_ttl_s: float
    block_size_tokens: int
    prefill_urls: list[str]
    decode_urls: list[str]
    decode_control_urls: list[str]
    state_dir: Path
    control_secret: str | None = None  # the stack's; every control-channel call needs it

    @property
    def control_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.control_secret}"} if self.control_secret else {}


@dataclass(frozen=True)
class Reference:
    base_url: str


@contextlib.contextmanager
def supervised(stack: Any) -> Iterator[list[str]]:
    """Supervise ``stack`` as a foreground ``kvtether stack up`` does (a process that dies is
    restarted with back-off); yields what the supervisor says, as it says it."""
    said: list[str] = []
    stop = threading.Event()
    thread = threading.Thread(target=stack.supervise, daemon=True,
                              kwargs={"stop": stop, "say": said.append})
    thread.start()
    try:
        yield said
    finally:
        stop.set()
        thread.join(120)


# What an instance log says when something went wrong (vLLM's errors, an engine step that did
# not end, a process the supervisor restarted).
_TROUBLE = ("ERROR", "Traceback", "engine step", "No available shared memory",
            "RPC call to", "EngineDeadError", "NIXL transfer failure")


def trouble_in_logs(stack: Any, max_lines: int = 60) -> str:
    """The lines of each of ``stack``'s logs that say something went wrong (for a failing
    test's output: the logs themselves stay in a temporary directory nobody reads in CI)."""
    out = []
    for record in stack.state.processes:
        try:
            lines = record.log_path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        bad = [line[:400] for line in lines if any(t in line for t in _TROUBLE)]
        if bad:
            out.append(f"--- {record.name} ({len(bad)} lines, last {max_lines})")
            out.extend(bad[-max_lines:])
    return "\n".join(out)


def serve_router(stack: StackHandle, **settings: Any) -> contextlib.AbstractContextManager[str]:
    """Run another kvtether router in this process over ``stack``'s vLLM instances, on a free
    loopback port; yields its URL."""
    from kvtether.router import RouterSettings, create_app

    def make_app(port: int) -> Any:
        return create_app(RouterSettings(
            port=port, prefill_urls=stack.prefill_urls, decode_urls=stack.decode_urls,
            decode_control_urls=stack.decode_control_urls, control_secret=stack.control_secret,
            kv_block_size_tokens=stack.block_size_tokens, **settings,
        ))

    return serve_app(make_app, name="router")
