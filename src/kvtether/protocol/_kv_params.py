"""Keys kvtether adds to vLLM's ``kv_transfer_params``: what the router and the connector tell
each other inside a request (vLLM passes unknown keys through).

Internal: only the router and the connector read or write these, always of the same kvtether
version, so they are not part of the public wire contract (``kvtether.protocol.__all__``).
"""

from __future__ import annotations

KV_PARAM_HANDLE_KEY = "kvtether_handle_key"  # router -> D: publish the handle under this key
KV_PARAM_LEASE_TTL_S = "kvtether_lease_ttl_s"  # router -> D: initial lease length
KV_PARAM_LEASE_KEY = "kvtether_lease_key"  # D -> router: the key to renew / release
KV_PARAM_BLOCK_SIZE = "kvtether_block_size"  # D -> P: block size the hashes are over
KV_PARAM_BLOCK_HASHES = "kvtether_block_hashes"  # D -> P: block_hashes() of retained tokens
KV_PARAM_TAIL_HASH = "kvtether_tail_hash"  # D -> P: tail_block_hash() of retained tokens
KV_PARAM_REMOTE_TOKENS = "kvtether_remote_tokens"  # P -> router: tokens D offered
KV_PARAM_PREFIX_MATCH_TOKENS = "kvtether_prefix_match_tokens"  # P: offered tokens repeated
KV_PARAM_PREFIX_BREAK = "kvtether_prefix_break"  # P: the prompt differs from D's sequence
KV_PARAM_REUSED_TOKENS = "kvtether_reused_tokens"  # P: tokens actually read from D
KV_PARAM_PULL = "kvtether_pull"  # P: a PullOutcome value
KV_PARAM_TIMINGS = "kvtether_timings"  # P and D -> router: EngineTimings of the leg
# router -> D: no prefill leg; D computes the turn's new tokens itself on top of the KV it
# retains for the conversation (its prefix cache), and retains the result as after a P/D turn.
KV_PARAM_LOCAL_PREFILL = "kvtether_local_prefill"
KV_PARAM_CACHED_TOKENS = "kvtether_cached_tokens"  # D -> router: prompt tokens it did not compute
# router -> P and D: report the request's token ids (APIs whose answers carry none: Responses,
# Messages); P answers with the prompt's, D adds the prompt's and the output's to its handle.
KV_PARAM_REPORT_TOKEN_IDS = "kvtether_report_token_ids"
KV_PARAM_PROMPT_TOKEN_IDS = "kvtether_prompt_token_ids"  # P and D -> router
KV_PARAM_OUTPUT_TOKEN_IDS = "kvtether_output_token_ids"  # D -> router
