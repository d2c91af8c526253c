"""The process layer's errors; defined, with the whole tree, in :mod:`kvtether.errors`."""

from __future__ import annotations

from kvtether.errors import (
    ConfigError,
    InstanceFailedError,
    KVTetherError,
    PortInUseError,
    RestartsExhaustedError,
    StackAlreadyRunningError,
    StackError,
    StackNotRunningError,
)

__all__ = [
    "KVTetherError",
    "ConfigError",
    "StackError",
    "PortInUseError",
    "StackAlreadyRunningError",
    "StackNotRunningError",
    "InstanceFailedError",
    "RestartsExhaustedError",
]
