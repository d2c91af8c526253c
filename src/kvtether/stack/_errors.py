"""Errors raised by the process layer.

::

    KVTetherError                      (kvtether.errors)
    ├── ConfigError                    bad setting, missing model or config file
    └── StackError                     the stack could not be started, stopped or found
        ├── PortInUseError             a port the stack needs is taken
        ├── StackAlreadyRunningError   a live stack already owns the state directory
        ├── StackNotRunningError       no stack recorded in the state directory
        └── InstanceFailedError        a process exited or stayed unhealthy while starting
"""

from __future__ import annotations

from pathlib import Path

from kvtether.errors import ConfigError, KVTetherError

__all__ = [
    "KVTetherError",
    "ConfigError",
    "StackError",
    "PortInUseError",
    "StackAlreadyRunningError",
    "StackNotRunningError",
    "InstanceFailedError",
]


class StackError(KVTetherError):
    """The stack could not be started, stopped or found."""


class PortInUseError(StackError):
    def __init__(self, host: str, port: int, purpose: str) -> None:
        super().__init__(
            f"port {port} on {host} ({purpose}) is already in use; stop whatever holds it "
            f"or choose other ports (--port, --base-port, --side-channel-base-port)"
        )
        self.host, self.port, self.purpose = host, port, purpose


class StackAlreadyRunningError(StackError):
    def __init__(self, state_dir: Path) -> None:
        super().__init__(
            f"a stack is already running from {state_dir}; run `kvtether stack down` first "
            f"or pass another --state-dir"
        )


class StackNotRunningError(StackError):
    def __init__(self, state_dir: Path) -> None:
        super().__init__(f"no stack is recorded in {state_dir} (start one: `kvtether stack up`)")


class InstanceFailedError(StackError):
    """A process died or never became healthy while the stack was starting."""

    def __init__(self, name: str, reason: str, log_path: Path | None, log_tail: str = "") -> None:
        where = f" (log: {log_path})" if log_path else ""
        super().__init__(f"{name} {reason}{where}")
        self.name, self.reason, self.log_path, self.log_tail = name, reason, log_path, log_tail
