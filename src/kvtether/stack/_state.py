"""The state file (``<state_dir>/stack.json``): what runs, so another shell can find and stop it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from kvtether.errors import StackError

__all__ = ["Role", "ProcessRecord", "StackState", "state_path", "load_state", "save_state"]

Role = Literal["prefill", "decode", "router", "reference", "store", "front"]
STATE_VERSION = 1


class ProcessRecord(BaseModel):
    """One process the stack started."""

    name: str  # "prefill-0", "decode-1", "router" (or "router-0", "router-1", "front"), "store"
    role: Role
    url: str
    port: int
    pid: int
    create_time: float | None = Field(default=None, description="psutil create_time, vs pid reuse")
    log_path: Path
    side_channel_port: int | None = None
    control_port: int | None = None


class StackState(BaseModel):
    version: int = STATE_VERSION
    phase: Literal["starting", "running"] = "starting"
    owner_pid: int = Field(default_factory=os.getpid, description="the `stack up` process")
    owner_create_time: float | None = None
    detached: bool = False
    owner_stops_on_sigterm: bool = Field(
        default=False, description="`stack down` should SIGTERM the owner before the instances"
    )
    started_unix_s: float = Field(default_factory=time.time)
    router_url: str | None = None
    model: str = ""
    served_model_name: str = ""
    processes: list[ProcessRecord] = Field(default_factory=list)

    def by_role(self, role: Role) -> list[ProcessRecord]:
        return [p for p in self.processes if p.role == role]


def state_path(state_dir: Path) -> Path:
    return Path(state_dir) / "stack.json"


def load_state(state_dir: Path) -> StackState | None:
    path = state_path(state_dir)
    try:
        return StackState.model_validate_json(path.read_text())
    except FileNotFoundError:
        return None
    except (ValidationError, json.JSONDecodeError, OSError) as exc:
        reason = exc.__class__.__name__
        raise StackError(f"cannot read {path} ({reason}); delete it if it is stale") from None


def save_state(state_dir: Path, state: StackState) -> Path:
    """Write atomically: a reader never sees half a file."""
    path = state_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(state.model_dump_json(indent=2))
    os.replace(tmp, path)
    return path


def remove_state(state_dir: Path) -> None:
    state_path(state_dir).unlink(missing_ok=True)
