"""Fakes for the launcher tests: a command builder that starts ``fake_server.py``."""

from __future__ import annotations

import random
import socket
import sys
from pathlib import Path

import psutil

from kvtether.stack._commands import Command, InstancePlan, VllmCommands
from kvtether.stack.settings import StackSettings

FAKE_SERVER = Path(__file__).with_name("fake_server.py")


class FakeCommands:
    """Starts ``fake_server.py`` in place of vLLM and the routers; ``behaviour`` maps a process
    name ("decode-0", "router", or "*" for all) to FAKE_* env vars. The front and the local
    store (redis-server) are the real ones: both start in well under a second."""

    def __init__(self, behaviour: dict[str, dict[str, str]] | None = None) -> None:
        self.behaviour = behaviour or {}
        self.plans: list[InstancePlan] = []

    def command(self, plan: InstancePlan, settings: StackSettings) -> Command:
        self.plans.append(plan)
        if plan.role in ("front", "store"):
            return VllmCommands().command(plan, settings)
        env = {**self.behaviour.get("*", {}), **self.behaviour.get(plan.name, {})}
        argv = [sys.executable, str(FAKE_SERVER), "--host", plan.host, "--port", str(plan.port)]
        return Command(argv + ["--name", plan.name], env)


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections' local ports."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port_block(n: int) -> int:
    """A base port with n free ports after it, away from real stacks and below the ephemeral
    range: a port free when chosen there can be taken, before the fake server binds it, as the
    local end of any outgoing connection (CI: "Address already in use" on a fake decode)."""
    high = min(_ephemeral_low(), 32768)
    for _ in range(200):
        base = random.randrange(20000, high - n)
        if all(_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no free port block")


def pids_from(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def all_dead(pids: list[int]) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            continue
    return True
