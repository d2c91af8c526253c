"""Start, watch and stop N prefill + M decode vLLM instances and the kvtether router.

::

    with Stack(StackSettings(profile="cpu-tiny")) as stack:
        client = openai.OpenAI(base_url=stack.router_url + "/v1", api_key="-")

``kvtether stack up|status|down`` is this module driven by the CLI; the state file lets a
second shell find and stop a stack that another process started.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from kvtether.errors import (
    ConfigError,
    InstanceFailedError,
    KVTetherError,
    StackAlreadyRunningError,
    StackError,
)
from kvtether.stack import _procs
from kvtether.stack._commands import CommandBuilder, InstancePlan, VllmCommands, host_cores
from kvtether.stack._control import (
    InstanceStatus,
    stack_down,
    stack_status,
    status_of,
    stop_records,
)
from kvtether.stack._health import Starting, wait_healthy
from kvtether.stack._plan import check_ports, plan_processes, start_phases
from kvtether.stack._reference import start_reference_vllm
from kvtether.stack._state import (
    ProcessRecord,
    StackState,
    load_state,
    remove_state,
    save_state,
)
from kvtether.stack._supervise import RestartPolicy, supervise
from kvtether.stack._warmup import WarmUpReport, warm_up
from kvtether.stack.settings import StackSettings, resolve_model

logger = logging.getLogger(__name__)

__all__ = [
    "InstanceStatus",
    "Stack",
    "resolve_model",
    "stack_down",
    "stack_status",
    "start_reference_vllm",
]


class Stack:
    """A P/D deployment owned by this process: ``up()`` starts it, ``down()`` stops it.

    - ``commands``: how each process is launched (default: real vLLM and ``kvtether router``);
      tests pass a builder that starts fakes.
    - ``progress``: show a live line per process while waiting for ``/health`` (rich).
    - ``die_with_parent``: the kernel SIGTERMs each instance if the *thread* that called
      ``up()`` dies without calling ``down()`` (e.g. SIGKILL). Use it from a main thread only,
      and never for a stack that should outlive this process.
    - ``owner_stops_on_sigterm``: this process stops the stack on SIGTERM (the foreground
      CLI does), so ``stack down`` from another shell asks it first instead of only stopping
      the instances under it.
    """

    def __init__(
        self,
        settings: StackSettings | None = None,
        *,
        commands: CommandBuilder | None = None,
        progress: bool = False,
        console: Any = None,
        die_with_parent: bool = False,
        owner_stops_on_sigterm: bool = False,
    ) -> None:
        self.settings = settings or StackSettings()
        self.commands = commands or VllmCommands()
        self.progress = progress
        self.console = console
        self.die_with_parent = die_with_parent
        self.owner_stops_on_sigterm = owner_stops_on_sigterm
        self.state_dir = Path(self.settings.state_dir)
        self.state: StackState | None = None
        self._plans: list[InstancePlan] = []
        self._running: list[Starting] = []
        self.warm_up_report: WarmUpReport | None = None
        self._control_secret: str | None = None

    # --- public surface ------------------------------------------------------------------
    @property
    def router_url(self) -> str:
        return f"http://{self.settings.host}:{self.settings.port}"

    @property
    def router_replica_urls(self) -> list[str]:
        """Each router process (one, or the replicas behind the front at ``router_url``)."""
        return [p.url for p in self._plans if p.role == "router"]

    @property
    def prefill_urls(self) -> list[str]:
        return [p.url for p in self._plans if p.role == "prefill"]

    @property
    def decode_urls(self) -> list[str]:
        return [p.url for p in self._plans if p.role == "decode"]

    @property
    def control_secret(self) -> str | None:
        """The control channels' shared secret (set by ``up()``; None for ``--connector nixl``)."""
        return self._control_secret

    @property
    def served_model_name(self) -> str:
        return self.state.served_model_name if self.state else ""

    def __enter__(self) -> Stack:
        if self.state is None:
            self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self, detach: bool | None = None) -> Stack:
        """Start everything and return once all of it answers ``/health``.

        On any failure (or Ctrl-C) while starting, stops what it started and re-raises.
        ``detach`` (default: the setting) only marks the stack as meant to outlive this
        process in the state file; stop it later with :func:`stack_down`.
        """
        detach = self.settings.detach if detach is None else detach
        _claim_state_dir(self.state_dir)
        client_key = _client_api_key(self.settings)  # a bad key file fails before any start
        if self.settings.connector == "kvtether":
            given = self.settings.control_secret
            self._control_secret = given.get_secret_value() if given else secrets.token_urlsafe(32)
        model_dir, served = resolve_model(self.settings)
        self._plans = plan_processes(self.settings, model_dir, served, self._control_secret)
        check_ports(self.settings.host, self._plans)
        warn_if_cores_shared(self.settings)
        self.state = StackState(
            detached=detach,
            owner_stops_on_sigterm=self.owner_stops_on_sigterm and not detach,
            owner_create_time=_procs.create_time(os.getpid()),
            model=str(model_dir),
            served_model_name=served,
        )
        t0 = time.monotonic()
        try:
            if self.settings.start_router:
                self.state.router_url = self.router_url
            for phase in start_phases(self._plans):
                self._wait([self._spawn(p) for p in phase])
            if self.settings.start_router and self.settings.warm_up:
                self._warm_up(served, client_key)
        except BaseException:
            self.down()
            raise
        self.state.phase = "running"
        save_state(self.state_dir, self.state)
        logger.info("stack healthy after %.1f s (%s)", time.monotonic() - t0, self.router_url)
        return self

    def wait(self, poll_s: float = 1.0) -> ProcessRecord:
        """Block until one of the stack's processes exits; return its record."""
        while True:
            for proc, record in zip(self._running, self._records(), strict=True):
                if proc.popen.poll() is not None:
                    return record
            time.sleep(poll_s)

    def supervise(self, stop: threading.Event | None = None,
                  say: Callable[[str], None] | None = None) -> None:
        """Restart any process that dies, with back-off, until ``stop`` is set.

        Raises :class:`~kvtether.stack._supervise.RestartsExhaustedError` when one keeps dying
        (see :mod:`kvtether.stack._supervise`); the caller then stops the stack.
        """
        supervise(self, RestartPolicy.from_settings(self.settings), stop=stop, say=say)

    # --- what the supervisor needs ------------------------------------------------------
    def dead_processes(self) -> list[int]:
        return [i for i, proc in enumerate(self._running) if proc.popen.poll() is not None]

    def process_name(self, index: int) -> str:
        return self._records()[index].name

    def exit_code(self, index: int) -> int | None:
        return self._running[index].popen.poll()

    def log_path(self, index: int) -> Path:
        return self._records()[index].log_path

    def respawn(self, index: int) -> float:
        """Start process ``index`` again (same ports, same command); wait for its health.

        Returns seconds until healthy. Once a restarted engine is healthy, waits for the router
        to take it back, then (with ``warm_up``) opens its NIXL links with throw-away turns.
        """
        assert self.state is not None
        record = self.state.processes[index]
        plan = next(p for p in self._plans if p.name == record.name)
        # What the dead process left behind (vLLM's engine core) still holds its ports.
        _procs.stop_group(record.pid, record.create_time, self.settings.stop_timeout_s)
        cmd = self.commands.command(plan, self.settings)
        with _procs.signals_deferred():
            popen = _procs.spawn(cmd.argv, cmd.env, plan.log_path, append=True,
                                 die_with_parent=self.die_with_parent)
            started = Starting(plan.name, plan.url, plan.log_path, popen)
            self._running[index] = started
            self.state.processes[index] = record.model_copy(
                update={"pid": popen.pid, "create_time": _procs.create_time(popen.pid)})
            save_state(self.state_dir, self.state)
        try:
            wait_healthy([started], self.settings.health_timeout_s)
        except InstanceFailedError:
            _procs.stop_group(popen.pid, self.state.processes[index].create_time,
                              self.settings.stop_timeout_s)
            raise
        assert started.healthy_after_s is not None
        s = self.settings
        if plan.role in ("prefill", "decode") and s.start_router and s.warm_up:
            if all(_router_admits(url, plan.name) for url in self.router_replica_urls):
                self._warm_up(self.served_model_name, _client_api_key(self.settings))
        return started.healthy_after_s

    def down(self) -> list[int]:
        """Stop everything this stack started; return pids that survived (should be none)."""
        if self.state is None:
            return []
        with _procs.signals_deferred():
            survivors = stop_records(self._records(), self.settings.stop_timeout_s)
            remove_state(self.state_dir)
        self._running.clear()
        self.state = None
        if survivors:
            raise StackError(f"processes survived shutdown: {survivors}; kill them by hand")
        return survivors

    def status(self) -> list[InstanceStatus]:
        return status_of(self._records())

    # --- internals -----------------------------------------------------------------------
    def _records(self) -> list[ProcessRecord]:
        return list(self.state.processes) if self.state else []

    def _spawn(self, plan: InstancePlan) -> Starting:
        assert self.state is not None
        cmd = self.commands.command(plan, self.settings)
        logger.debug("starting %s: %s", plan.name, " ".join(cmd.argv))
        popen = _procs.spawn(cmd.argv, cmd.env, plan.log_path, die_with_parent=self.die_with_parent)
        started = Starting(plan.name, plan.url, plan.log_path, popen)
        self._running.append(started)
        self.state.processes.append(
            ProcessRecord(
                name=plan.name,
                role=plan.role,
                url=plan.url,
                port=plan.port,
                pid=popen.pid,
                create_time=_procs.create_time(popen.pid),
                log_path=plan.log_path,
                side_channel_port=plan.side_channel_port,
                control_port=plan.control_port,
            )
        )
        # Record each pid as soon as it exists: `stack down` from another shell works mid-start.
        save_state(self.state_dir, self.state)
        return started

    def _warm_up(self, served: str, api_key: str | None) -> None:
        s = self.settings
        one_way = s.reuse_policy == "off"
        report = warm_up(self.router_url, served, conversations=s.prefill * s.decode,
                         max_turns=1 if one_way else 4,
                         max_tokens=s.kv_recompute_threshold_tokens + s.block_size_tokens,
                         timeout_s=s.health_timeout_s, api_key=api_key)
        self.warm_up_report = report
        outcomes = ", ".join(report.outcomes) or "no turn answered"
        if one_way:
            logger.info("warm-up: %d turn(s) in %.1f s, reuse policy off (%s)",
                        len(report.outcomes), report.seconds, outcomes)
        elif report.fired:
            logger.info("warm-up: KV reuse fired after %.1f s (%s)", report.seconds, outcomes)
        else:
            logger.warning("warm-up: no turn reused KV in %.1f s (%s); first turns may "
                           "recompute (see the instance logs)", report.seconds, outcomes)

    def _wait(self, procs: list[Starting]) -> None:
        timeout_s = self.settings.health_timeout_s
        wait_healthy(procs, timeout_s, progress=self.progress, console=self.console)


