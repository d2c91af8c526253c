"""A real vLLM ``Scheduler`` running the kvtether connector, with a simulated NIXL worker.

Modelled on vLLM's own connector unit tests (``tests/v1/kv_connector/unit``): no model, no
NIXL, no processes. :class:`FakeSendWorker` keeps the decode-side deadline bookkeeping exactly
as vLLM 0.32's ``NixlPullConnectorWorker.start_load_kv`` (track ``reqs_in_batch``, overwrite
``reqs_to_send`` deadlines rebased on ``scheduler_clock``), ``_get_new_notifs`` (a prefill's
"done reading" frees at once) and ``_reap_expired_send_leases`` (free at the deadline) do, so
the scheduler -> worker -> scheduler loop that carries renewals and releases is exercised.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvtether.connector.nixl import KVTetherScheduler

EOS = 2
BS = 4  # the block size tests use unless they say otherwise
NUM_BLOCKS = 200
# Just enough of a Llama config for vLLM's ModelConfig; no weights or tokenizer are read.
_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
    "num_hidden_layers": 1, "head_dim": 32, "vocab_size": 1000, "max_position_embeddings": 4096,
    "bos_token_id": 1, "eos_token_id": EOS, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
}
init_none_hash(sha256)


class FakeSendWorker:
    def __init__(self) -> None:
        self.to_process: set[str] = set()
        self.deadlines: dict[str, float] = {}
        self.read_by_prefill: set[str] = set()

    def step(self, meta: Any) -> set[str]:
        self.to_process |= meta.reqs_in_batch
        self.to_process -= meta.reqs_not_processed
        now = time.perf_counter()
        for rid, deadline in meta.reqs_to_send.items():
            if rid in self.to_process:
                self.deadlines[rid] = now + (deadline - meta.scheduler_clock)
        done = {r for r in self.read_by_prefill if r in self.to_process}
        self.read_by_prefill -= done
        done |= {r for r, d in self.deadlines.items() if now >= d}
        for rid in done:
            self.to_process.discard(rid)
            self.deadlines.pop(rid, None)
        return done


class Harness:
    def __init__(self, tmp: Path, *, block_size: int = 4, extra: dict[str, Any] | None = None,
                 scheduler_cls: type[Scheduler] = Scheduler):
        (tmp / "config.json").write_text(json.dumps(_MODEL_CONFIG))
        self.block_size = block_size
        config = VllmConfig(
            model_config=ModelConfig(model=str(tmp), skip_tokenizer_init=True, dtype="float32"),
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512,
                                             max_model_len=4096, is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector="NixlConnector", kv_connector_module_path="kvtether.connector.nixl",
                kv_role="kv_both", kv_load_failure_policy="recompute",
                kv_connector_extra_config={"bidirectional_kv_xfer": True,
                                           "kv_recompute_threshold": 0, **(extra or {})},
            ),
            device_config=DeviceConfig("cpu"),
        )
        config.cache_config.num_gpu_blocks = NUM_BLOCKS
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                 dtype=torch.float32)
        kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                                        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
        self.scheduler = scheduler_cls(vllm_config=config, kv_cache_config=kv_cache_config,
                                   log_stats=False,
                                   structured_output_manager=StructuredOutputManager(config),
                                   block_size=block_size)
        connector = self.scheduler.connector
        assert connector is not None and type(connector).__name__ == "NixlConnector"
        self.conn: KVTetherScheduler = connector.connector_scheduler  # type: ignore[assignment]
        self.worker = FakeSendWorker()
        self.outputs: dict[str, Any] = {}  # request id -> final kv_transfer_params

    def add(self, rid: str, prompt: list[int], params: dict[str, Any] | None,
            max_tokens: int = 1) -> Request:
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                  extra_args={"kv_transfer_params": params} if params else None)
        sampling.update_from_generation_config({}, EOS)
        request = Request(request_id=rid, prompt_token_ids=list(prompt),
                          sampling_params=sampling, pooling_params=None, mm_features=None,
                          block_hasher=get_request_block_hasher(self.block_size, sha256))
        self.scheduler.add_request(request)
        return request

    def step(self, *, recved: set[str] = frozenset(), failed: set[str] = frozenset(),
             token: int = 7) -> SchedulerOutput:
        """One engine step: schedule, "run" (one token per scheduled request), update."""
        out = self.scheduler.schedule()
        sending = self.worker.step(out.kv_connector_metadata)
        rids = [r for r, n in out.num_scheduled_tokens.items() if n > 0]
        kv_out = KVConnectorOutput(finished_sending=sending or None,
                                   finished_recving=set(recved) | set(failed) or None,
                                   failed_recving=set(failed))
        runner = ModelRunnerOutput(req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)},
                                   sampled_token_ids=[[token] for _ in rids],
                                   kv_connector_output=kv_out)
        for outputs in self.scheduler.update_from_output(out, runner).values():
            for output in outputs.outputs:
                if output.finished:
                    self.outputs[output.request_id] = output.kv_transfer_params
        return out

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def decode_leg(key: str | None, **extra: Any) -> dict[str, Any]:
    """kv_transfer_params of a decode leg, as the router builds them from P's answer."""
    params = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "engine-p",
        "remote_request_id": "p-req", "remote_block_ids": [[0, 1, 2]], "remote_host": "127.0.0.1",
        "remote_port": 5600, "tp_size": 1, **extra,
    }
    if key is not None:
        params["kvtether_handle_key"] = key
    return params


def finish_decode_turn(h: Harness, rid: str, key: str | None, max_tokens: int = 3,
                       **extra: Any) -> list[int]:
    prompt = list(range(10, 20))
    request = h.add(rid, prompt, decode_leg(key, **extra), max_tokens=max_tokens)
    h.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    h.step(recved={rid})
    for _ in range(max_tokens + 2):
        if rid in h.outputs:
            break
        h.step()
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    return list(request.all_token_ids)
