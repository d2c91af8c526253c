"""The hooks' settings, read from the environment the harness gives its hooks.

Plain environment variables rather than a pydantic-settings model: a hook starts as a new
process for every tool call and blocks the harness while it starts, and pydantic alone takes
longer to import than everything a hook does (see ``kvtether.harness``).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "API_KEY_ENV", "DEFAULT_ROUTER_URL", "HookSettings", "MAX_LEASE_ENV", "ROUTER_URL_ENV",
    "STATE_DIR_ENV",
]

logger = logging.getLogger(__name__)

ROUTER_URL_ENV = "KVTETHER_URL"
API_KEY_ENV = "KVTETHER_API_KEY"  # the Python client's variable too (docs/security.md)
STATE_DIR_ENV = "KVTETHER_HOOK_STATE_DIR"
MAX_LEASE_ENV = "KVTETHER_HOOK_MAX_LEASE_S"
DEFAULT_ROUTER_URL = "http://127.0.0.1:8000"
DEFAULT_MAX_LEASE_S = 900.0  # the router's default max_lease_s


def default_state_dir() -> Path:
    """Per user, in memory where the system offers it (``$XDG_RUNTIME_DIR``)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "kvtether-hooks"
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"kvtether-hooks-{uid}"


@dataclass(frozen=True)
class HookSettings:
    router_url: str = DEFAULT_ROUTER_URL
    api_key: str | None = None  # sent as "Authorization: Bearer <key>"
    # Where a tool's marker files live (one folder per conversation).
    state_dir: Path = field(default_factory=default_state_dir)
    # A beater stops after this long whatever happens: the longest a tool is covered.
    max_lease_s: float = DEFAULT_MAX_LEASE_S
    request_timeout_s: float = 2.0
    # A tool that ends sooner is never heartbeated: the lease of the answer that called it
    # already covers it (the router sizes it for the tool calls it relayed).
    first_beat_after_s: float = 1.0
    # How often a beater looks whether its tool ended, and the longest gap between two of its
    # heartbeats (shorter when the router's lease is short: a third of what is left of it).
    poll_s: float = 0.25
    max_beat_interval_s: float = 20.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> HookSettings:
        """The settings from ``env`` (default: ``os.environ``); a bad value is logged and
        replaced by its default, never raised: a hook must not break the harness."""
        env = os.environ if env is None else env
        url = (env.get(ROUTER_URL_ENV) or DEFAULT_ROUTER_URL).strip().rstrip("/")
        state_dir = env.get(STATE_DIR_ENV)
        return cls(
            router_url=url or DEFAULT_ROUTER_URL,
            api_key=env.get(API_KEY_ENV) or None,
            state_dir=Path(state_dir) if state_dir else default_state_dir(),
            max_lease_s=_positive(env, MAX_LEASE_ENV, DEFAULT_MAX_LEASE_S),
        )

    def beater_env(self) -> dict[str, str]:
        """The environment a detached beater reads these settings back from."""
        env = {ROUTER_URL_ENV: self.router_url, STATE_DIR_ENV: str(self.state_dir),
               MAX_LEASE_ENV: repr(self.max_lease_s)}
        if self.api_key:
            env[API_KEY_ENV] = self.api_key
        return env


def _positive(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        logger.warning("%s=%r is not a positive number of seconds; using %s", name, raw, default)
        return default
    return value
