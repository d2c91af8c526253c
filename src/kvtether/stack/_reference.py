"""One colocated vLLM, no KV transfer: the correctness reference (prefix caching off) or, for
benchmarks, the simple colocated deployment (prefix caching on)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvtether.stack import _procs
from kvtether.stack._commands import CommandBuilder, InstancePlan, VllmCommands
from kvtether.errors import PortInUseError
from kvtether.stack._health import Starting, wait_healthy
from kvtether.stack.settings import StackSettings, resolve_model

__all__ = ["start_reference_vllm"]


@contextmanager
def start_reference_vllm(
    settings: StackSettings | None = None,
    port: int | None = None,
    *,
    commands: CommandBuilder | None = None,
    log_path: Path | None = None,
    prefix_caching: bool = False,
) -> Iterator[str]:
    """One colocated vLLM; yields its URL.

    ``prefix_caching`` False (the default): the correctness reference, every prompt computed.
    True: the simple colocated deployment, vLLM's prefix cache on. Both run with
    ``--enable-prompt-tokens-details``, so ``usage.prompt_tokens_details.cached_tokens``
    reports cache hits.
    """
    settings = settings or StackSettings()
    model_dir, served = resolve_model(settings)
    port = port or _procs.free_port(settings.host)
    if _procs.port_in_use(settings.host, port):
        raise PortInUseError(settings.host, port, "reference vLLM HTTP")
    plan = InstancePlan(
        name="reference",
        role="reference",
        host=settings.host,
        port=port,
        log_path=log_path or Path(settings.state_dir) / "logs" / f"reference-{port}.log",
        model_dir=model_dir,
        served_model_name=served,
        prefix_caching=prefix_caching,
    )
    cmd = (commands or VllmCommands()).command(plan, settings)
    popen = _procs.spawn(cmd.argv, cmd.env, plan.log_path)
    started = _procs.create_time(popen.pid)
    try:
        starting = Starting(plan.name, plan.url, plan.log_path, popen)
        wait_healthy([starting], settings.health_timeout_s)
        yield plan.url
    finally:
        with _procs.signals_deferred():
            _procs.stop_group(popen.pid, started, settings.stop_timeout_s)
