"""Session settings: one model for constructor arguments and ``KVTETHER_SESSION_*`` env vars."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvtether.errors import ConfigError

__all__ = ["SessionSettings", "normalize_base_url"]


def normalize_base_url(value: str) -> str:
    """Router root URL from ``http://host:8000``, ``http://host:8000/`` or ``http://host:8000/v1``."""
    url = value.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if not url.startswith(("http://", "https://")):
        raise ConfigError(
            f"base_url {value!r} is not an http(s) URL; pass the kvtether router's address, "
            "e.g. http://127.0.0.1:8000"
        )
    return url


class SessionSettings(BaseSettings):
    """How a session talks to the router. Every field can be set by env var, e.g.
    ``KVTETHER_SESSION_HEARTBEAT_INTERVAL_S=2``."""

    model_config = SettingsConfigDict(env_prefix="KVTETHER_SESSION_", extra="ignore")

    base_url: str | None = Field(
        default=None,
        description="kvtether router root URL; if unset, taken from the first wrapped client",
    )
    heartbeat_interval_s: float = Field(
        default=5.0,
        gt=0,
        description="seconds between lease renewals while a tool runs (also capped at a third "
        "of the lease time the router reports left)",
    )
    max_heartbeat_backoff_s: float = Field(
        default=60.0, gt=0, description="longest wait between heartbeats to an unreachable router"
    )
    request_timeout_s: float = Field(
        default=2.0,
        gt=0,
        description="timeout of session API calls (release, status; a heartbeat, which runs "
        "beside the tool, waits up to heartbeat_interval_s when that is longer); kept short so "
        "a slow router never holds up the agent",
    )
    on_prefix_break: Literal["warn", "log", "ignore"] = Field(
        default="warn",
        description="what to do when a turn rewrites history: PrefixBreakWarning, a log line, "
        "or nothing (the turn record says so in every case)",
    )
    send_hints: bool = Field(
        default=True, description="send X-KVTether-Hints (next-turn predictions) on each request"
    )
    max_turn_records: int = Field(
        default=500,
        ge=1,
        description="turn records a session lists (session.turns), the most recent ones; tool "
        "runs and events are listed up to as many each. Older ones are dropped, so a "
        "conversation that never ends stays bounded; session.totals and the report's summary "
        "still count every turn",
    )
    release_at_exit: bool = Field(
        default=True,
        description="release the lease when the session is garbage-collected or the "
        "interpreter exits without close()",
    )

    @field_validator("base_url")
    @classmethod
    def _normalize(cls, value: str | None) -> str | None:
        return None if value is None else normalize_base_url(value)
