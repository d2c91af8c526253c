"""vLLM's own router (PyPI ``vllm-router``), started and stopped like every stack process.

``colocated-dp`` puts it in front of colocated vLLM replicas, as a user spreading
conversations over replicas would deploy it: its ``consistent_hash`` policy keyed on the
:data:`SESSION_HEADER` the bench's client sends with each conversation's id, so a conversation
stays on one replica and its prefix cache. vllm-router 0.1.17 hashes the first of the headers
``x-session-id``, ``x-user-id``, ``x-tenant-id``, ``x-correlation-id``, ``x-request-id``,
``x-trace-id`` a request carries, then the body's ``session_params.session_id``, ``user``,
``session_id``, ``user_id``; with none of them, the request body, which changes every turn.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvtether.errors import ConfigError, PortInUseError
from kvtether.stack import _procs
from kvtether.stack._health import Starting, wait_healthy

__all__ = ["POLICY", "SESSION_HEADER", "require_vllm_router", "router_argv",
           "start_vllm_router"]

SESSION_HEADER = "X-Session-ID"
POLICY = "consistent_hash"
MIN_VERSION = "0.1.17"


def require_vllm_router() -> None:
    """Raise :class:`~kvtether.errors.ConfigError` saying how to install it, if it is not."""
    if importlib.util.find_spec("vllm_router") is None:
        raise ConfigError(
            "vLLM's router is not installed (the colocated-dp baseline runs it): "
            f"pip install 'kvtether[bench]' or 'vllm-router>={MIN_VERSION}'"
        )


def router_argv(
    worker_urls: Sequence[str],
    *,
    host: str,
    port: int,
    metrics_port: int,
    policy: str = POLICY,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
    """``vllm-router``'s command line (its ``vllm_router.launch_router`` module)."""
    argv = [python, "-m", "vllm_router.launch_router", "--host", host, "--port", str(port)]
    if worker_urls:
        argv += ["--worker-urls", *worker_urls]
    argv += [
        "--policy", policy,
        # Its Prometheus endpoint is always on (default port 29000): one of ours instead.
        "--prometheus-host", host, "--prometheus-port", str(metrics_port),
        # The workers are healthy before it starts; its default 30 s between startup checks
        # would only delay the first turn.
        "--worker-startup-check-interval", "1",
    ]
    return argv + list(extra_args)


@contextmanager
def start_vllm_router(
    worker_urls: Sequence[str],
    *,
    host: str,
    port: int,
    metrics_port: int,
    log_path: Path,
    health_timeout_s: float,
    stop_timeout_s: float,
    policy: str = POLICY,
    extra_args: Sequence[str] = (),
) -> Iterator[str]:
    """Start vllm-router in front of ``worker_urls``; yield its URL once ``/health`` answers;
    stop it on exit (errors and Ctrl-C too). ``extra_args``: more of its flags (its P/D mode:
    ``--vllm-pd-disaggregation --prefill URL --decode URL``, with no ``worker_urls``)."""
    require_vllm_router()
    for wanted, purpose in ((port, "vllm-router HTTP"), (metrics_port, "vllm-router metrics")):
        if _procs.port_in_use(host, wanted):
            raise PortInUseError(host, wanted, purpose)
    argv = router_argv(worker_urls, host=host, port=port, metrics_port=metrics_port,
                       policy=policy, extra_args=extra_args)
    popen = _procs.spawn(argv, {"PYTHONUNBUFFERED": "1"}, log_path)
    created = _procs.create_time(popen.pid)
    url = f"http://{host}:{port}"
    try:
        wait_healthy([Starting("vllm-router", url, log_path, popen)], health_timeout_s)
        yield url
    finally:
        with _procs.signals_deferred():
            _procs.stop_group(popen.pid, created, stop_timeout_s)
