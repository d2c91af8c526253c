"""Connector settings, read from vLLM's ``kv_connector_extra_config`` (keys ``kvtether_*``).

Upstream keys in the same dict (``bidirectional_kv_xfer``, ``kv_recompute_threshold``,
``decoder_kv_blocks_ttl``, ...) keep their upstream meaning; the connector reads only its own.

The control channel's shared secret is read from the environment only
(``KVTETHER_CONTROL_SECRET``): ``kv_connector_extra_config`` is on vLLM's command line, which
every user of the host can read.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from kvtether.errors import ConfigError
from kvtether._validation import first_field_error
from kvtether.protocol import CONTROL_SECRET_ENV

__all__ = ["ConnectorSettings", "CONTROL_PORT_ENV", "CONTROL_SECRET_ENV", "is_loopback"]

# Fallback for the control port when extra_config has none (set by `kvtether stack`).
CONTROL_PORT_ENV = "KVTETHER_CONTROL_PORT"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ConnectorSettings(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    control_port: int | None = Field(
        default=None, ge=1, le=65535, alias="kvtether_control_port",
        description="HTTP control channel port (scheduler role only); none = no listener.",
    )
    control_host: str = Field(
        default="127.0.0.1", alias="kvtether_control_host",
        description="Bind address of the control channel; another than loopback needs "
        "KVTETHER_CONTROL_SECRET.",
    )
    control_secret: SecretStr | None = Field(
        default=None, alias=CONTROL_SECRET_ENV,
        description="Shared secret every control request must carry as 'Authorization: "
        "Bearer <secret>'; from the environment only.",
    )
    control_max_body_bytes: int = Field(
        default=2 * 1024 * 1024, ge=256, alias="kvtether_control_max_body_bytes",
        description="Control requests with a larger body get 413 (a prefix-cache query "
        "carries a prompt's token ids: about 7 bytes a token).",
    )
    lease_ttl_s: float | None = Field(
        default=None, gt=0, allow_inf_nan=False, alias="kvtether_lease_ttl_s",
        description="Initial lease when the request names none; default decoder_kv_blocks_ttl.",
    )
    max_lease_ttl_s: float = Field(
        default=86400.0, gt=0, allow_inf_nan=False, alias="kvtether_max_lease_ttl_s",
        description="Cap on any initial or renewed lease.",
    )
    max_retained_tokens: int | None = Field(
        default=None, ge=0, alias="kvtether_max_retained_tokens",
        description="Evict the leases closest to expiry to keep retained tokens under this.",
    )
    renew_guard_s: float = Field(
        default=1.0, ge=0, allow_inf_nan=False, alias="kvtether_renew_guard_s",
        description="Refuse renewing a lease with less left than this (410 expiring): the "
        "engine loop ends a lease at its deadline, and a renewal this late races that.",
    )
    op_timeout_s: float = Field(
        default=10.0, gt=0, allow_inf_nan=False, alias="kvtether_op_timeout_s",
        description="The longest a release waits for the worker to free the blocks.",
    )
    worker_slack_s: float = Field(
        default=30.0, gt=0, allow_inf_nan=False, alias="kvtether_worker_slack_s",
        description="The worker is told a lease's deadline plus this; the engine loop ends the "
        "lease at its own deadline. A renewal is answered at once and reaches the worker at "
        "the next step: this covers the steps in flight (async scheduling) meanwhile.",
    )
    require_block_hashes: bool = Field(
        default=False, alias="kvtether_require_block_hashes",
        description="Prefill: do not read decode handles that carry no block hashes.",
    )
    idle_tick_s: float = Field(
        default=5.0, gt=0, allow_inf_nan=False, alias="kvtether_idle_tick_s",
        description="With kvtether's scheduler (--scheduler-cls): while an engine sleeps "
        "holding KV, step this often to pick up NIXL notifications (a reader finished).",
    )
    progress_thread_delay_us: int | None = Field(
        default=None, ge=0, alias="kvtether_progress_thread_delay_us",
        description="Worker: NIXL progress-thread wait (pthrDelay, microseconds) instead of "
        "nixl's busy-polling 0; none = nixl's default.",
    )
    rpc_busy_loop_s: float | None = Field(
        default=None, ge=0, allow_inf_nan=False, alias="kvtether_rpc_busy_loop_s",
        description="Worker: spin at most this long on vLLM's shared-memory RPC queue before "
        "blocking (vLLM: 1 s); none = vLLM's default.",
    )
    stall_report_s: float | None = Field(
        default=60.0, gt=0, allow_inf_nan=False, alias="kvtether_stall_report_s",
        description="Worker: log every thread's stack when one engine step has run this long "
        "(where a hung worker is, before vLLM's 300 s execute_model timeout ends the engine); "
        "none = off.",
    )
    role: str | None = Field(default=None, alias="kvtether_role", description="Informational.")

    @model_validator(mode="after")
    def _open_only_on_loopback(self) -> ConnectorSettings:
        if self.control_port is not None and self.control_secret is None \
                and not is_loopback(self.control_host):
            raise ValueError(
                f"kvtether_control_host {self.control_host} is not loopback: set "
                f"{CONTROL_SECRET_ENV} in vLLM's environment (`kvtether stack up` does), or "
                "anyone who reaches that port can renew and release leases"
            )
        return self

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
    ) -> ConnectorSettings:
        data = {k: v for k, v in (extra or {}).items() if k.startswith("kvtether_")}
        env = os.environ if env is None else env
        if data.get("kvtether_control_port") is None and env.get(CONTROL_PORT_ENV):
            data["kvtether_control_port"] = env[CONTROL_PORT_ENV]
        if env.get(CONTROL_SECRET_ENV):
            data[CONTROL_SECRET_ENV] = env[CONTROL_SECRET_ENV]
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            err = first_field_error(exc)
            if not err.path:  # a rule over several settings: its message says it all
                raise ConfigError(f"invalid kvtether connector settings: {err.cause or err.msg}"
                                  ) from None
            raise ConfigError(
                f"invalid kv_connector_extra_config.{err} (got {err.input!r})") from None
