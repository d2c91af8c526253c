"""A real redis-server for tests: started in a temporary directory, without persistence,
stopped by the code that started it (also on errors).

Missing ``redis-server`` skips the test with the reason, except on CI (``CI`` set), where it
fails: the set-up installs it there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from .waiting import wait_for

__all__ = ["RedisServer", "redis_port", "require_redis_server"]

# Redis ports of this suite: 26379-26399 (KVTETHER_TEST_REDIS_PORT moves them).
_BASE_PORT = int(os.environ.get("KVTETHER_TEST_REDIS_PORT", "26379"))


def redis_port(offset: int) -> int:
    return _BASE_PORT + offset


def require_redis_server() -> str:
    path = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None
    )
    if path is None:
        reason = ("redis-server is not installed (Debian: apt-get install redis-server; "
                  "macOS: brew install redis); the Redis conversation store is not tested")
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return path


class RedisServer:
    """One redis-server process on 127.0.0.1:``port``; :meth:`stop` and :meth:`start` again
    (same port, empty) simulate an outage."""

    def __init__(self, port: int, workdir: Path) -> None:
        self.binary = require_redis_server()
        self.port = port
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - the process keeps it
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        proc = self.proc
        try:
            wait_for(lambda: self.ping() or proc.poll() is not None, timeout_s=30,
                     interval_s=0.05, message="redis-server to answer PING")
        except AssertionError:
            self.stop()
            raise
        if proc.poll() is not None:
            self.proc = None
            raise RuntimeError(f"redis-server exited ({proc.returncode}); "
                               f"see {self.workdir / 'redis.log'}")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.wait(timeout=30)
        self.proc = None

    @classmethod
    @contextlib.contextmanager
    def running(cls, port: int, workdir: Path) -> Iterator[RedisServer]:
        server = cls(port, workdir)
        server.start()
        try:
            yield server
        finally:
            server.stop()
