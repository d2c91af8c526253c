"""Colocated vLLM, no KV transfer: the correctness reference (prefix caching off) or, for
benchmarks, the simple colocated deployment (prefix caching on), one engine or several
replicas."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from subprocess import Popen

from kvtether.errors import PortInUseError
from kvtether.stack import _procs
from kvtether.stack._commands import CommandBuilder, InstancePlan, VllmCommands
from kvtether.stack._health import Starting, wait_healthy
from kvtether.stack.settings import StackSettings, resolve_model

__all__ = ["start_reference_vllm", "start_reference_vllms"]


@contextmanager
def start_reference_vllm(
    settings: StackSettings | None = None,
    port: int | None = None,
    *,
    commands: CommandBuilder | None = None,
    log_path: Path | None = None,
    prefix_caching: bool = False,
    cpu_cores: str | None = None,
) -> Iterator[str]:
    """One colocated vLLM; yields its URL.

    ``prefix_caching`` False (the default): the correctness reference, every prompt computed.
    True: the simple colocated deployment, vLLM's prefix cache on. Both run with
    ``--enable-prompt-tokens-details``, so ``usage.prompt_tokens_details.cached_tokens``
    reports cache hits. ``cpu_cores`` (CPU hosts): the cores its worker computes on, as
    ``VLLM_CPU_OMP_THREADS_BIND`` takes them (``"0-1"``); default: core 0, where a stack's
    first decode instance computes.
    """
    settings = settings or StackSettings()
    port = port or _procs.free_port(settings.host)
    with start_reference_vllms(settings, [port], commands=commands,
                               log_paths=[log_path] if log_path else None,
                               prefix_caching=prefix_caching, cpu_cores=[cpu_cores]) as urls:
        yield urls[0]


@contextmanager
def start_reference_vllms(
    settings: StackSettings,
    ports: Sequence[int],
    *,
    commands: CommandBuilder | None = None,
    log_paths: Sequence[Path] | None = None,
    prefix_caching: bool = False,
    cpu_cores: Sequence[str | None] | None = None,
) -> Iterator[list[str]]:
    """Colocated vLLM replicas, one per port, started together; yields their URLs.

    Replica ``i`` computes on ``cpu_cores[i]`` (see :func:`start_reference_vllm`). Several
    replicas are placed on GPUs as a stack places its instances: ``gpu_ids`` round-robin, the
    stack's ``gpu_memory_utilization`` shared by the replicas on one GPU. Every replica is
    stopped on exit, and if any fails to start.
    """
    model_dir, served = resolve_model(settings)
    for port in ports:
        if _procs.port_in_use(settings.host, port):
            raise PortInUseError(settings.host, port, "reference vLLM HTTP")
    logs = Path(settings.state_dir) / "logs"
    plans = []
    for i, port in enumerate(ports):
        gpu_id, gpu_share = _gpu_placement(settings, i, len(ports))
        plans.append(InstancePlan(
            name="reference" if len(ports) == 1 else f"reference-{i}",
            role="reference",
            host=settings.host,
            port=port,
            log_path=log_paths[i] if log_paths else logs / f"reference-{port}.log",
            model_dir=model_dir,
            served_model_name=served,
            prefix_caching=prefix_caching,
            cpu_cores=cpu_cores[i] if cpu_cores else None,
            gpu_id=gpu_id,
            gpu_memory_utilization=gpu_share,
        ))
    builder = commands or VllmCommands()
    started: list[tuple[Popen[bytes], float | None]] = []
    try:
        starting = []
        for plan in plans:
            cmd = builder.command(plan, settings)
            popen = _procs.spawn(cmd.argv, cmd.env, plan.log_path)
            started.append((popen, _procs.create_time(popen.pid)))
            starting.append(Starting(plan.name, plan.url, plan.log_path, popen))
        wait_healthy(starting, settings.health_timeout_s)
        yield [plan.url for plan in plans]
    finally:
        with _procs.signals_deferred():
            for popen, created in reversed(started):
                _procs.stop_group(popen.pid, created, settings.stop_timeout_s)


def _gpu_placement(settings: StackSettings, index: int,
                   replicas: int) -> tuple[int | None, float | None]:
    """Replica ``index``'s GPU and memory share; one replica keeps vLLM's defaults."""
    if replicas == 1 or settings.device == "cpu":
        return None, None
    gpus = settings.gpu_ids
    gpu_id = gpus[index % len(gpus)] if gpus else None
    if settings.gpu_memory_utilization is None:
        return gpu_id, None
    per_gpu = -(-replicas // max(1, len(gpus)))  # ceil
    return gpu_id, round(settings.gpu_memory_utilization / per_gpu, 3)
