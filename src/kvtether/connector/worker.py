"""vLLM's CPU worker, with each engine-step RPC watched whole for a stall.

Load it with ``--worker-cls kvtether.connector.worker.WatchedCPUWorker`` next to the kvtether
connector (kvtether's CPU stack profiles do both). Why: the connector alone sees only its part
of a step (from binding the step's metadata to collecting its transfer results), and a worker
can stop answering the engine (vLLM's "RPC call to execute_model timed out") in a call outside
it: input preparation, sampling, or the connector calls after the transfer results. This
worker watches ``execute_model`` and ``sample_tokens`` from entry to return with
the same :class:`~kvtether.connector._stall.StepWatch` (a Python report with every thread's
stack after ``kvtether_stall_report_s``, or faulthandler's native one when the stuck call holds
the GIL). Everything else is upstream's ``CPUWorker``.

The upstream change that would make this unnecessary: a stall report in vLLM's worker loop
(``WorkerProc.worker_busy_loop``) before ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` ends the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtether.connector._compat.cpu import CPUWorker
from kvtether.connector._settings import ConnectorSettings
from kvtether.connector._stall import StepWatch, watch_whole_rpcs

__all__ = ["WatchedCPUWorker"]


def _stall_report_s(vllm_config: Any) -> float | None:
    kv = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(kv, "kv_connector_extra_config", None) or {}
    return ConnectorSettings.from_extra_config(extra).stall_report_s


class WatchedCPUWorker(CPUWorker):
    """``CPUWorker`` whose ``execute_model`` and ``sample_tokens`` are watched for stalls."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        after_s = _stall_report_s(vllm_config)
        self._rpc_watch: StepWatch | None = (
            None if after_s is None else watch_whole_rpcs(after_s)
        )

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        return self._watched(super().execute_model, *args, **kwargs)

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        return self._watched(super().sample_tokens, *args, **kwargs)

    def _watched(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        watch = self._rpc_watch
        if watch is None:
            return call(*args, **kwargs)
        watch.begin()
        try:
            return call(*args, **kwargs)
        finally:
            watch.end()
