"""Router settings: one model for CLI flags, env vars (``KVTETHER_ROUTER_*``) and config files."""

from __future__ import annotations

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["BackendSpec", "RouterSettings"]


class BackendSpec(BaseModel):
    """One vLLM instance behind the router."""

    url: str = Field(description="Base URL of the vLLM OpenAI server, e.g. http://127.0.0.1:8100")
    role: str = Field(description="'prefill' or 'decode'")
    control_url: str | None = Field(
        default=None, description="kvtether connector control channel of this instance, if any"
    )
    name: str | None = None


class RouterSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVTETHER_ROUTER_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8000
    prefill_urls: list[str] = Field(default_factory=list, description="prefill vLLM base URLs")
    decode_urls: list[str] = Field(default_factory=list, description="decode vLLM base URLs")
    prefill_control_urls: list[str] = Field(default_factory=list)
    decode_control_urls: list[str] = Field(default_factory=list)
    kv_block_size_tokens: int = Field(default=16, ge=1, description="vLLM KV block size")
    kv_recompute_threshold_tokens: int = Field(
        default=16, ge=0, description="below this many reusable tokens P recomputes (vLLM's)"
    )
    decoder_kv_blocks_ttl_s: float = Field(
        default=480.0, gt=0, description="D's retention time when no connector lease applies"
    )
    lease_ttl_s: float = Field(
        default=60.0, gt=0, description="initial lease on a finished turn's decode-held KV"
    )
    max_lease_s: float = Field(
        default=900.0, gt=0, description="longest lease a hint or heartbeat may ask for"
    )
    max_retained_tokens: int | None = Field(
        default=None, ge=1, description="cap on retained KV tokens per decode instance"
    )
    lease_safety_margin_s: float = Field(
        default=6.0, ge=0, description="never forward a handle that expires within this margin"
    )
    handoff_lease_s: float = Field(
        default=60.0, ge=0,
        description="before a handle goes to prefill, extend its lease to at least this, so it "
        "cannot expire while the prefill request waits for its read (0: off)",
    )
    upstream_timeout_s: float = Field(default=600.0, gt=0)
    upstream_connect_timeout_s: float = Field(default=30.0, gt=0)
    max_conversations: int = Field(default=100_000, ge=1)
