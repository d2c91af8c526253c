"""``--store local``: a Redis (or Valkey) server from the system's packages, for one stack.

It listens on loopback only, keeps nothing on disk (no RDB snapshots, no append-only file) and
runs in the stack's state directory; ``stack down`` stops it with everything else. Conversation
state lives as long as the stack does, which is what router replicas on one host need.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from kvtether.errors import ConfigError

__all__ = ["STORE_SERVERS", "find_store_server", "store_server_argv"]

# Either speaks the Redis protocol the routers' client uses; the first one found runs.
STORE_SERVERS = ("redis-server", "valkey-server")

_INSTALL_HINT = (
    "install one: `apt install redis-server` (Debian, Ubuntu), `dnf install valkey` (Fedora, "
    "RHEL), `brew install redis` (macOS); or run your own server and pass its URL "
    "(--store redis://HOST:PORT/DB)"
)


def find_store_server() -> str:
    """Path of ``redis-server`` or ``valkey-server`` on ``PATH``; :class:`ConfigError` if none."""
    for name in STORE_SERVERS:
        path = shutil.which(name)
        if path:
            return path
    raise ConfigError(f"--store local needs redis-server or valkey-server on PATH; {_INSTALL_HINT}")


def store_server_argv(server: str, port: int, data_dir: Path) -> list[str]:
    """Command line of the local store: loopback, ``port``, nothing persisted."""
    data_dir.mkdir(parents=True, exist_ok=True)
    return [
        server,
        "--bind", "127.0.0.1",
        "--port", str(port),
        "--protected-mode", "yes",
        "--save", "",  # no RDB snapshots
        "--appendonly", "no",
        "--dir", str(data_dir),
        "--daemonize", "no",
        "--logfile", "",  # stdout, which the stack writes to logs/store.log
    ]
