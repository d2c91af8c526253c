"""Worker-process settings that stop NIXL and vLLM's RPC queue from busy-polling an idle host.

Both are reached through the only seams available in nixl 1.5.1 / vLLM 0.32.0, and both are
off unless the connector's ``kv_connector_extra_config`` turns them on (kvtether's CPU stack
profiles do; see :mod:`kvtether.stack.profiles`):

* **NIXL's progress thread** (``kvtether_progress_thread_delay_us``). nixl's Python agent
  hard-codes ``nixlAgentConfig.pthrDelay = 0``: the UCX progress thread then calls
  ``poll(fds, n, 0)`` in a loop, a full core per process. With a delay it waits up to that long
  in ``poll`` on UCX's wake-up fd and still wakes at once on an event. The field is writable on
  the binding's config, so while vLLM's worker builds its agent, :func:`progress_thread_delay`
  hands nixl a binding whose ``nixlAgent`` sets it first. Upstream fix that makes this
  unnecessary: a ``pthrDelay`` field on ``nixl_agent_config`` and a vLLM
  ``kv_connector_extra_config`` key that forwards it.
* **vLLM's shared-memory RPC queue** (``kvtether_rpc_busy_loop_s``). Each reader spins on
  ``sched_yield`` for 1 s (``SpinCondition.busy_loop_s``) after every message before it
  blocks: the worker waiting for the next step (a sleeping engine's occasional step would keep
  it spinning), and the engine core waiting for the worker's result of each step (under load it
  never stops: a core-share taken from the workers). :func:`shorten_rpc_spin` lowers that
  window on a process's readers: the worker's (the connector's worker side) and the engine
  core's (its scheduler side). Upstream fix: make ``busy_loop_s`` a setting.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator
from typing import Any

__all__ = ["progress_thread_delay", "shorten_rpc_spin"]

logger = logging.getLogger(__name__)


class _DelayedBinding:
    """nixl's binding module, except that agents get a non-zero progress-thread delay."""

    def __init__(self, binding: Any, delay_us: int) -> None:
        self._binding, self._delay_us = binding, delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._binding, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 (nixl's name)
        config.pthrDelay = self._delay_us
        logger.info("NIXL agent %s: progress thread waits up to %d us for events",
                    name, self._delay_us)
        return self._binding.nixlAgent(name, config)


@contextlib.contextmanager
def progress_thread_delay(agent_cls: Any, delay_us: int | None) -> Iterator[None]:
    """While active, NIXL agents built by ``agent_cls`` (nixl's ``nixl_agent``) get
    ``pthrDelay = delay_us``. ``None`` leaves nixl's behaviour alone."""
    if delay_us is None:
        yield
        return
    namespace = getattr(getattr(agent_cls, "__init__", None), "__globals__", None)
    binding = namespace.get("nixlBind") if namespace else None
    if binding is None or not hasattr(binding, "nixlAgentConfig"):
        logger.warning("cannot set the NIXL progress-thread delay: %r builds agents without "
                       "a nixlBind module; its progress thread will busy-poll", agent_cls)
        yield
        return
    assert namespace is not None
    namespace["nixlBind"] = _DelayedBinding(binding, delay_us)
    try:
        yield
    finally:
        namespace["nixlBind"] = binding


def shorten_rpc_spin(busy_loop_s: float | None) -> int:
    """Lower the spin window of this process's shared-memory RPC readers; returns how many.

    Call it once the process's queues exist: the KV connector is built after them, in the
    worker (its worker side) and in the engine core (its scheduler side).
    """
    if busy_loop_s is None:
        return 0
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:  # pragma: no cover - another vLLM layout; _compat pins the version
        return 0
    # type(), not isinstance(): some objects in a torch process raise from ``__class__``.
    readers = [
        obj for obj in gc.get_objects()
        if issubclass(type(obj), SpinCondition) and getattr(obj, "is_reader", False)
    ]
    for reader in readers:
        reader.busy_loop_s = min(reader.busy_loop_s, busy_loop_s)
    if readers:
        logger.info("vLLM RPC queue: %d reader(s) spin at most %.3f s before blocking",
                    len(readers), busy_loop_s)
    return len(readers)
