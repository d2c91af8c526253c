"""What a stack runs, where: one :class:`InstancePlan` per process, and the order they start in.

::

    prefill-i, decode-j (vLLM)   store (--store local)       base_port + k
    router                       or router-0 .. router-N-1   port, or port+1 .. port+N
    front (--routers > 1)                                    port

Engines and the local store start first, then the router replicas (which reach both), then the
front (which reaches the replicas): each phase waits for the previous one's health.
"""

from __future__ import annotations

from pathlib import Path

from kvtether.stack import _procs
from kvtether.stack._commands import InstancePlan
from kvtether.errors import ConfigError, PortInUseError
from kvtether.stack._state import Role
from kvtether.stack._store import find_store_server
from kvtether.stack.settings import LOCAL_STORE, StackSettings

__all__ = ["plan_processes", "start_phases", "check_ports", "store_url"]

# Started in this order, each phase healthy before the next.
_PHASES: tuple[tuple[Role, ...], ...] = (("prefill", "decode", "store"), ("router",), ("front",))


def store_url(settings: StackSettings) -> str | None:
    """The URL every router replica gets: ``--store`` itself, or the local server's."""
    if settings.store == LOCAL_STORE:
        return f"redis://127.0.0.1:{settings.local_store_port}/0"
    return settings.store


def plan_processes(
    settings: StackSettings, model_dir: Path, served: str, control_secret: str | None
) -> list[InstancePlan]:
    s = settings
    logs = Path(s.state_dir) / "logs"
    plans: list[InstancePlan] = []
    roles: list[tuple[Role, int]] = [("prefill", i) for i in range(s.prefill)]
    roles += [("decode", i) for i in range(s.decode)]
    gpu_share = _gpu_share(s)
    for index, (role, i) in enumerate(roles):
        plans.append(
            InstancePlan(
                name=f"{role}-{i}",
                role=role,
                host=s.host,
                port=s.vllm_port(index),
                log_path=logs / f"{role}-{i}.log",
                model_dir=model_dir,
                served_model_name=served,
                side_channel_port=s.side_channel_port(index),
                control_port=s.control_port(index) if s.connector == "kvtether" else None,
                control_secret=control_secret,
                gpu_id=s.gpu_ids[index % len(s.gpu_ids)] if s.gpu_ids else None,
                gpu_memory_utilization=gpu_share,
            )
        )
    if not s.start_router:
        return plans
    if s.store == LOCAL_STORE:
        find_store_server()  # no server installed: say how to get one before anything starts
        # Loopback only: the server has no password, and only this host's routers use it.
        plans.append(InstancePlan(
            name="store", role="store", host="127.0.0.1", port=s.local_store_port,
            log_path=logs / "store.log", data_dir=Path(s.state_dir) / "store",
        ))
    controls: dict[str, list[str]] = {"prefill": [], "decode": []}
    for p in plans:
        if p.control_port is not None:
            controls[p.role].append(f"http://{s.control_host}:{p.control_port}")
    ports = s.router_ports()
    for i, port in enumerate(ports):
        name = "router" if len(ports) == 1 else f"router-{i}"
        plans.append(
            InstancePlan(
                name=name,
                role="router",
                host=s.host,
                port=port,
                log_path=logs / f"{name}.log",
                model_dir=model_dir if s.router_tokenizer else None,
                prefill_urls=tuple(p.url for p in plans if p.role == "prefill"),
                decode_urls=tuple(p.url for p in plans if p.role == "decode"),
                prefill_control_urls=tuple(controls["prefill"]),
                decode_control_urls=tuple(controls["decode"]),
                control_secret=control_secret,
                store_url=store_url(s),
            )
        )
    if len(ports) > 1:
        plans.append(InstancePlan(
            name="front", role="front", host=s.host, port=s.port, log_path=logs / "front.log",
            upstream_urls=tuple(p.url for p in plans if p.role == "router"),
        ))
    return plans


def start_phases(plans: list[InstancePlan]) -> list[list[InstancePlan]]:
    """``plans`` grouped by start phase (empty phases left out)."""
    phases = [[p for p in plans if p.role in roles] for roles in _PHASES]
    return [phase for phase in phases if phase]


def check_ports(host: str, plans: list[InstancePlan]) -> None:
    """Every port a plan needs is distinct and free (else a clear error before any start)."""
    wanted: list[tuple[str, int, str]] = []
    for p in plans:
        wanted.append((p.host, p.port, f"{p.name} {'Redis' if p.role == 'store' else 'HTTP'}"))
        if p.side_channel_port is not None:
            wanted.append((host, p.side_channel_port, f"{p.name} NIXL side channel"))
        if p.control_port is not None:
            wanted.append((host, p.control_port, f"{p.name} kvtether control"))
    seen: dict[int, str] = {}
    for bind_host, port, purpose in wanted:
        if port in seen:
            raise ConfigError(f"port {port} is assigned twice ({seen[port]} and {purpose})")
        seen[port] = purpose
        if _procs.port_in_use(bind_host, port):
            raise PortInUseError(bind_host, port, purpose)


def _gpu_share(settings: StackSettings) -> float | None:
    """Each instance's --gpu-memory-utilization when several share one GPU."""
    if settings.gpu_memory_utilization is None:
        return None
    gpus = max(1, len(settings.gpu_ids))
    per_gpu = -(-settings.instance_count // gpus)  # ceil
    return round(settings.gpu_memory_utilization / per_gpu, 3)
