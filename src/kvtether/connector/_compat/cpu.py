"""vLLM's CPU worker, imported after the version check (a module of its own: only CPU worker
processes import it, never the engine core)."""

from __future__ import annotations

from kvtether.connector._compat import VLLM_VERSION

from vllm.v1.worker.cpu_worker import CPUWorker

__all__ = ["CPUWorker", "VLLM_VERSION"]
