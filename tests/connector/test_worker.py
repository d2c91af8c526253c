"""``WatchedCPUWorker``: vLLM's CPU worker with each engine-step RPC watched whole."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.worker.cpu_worker import CPUWorker  # noqa: E402

from kvtether.connector.worker import WatchedCPUWorker  # noqa: E402


def test_the_watched_cpu_worker_brackets_each_step_rpc_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``WatchedCPUWorker`` watches execute_model and sample_tokens from entry to return, also
    when they raise; a stall outside the connector's part of a step is reported too."""
    seen: list[str] = []

    class Watch:
        def begin(self) -> None:
            seen.append("begin")

        def end(self) -> None:
            seen.append("end")

    worker = object.__new__(WatchedCPUWorker)
    worker._rpc_watch = Watch()
    monkeypatch.setattr(CPUWorker, "execute_model",
                        lambda self, out: seen.append(f"execute {out}") or "ran", raising=False)
    monkeypatch.setattr(CPUWorker, "sample_tokens",
                        lambda self, g: (_ for _ in ()).throw(RuntimeError("sampling")),
                        raising=False)
    assert worker.execute_model("step-1") == "ran"
    with pytest.raises(RuntimeError):
        worker.sample_tokens(None)
    assert seen == ["begin", "execute step-1", "end", "begin", "end"]