def warn_if_cores_shared(settings: StackSettings, cores: int | None = None) -> bool:
    """Warn when a CPU stack has more vLLM instances than the host has cores.

    Each CPU instance computes on one core (``_commands.cpu_core``); with more instances than
    cores two workers share one and each computes at most half the time. It still starts. (The
    stack runs as one scheduler autogroup, ``_procs.spawn``: with one per instance, shared
    cores made engine steps far slower than half speed; docs/decisions/one-autogroup.md.)
    """
    cores = cores or host_cores()
    instances = settings.prefill + settings.decode
    if settings.device != "cpu" or instances <= cores:
        return False
    logger.warning(
        "%dP+%dD is %d vLLM instances on %d cores: instances will share cores, two workers "
        "on one core each computing at most half the time; for the fastest turns run at most "
        "one instance per core (1P+1D on 2 cores)",
        settings.prefill, settings.decode, instances, cores,
    )
    return True


def _client_api_key(settings: StackSettings) -> str | None:
    """A key the stack's own warm-up turns can use: --api-key, else the key file's first."""
    if settings.api_key is not None:
        return settings.api_key.get_secret_value()
    if settings.api_key_file is not None:
        from kvtether.router.access import read_key_file

        try:
            return next(iter(read_key_file(settings.api_key_file)))
        except KVTetherError as exc:
            raise ConfigError(str(exc)) from None
    return None


def _router_admits(router_url: str, name: str, timeout_s: float = 30.0) -> bool:
    """Wait until the router's health check counts instance ``name`` healthy again."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            try:
                if client.get(f"{router_url}/health").json().get("backends", {}).get(name):
                    return True
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
    logger.warning("the router has not taken %s back after %.0f s", name, timeout_s)
    return False


def _claim_state_dir(state_dir: Path) -> None:
    state = load_state(state_dir)
    if state is None:
        return
    if any(_procs.is_alive(p.pid, p.create_time) for p in state.processes):
        raise StackAlreadyRunningError(state_dir)
    logger.info("removing stale state file of a stack that is gone (%s)", state_dir)
    remove_state(state_dir)
