"""Prometheus metrics of one router (its own registry: several routers may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvtether.protocol import TurnTimings

__all__ = ["RouterMetrics"]

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.turns = Counter(
            "kvtether_turns", "Turns routed, by reuse outcome", ["outcome"], registry=r
        )
        self.reuse_fired = Counter(
            "kvtether_reuse_fired",
            "Eligible turns that reused all they could (within a block or the threshold)",
            registry=r,
        )
        self.reuse_eligible = Counter(
            "kvtether_reuse_eligible",
            "Turns with at least kv_recompute_threshold_tokens reusable (fired or lost KV)",
            registry=r,
        )
        self.reusable_tokens = Counter(
            "kvtether_reusable_tokens",
            "Prompt tokens repeating the previous turn's sequence (the most reuse could save)",
            registry=r,
        )
        self.reuse_miss = Counter(
            "kvtether_reuse_miss", "Turns that did not fire, by cause (eligible or not)",
            ["cause"], registry=r,
        )
        self.reused_tokens = Counter(
            "kvtether_reused_tokens",
            "Prompt tokens not recomputed (prefill's prefix cache or decode-held KV)",
            registry=r,
        )
        self.prompt_tokens = Counter("kvtether_prompt_tokens", "Prompt tokens routed", registry=r)
        self.errors = Counter(
            "kvtether_request_errors", "Requests answered with an error", ["status"], registry=r
        )
        self.prefill_leg_s = Histogram(
            "kvtether_prefill_leg_seconds", "Prefill leg latency", buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.prefill_timeouts = Counter(
            "kvtether_prefill_leg_timeouts", "Prefill legs dropped after prefill_leg_timeout_s "
            "(their turns ran on decode alone)", registry=r,
        )
        self.local_prefills = Counter(
            "kvtether_local_prefill_turns", "Turns with no prefill leg: decode computed their "
            "new tokens on the KV it retained (local_prefill_max_tokens)", registry=r,
        )
        self.prefix_cache_returns = Counter(
            "kvtether_prefix_cache_returns", "Turns of a conversation whose lease had ended, "
            "computed on the decode instance that held it, on what its prefix cache still held "
            "(a subset of kvtether_local_prefill_turns)", registry=r,
        )
        self.stalls = Counter(
            "kvtether_instance_stalls", "Times an instance was found stalled (an engine step "
            "waiting for its worker past stall_after_s; its legs in flight were given up)",
            ["instance"], registry=r,
        )
        self.stalled = Gauge(
            "kvtether_instance_stalled", "1 while an instance is stalled (no legs go to it)",
            ["instance"], registry=r,
        )
        self.first_token_from_prefill = Counter(
            "kvtether_first_token_from_prefill", "Streamed turns whose first token went to the "
            "client from prefill's answer, before decode's first step", registry=r,
        )
        self.first_token_mismatch = Counter(
            "kvtether_first_token_mismatch", "Streams ended because decode's first token "
            "differed from prefill's, already sent (greedy turns only)", registry=r,
        )
        self.tokenizations = Counter(
            "kvtether_prompt_tokenizations", "Prompts the router tokenized before a turn, by "
            "who: 'router' (in its own process, the tokenizer setting) or 'prefill' (its "
            "/tokenize)", ["by"], registry=r,
        )
        self.tokenizer_mismatches = Counter(
            "kvtether_router_tokenizer_mismatches", "Prompts the router tokenized otherwise "
            "than vLLM reported (the first one switches the router's tokenizer off)",
            registry=r,
        )
        self.ttft_s = Histogram(
            "kvtether_ttft_seconds", "Time to first token (streamed turns)",
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )
        self.conversations = Gauge(
            "kvtether_conversations", "Conversations in the table", registry=r
        )
        self.retained_tokens = Gauge(
            "kvtether_retained_tokens", "Tokens of KV retained on a decode instance",
            ["instance"], registry=r,
        )
        self.prompt_backlog_tokens = Gauge(
            "kvtether_prompt_backlog_tokens", "Prompt tokens this router sent to an instance "
            "that have no first token yet (prefill legs in flight; decode: local-prefill "
            "turns): what local prefill balances", ["instance"], registry=r,
        )
        self.active_leases = Gauge(
            "kvtether_active_leases", "Conversations holding retained KV", registry=r
        )
        self.lease_events = Counter(
            "kvtether_lease_events",
            "Lease events: renewed (heartbeat), extended_at_handoff, released, expired, evicted", ["event"], registry=r,
        )
        self.heartbeat_s = Histogram(
            "kvtether_heartbeat_seconds", "Heartbeat handling latency",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5), registry=r,
        )

        self.turn_stage_s = Histogram(
            "kvtether_turn_stage_seconds",
            "Where turns' time went, by stage (TurnTimings: router_wait, plan, prefill_leg, "
            "decode_first_token from the router's clock; prefill_queue, prefill_read, "
            "prefill_engine, decode_queue, decode_read, decode_engine from the connectors)",
            ["stage"], buckets=_LATENCY_BUCKETS_S, registry=r,
        )

        self.store_ops = Counter(
            "kvtether_store_ops", "Round trips to the shared conversation store, by operation",
            ["op"], registry=r,
        )
        self.store_call_s = Histogram(
            "kvtether_store_call_seconds", "Shared conversation store round-trip latency",
            ["op"], buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1,
                             0.5, 1.0),
            registry=r,
        )
        self.store_unavailable = Counter(
            "kvtether_store_unavailable",
            "Requests the shared conversation store did not answer (turns ran as plain P/D)",
            registry=r,
        )

    def observe_stages(self, timings: TurnTimings) -> None:
        for stage, seconds in timings.stages().items():
            self.turn_stage_s.labels(stage).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
