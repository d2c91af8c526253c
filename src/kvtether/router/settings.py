"""Router settings: one model for CLI flags, env vars (``KVTETHER_ROUTER_*``) and config files.

Settings the stack also takes (``kvtether stack up`` forwards them to the router it starts) are
declared once, in :class:`RetentionSettings`, which both :class:`RouterSettings` and
:class:`~kvtether.stack.settings.StackSettings` inherit: one default, one validation rule, so a
value the stack accepts is a value the router accepts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from urllib.parse import urlsplit

from pydantic import BaseModel, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = [
    "AccessSettings", "BackendSpec", "KVBlockSizeTokens", "RetentionSettings", "ReusePolicy",
    "RouterSettings",
]

# The stack calls it ``block_size_tokens`` (it is vLLM's --block-size), the router
# ``kv_block_size_tokens``: both public names, one rule.
KVBlockSizeTokens = Annotated[int, Field(ge=1)]

# How the router reuses a conversation's decode-held KV (docs/reuse-policies.md):
# * kvtether: decode affinity, prefix-checked (maybe truncated) handles, leases, releases,
#   a retained-token budget, handles of streamed turns fetched from the kvtether connector.
# * upstream: what vLLM 0.32 ships for bidirectional P/D (its example proxy with
#   NixlConnector): round-robin decode, the last non-streamed turn's handle forwarded as is.
# * off: one-way P/D, nothing forwarded, nothing retained.
ReusePolicy = Literal["kvtether", "upstream", "off"]


class BackendSpec(BaseModel):
    """One vLLM instance behind the router."""

    url: str = Field(description="Base URL of the vLLM OpenAI server, e.g. http://127.0.0.1:8100")
    role: str = Field(description="'prefill' or 'decode'")
    control_url: str | None = Field(
        default=None, description="kvtether connector control channel of this instance, if any"
    )
    name: str | None = None


class RetentionSettings(BaseModel):
    """How long and how much decode-held KV is kept, and when it is worth reading.

    Shared by the router and the stack (which also hands the vLLM-side ones to vLLM's
    ``kv_connector_extra_config``); a mixin without a config of its own, so each settings model
    keeps its env prefix.
    """

    kv_recompute_threshold_tokens: int = Field(
        default=16, ge=0, description="below this many reusable tokens prefill recomputes (vLLM's)"
    )
    decoder_kv_blocks_ttl_s: float = Field(
        default=480.0, gt=0, allow_inf_nan=False,
        description="how long decode retains KV without a lease (vLLM's)",
    )
    lease_ttl_s: float = Field(
        default=60.0, gt=0, allow_inf_nan=False,
        description="initial lease on a finished turn's decode-held KV",
    )
    max_retained_tokens: int | None = Field(
        default=None, ge=1,
        description="cap on retained KV tokens per decode instance (null: no cap)",
    )
    reuse_policy: ReusePolicy = Field(
        default="kvtether",
        description="'kvtether' (affinity, prefix check, leases), 'upstream' (vLLM 0.32's own "
        "bidirectional P/D: round-robin decode, last non-streamed handle forwarded unchecked) "
        "or 'off' (one-way P/D: no KV reuse across turns)",
    )
    max_retained_tokens_per_tenant: int | None = Field(
        default=None, ge=1,
        description="cap on retained KV tokens per tenant (API key owner), over all decode "
        "instances; past it the tenant's least recently used retained KV is released "
        "(null: no cap)",
    )
    local_prefill_max_tokens: int = Field(
        default=0, ge=0,
        description="a turn that extends all the KV its decode instance retains for the "
        "conversation by at most this many new prompt tokens skips the prefill leg: decode "
        "computes them on that KV (found in its own prefix cache) and retains the result "
        "under a new lease, with no KV transfer (conditional disaggregation; kvtether policy "
        "and APIs the router can tokenize only; 0: every turn goes through prefill); while "
        "decode has more prompt tokens of such turns waiting for their first token than "
        "prefill has in its legs in flight, the turn goes through prefill instead",
    )
    max_branches: int = Field(
        default=4, ge=1, le=64,
        description="live sequences (branches) per conversation: a turn whose conversation is "
        "busy, or whose prompt shares less than half of every branch's KV, opens another "
        "branch instead of waiting or consuming that KV (1: one sequence per conversation)",
    )


class AccessSettings(BaseModel):
    """Who may use the router, and how large a request may be.

    Shared by the router and the stack (``stack up`` forwards them; ``api_key`` through the
    router's environment, never its command line). With no key configured the router serves
    one anonymous tenant, as before keys existed.
    """

    api_key: SecretStr | None = Field(
        default=None,
        description="clients must send 'Authorization: Bearer <key>' (tenant 'default'); "
        "prefer the environment variable to the flag, which other users can see in ps",
    )
    api_key_file: Path | None = Field(
        default=None,
        description="file of API keys, one 'tenant key' pair per line ('#' starts a comment); "
        "each tenant owns the conversations its keys create",
    )
    metrics_require_api_key: bool = Field(
        default=False, description="with keys configured, /metrics also needs one (/health never)"
    )
    max_request_body_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1024,
        description="larger request bodies are refused with 413",
    )


class RouterSettings(RetentionSettings, AccessSettings, BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVTETHER_ROUTER_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8000
    prefill_urls: list[str] = Field(default_factory=list, description="prefill vLLM base URLs")
    decode_urls: list[str] = Field(default_factory=list, description="decode vLLM base URLs")
    prefill_control_urls: list[str] = Field(default_factory=list)
    decode_control_urls: list[str] = Field(default_factory=list)
    kv_block_size_tokens: KVBlockSizeTokens = Field(default=16, description="vLLM KV block size")
    max_lease_s: float = Field(
        default=900.0, gt=0, description="longest lease a hint or heartbeat may ask for, or "
        "a client without hints (a coding agent) may get after tool calls"
    )
    lease_safety_margin_s: float = Field(
        default=6.0, ge=0, description="a handle whose lease ends within this margin is renewed "
        "(to handoff_lease_s) before it is forwarded; within 2 s of its end, or with "
        "handoff_lease_s 0, it is not forwarded"
    )
    handoff_lease_s: float = Field(
        default=300.0, ge=0,
        description="before a handle goes to prefill, extend its lease to at least this, so it "
        "cannot expire while the prefill request waits in a loaded queue for its read (a read "
        "frees the KV at once, and a failed one is released, so a long hand-off holds nothing "
        "longer; 0: off)",
    )
    prefill_leg_timeout_s: float = Field(
        default=120.0, gt=0, allow_inf_nan=False,
        description="longest wait for prefill's answer to a turn's prefill leg; past it the "
        "router drops the leg (vLLM aborts it) and the turn runs on decode alone, which "
        "recomputes its prompt (a frozen or hopelessly queued prefill never holds a turn "
        "for minutes)",
    )
    stream_idle_timeout_s: float = Field(
        default=120.0, gt=0, allow_inf_nan=False,
        description="longest silence of a streamed decode leg (before its first chunk and "
        "between chunks); past it the router ends the client's stream with an "
        "upstream_unavailable error event (a frozen decode worker never holds a stream for "
        "longer); a non-streamed answer arrives whole and waits up to upstream_timeout_s",
    )
    stall_after_s: float = Field(
        default=60.0, ge=0, allow_inf_nan=False,
        description="an instance whose kvtether connector reports an engine step waiting "
        "for its worker this long (checked every 5 s) is stalled: its legs in flight are "
        "given up (a prefill leg's turn runs on decode alone; a decode leg goes to another "
        "decode instance or gets a 503 upstream_stalled) and it gets no new legs until it "
        "steps again; 0: off. Needs the connector's control channel and its scheduler "
        "(the CPU profiles)",
    )
    relay_prefill_token: bool = Field(
        default=True,
        description="stream a greedy chat turn's first token from prefill's answer, before "
        "decode's first step (decode's identical token is dropped from its stream; a "
        "different one ends the stream with an error); false: every token from decode",
    )
    tokenizer: Path | None = Field(
        default=None,
        description="directory of the served model's tokenizer (the model directory): the "
        "router renders and tokenizes the chat and completions prompts it can mirror itself, "
        "checked against the token ids vLLM reports (a difference switches it off), instead "
        "of asking prefill's /tokenize before each turn; `stack up` passes its model "
        "directory. Needs transformers; unset or unloadable: prefill's /tokenize",
    )
    upstream_timeout_s: float = Field(default=600.0, gt=0)
    upstream_connect_timeout_s: float = Field(default=30.0, gt=0)
    max_conversations: int = Field(default=100_000, ge=1)
    control_secret: SecretStr | None = Field(
        default=None,
        description="shared secret the kvtether connectors' control channels require "
        "(their KVTETHER_CONTROL_SECRET); `stack up` generates one and sets both",
    )
    max_conversations: int = Field(
        default=100_000, ge=1,
        description="conversations the router remembers; past it the least recently active "
        "one without a turn in flight is forgotten (its retained KV released)",
    )
    max_turn_records: int = Field(
        default=64, ge=1,
        description="turn records kept per conversation (GET /v1/sessions/{id} shows these; "
        "its totals count every turn)",
    )
    store: str = Field(
        default="memory",
        description="where conversations live: 'memory' (this router only) or a Redis/Valkey "
        "URL (redis://host:port/db, rediss://..., unix:///path.sock) shared by router replicas",
    )
    store_key_prefix: str = Field(
        default="kvtether:", min_length=1,
        description="prefix of every key the router writes in the shared store",
    )
    store_conversation_ttl_s: float = Field(
        default=86400.0, gt=0, allow_inf_nan=False,
        description="a conversation idle this long is forgotten by the shared store "
        "(Redis's maxmemory is the bound on its size; max_conversations is not)",
    )
    store_lock_ttl_s: float = Field(
        default=10.0, gt=0, allow_inf_nan=False,
        description="expiry of a conversation's lock in the shared store; a replica extends "
        "it while its turn runs, so only a replica that died or stalled lets it lapse",
    )
    store_lock_wait_s: float = Field(
        default=30.0, ge=0, allow_inf_nan=False,
        description="how long a turn waits for another turn of its conversation (on any "
        "replica) to finish before it is refused with 409 conversation_busy",
    )
    store_timeout_s: float = Field(
        default=1.0, gt=0, allow_inf_nan=False,
        description="socket timeout of shared-store calls; past it the store counts as down "
        "(turns go on as plain P/D, miss:store_unavailable)",
    )

    @field_validator("store")
    @classmethod
    def _store_url(cls, value: str) -> str:
        value = value.strip()
        if value == "memory":
            return value
        if urlsplit(value).scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                "store must be 'memory' or a Redis/Valkey URL "
                "(redis://host:port/db, rediss://host:port/db or unix:///path/to/socket)"
            )
        return value
