"""vLLM schedulers for engines that run the kvtether connector.

:class:`TetherScheduler` (``--scheduler-cls kvtether.connector.scheduler.TetherScheduler``)
schedules as upstream does and tells the connector what it cannot see from its hooks: when
each step begins and ends, and what the engine's prefix cache holds. kvtether's stack loads it
on every kvtether-connector engine that does not sleep (the ``gpu`` profile).

:class:`IdleSleepScheduler` (``--scheduler-cls kvtether.connector.scheduler.IdleSleepScheduler``,
kvtether's CPU profiles) adds: the engine sleeps while it only holds KV for a remote reader.
Why: in vLLM 0.32 a request whose blocks wait for a remote reader stays in
``Scheduler.requests``, so ``has_requests()`` stays true and ``EngineCore.run_busy_loop`` steps
every ~1 ms (schedule, an RPC to the worker, NIXL polling) for the whole time decode retains a
conversation's KV, and on prefill until decode has read it. On a CPU host that is a core per engine, stolen from the turns.

This scheduler reports no work when nothing else is left, so the engine blocks on its input
queue like an idle one; :class:`~kvtether.connector._idle.EngineWaker` wakes it for the steps
retained KV needs (lease renewals and releases from the control channel, deadlines, and a
slow housekeeping tick for NIXL notifications). Everything else is upstream's scheduler.

Both build their ``AsyncScheduler`` twin (``AsyncTetherScheduler``, ``AsyncIdleSleepScheduler``)
where vLLM would build ``AsyncScheduler``: vLLM uses a named class as given, and a ``Scheduler``
subclass loses async scheduling's overlap of one step's scheduling with the step before.

The upstream change that would make this unnecessary: an engine loop that waits (on its input
queue, with a timeout from the connector) when the only unfinished work is connector-held
blocks, plus a connector hook to wake it.
"""

from __future__ import annotations

import logging
import queue
import sys
from collections.abc import Callable
from typing import Any

from kvtether.connector._compat.upstream import (
    AsyncScheduler,
    EngineCoreRequestType,
    Scheduler,
    UnitaryKVCacheCoordinator,
    get_hash_fn_by_name,
    hash_block_tokens,
)
from kvtether.connector._idle import EngineWaker
from kvtether.connector.nixl import KVTetherScheduler
from kvtether.protocol import PrefixCacheAnswer

__all__ = ["IdleSleepScheduler", "TetherScheduler"]

logger = logging.getLogger(__name__)


class TetherScheduler(Scheduler):
    """Upstream's scheduler, plus what the kvtether connector cannot see from its own hooks:
    when each engine step begins and ends (the control channel's ``step_running_s``, which
    names a frozen worker) and a lookup in the engine's prefix cache (``POST
    /kvtether/v1/prefix-cache``). Scheduling itself is unchanged."""

    def __new__(cls, *args: Any, **kwargs: Any) -> TetherScheduler:
        # vLLM builds AsyncScheduler when async scheduling is on (its default) and resolves a
        # --scheduler-cls as given: a Scheduler subclass would lose the overlap of one step's
        # scheduling with the step before, which slows every turn. So the class named builds
        # its async twin where vLLM would.
        config = kwargs.get("vllm_config", args[0] if args else None)
        if (
            getattr(getattr(config, "scheduler_config", None), "async_scheduling", False)
            and not issubclass(cls, AsyncScheduler)
        ):
            cls = _async_twin(cls)
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        tether = getattr(self.connector, "connector_scheduler", None)
        self._steps = tether if isinstance(tether, KVTetherScheduler) else None
        logger.info("kvtether: %s on %s", type(self).__name__,
                    "async scheduling" if isinstance(self, AsyncScheduler) else
                    "synchronous scheduling")
        if self._steps is None:
            logger.warning("%s needs the kvtether connector "
                           "(kv_connector_module_path=kvtether.connector.nixl); it schedules "
                           "as upstream does", type(self).__name__)
        else:
            self._steps.attach_prefix_cache(self._prefix_cache_lookup())

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        output = super().schedule(*args, **kwargs)
        if self._steps is not None:
            self._steps.step_began()  # the engine core now sends this step to its worker
        return output

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        if self._steps is not None:
            self._steps.step_ended()
        return super().update_from_output(*args, **kwargs)

    def _prefix_cache_lookup(self) -> Callable[[list[int]], PrefixCacheAnswer | None]:
        """How many leading tokens of a sequence this engine's prefix cache holds: the router
        asks before it sends a conversation whose lease lapsed back to the decode instance
        that held it.

        Called on the control channel's thread, never the engine's: it only reads the block
        pool's hash map (single dict lookups), so a step running meanwhile may evict a block
        it counted. The answer is advice; what the turn reused is what vLLM reports after.
        """
        manager = self.kv_cache_manager
        if not manager.enable_caching or not isinstance(
            manager.coordinator, UnitaryKVCacheCoordinator
        ):
            return lambda token_ids: None  # no prefix cache, or a hybrid model: not looked up
        hash_fn = get_hash_fn_by_name(self.cache_config.prefix_caching_hash_algo)
        block_size = self.hash_block_size
        pool = manager.block_pool

        def lookup(token_ids: list[int]) -> PrefixCacheAnswer:
            parent = None
            cached = 0
            for start in range(0, len(token_ids) - block_size + 1, block_size):
                # The same chained hash vLLM gives a text-only request's block (no extra keys).
                parent = hash_block_tokens(hash_fn, parent, token_ids[start:start + block_size])
                try:
                    hit = pool.get_cached_block(parent, [0])
                except RuntimeError:  # the engine changed the map under this read
                    break
                if hit is None:
                    break
                cached += block_size
            return PrefixCacheAnswer(cached_tokens=cached, block_size=block_size)

        return lookup


class IdleSleepScheduler(TetherScheduler):
    """:class:`TetherScheduler`; an engine holding only remote-read KV sleeps until woken."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tether: KVTetherScheduler | None = None
        self._waker: EngineWaker | None = None
        tether = self._steps
        if tether is None:
            return
        inputs = _engine_input_queue()
        if inputs is None:
            logger.warning("IdleSleepScheduler: no engine input queue found (not built by "
                           "vLLM's EngineCoreProc); the engine steps while it holds KV")
            return

        def wake() -> None:
            inputs.put_nowait((EngineCoreRequestType.WAKEUP, None))

        self._tether = tether
        self._waker = EngineWaker(wake, tick_s=tether.settings.idle_tick_s).start()
        tether.attach_waker(self._waker)
        logger.info("kvtether: engine sleeps while it only holds KV for a remote reader "
                    "(housekeeping every %.1f s)", tether.settings.idle_tick_s)

    def has_requests(self) -> bool:
        if self._waker is None or self._tether is None:
            return super().has_requests()
        if (
            self.has_unfinished_requests()
            or self.finished_req_ids
            or (self.connector is not None and self.connector.has_pending_push_work())
            or (self.ec_connector is not None and self.ec_connector.has_pending_push_work())
        ):
            return True
        if not self.has_finished_requests():
            return False  # nothing held either: idle the ordinary way
        # Only finished requests whose blocks wait for a remote reader are left.
        return self._waker.step_requested() or self._tether.needs_step()

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if self._waker is not None:
            self._waker.take_step()
        output = super().schedule(*args, **kwargs)
        self._arm()
        return output

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        outputs = super().update_from_output(*args, **kwargs)
        self._arm()
        return outputs

    def _arm(self) -> None:
        if self._waker is not None and self._tether is not None:
            self._waker.arm(self._tether.next_deadline())

    def shutdown(self) -> None:
        if self._waker is not None:
            self._waker.close()
        super().shutdown()


_TWINS: dict[type, type] = {}


def _async_twin(cls: type) -> type:
    """``cls`` on top of vLLM's AsyncScheduler (MRO: cls, ..., AsyncScheduler, Scheduler)."""
    if cls not in _TWINS:
        _TWINS[cls] = type(f"Async{cls.__name__}", (cls, AsyncScheduler),
                           {"__module__": __name__, "__doc__": cls.__doc__})
    return _TWINS[cls]


def _engine_input_queue() -> queue.Queue[Any] | None:
    """The input queue of the ``EngineCoreProc`` constructing this scheduler (a caller frame).

    vLLM passes the scheduler no reference to its engine; the engine built it a few frames up.
    """
    from vllm.v1.engine.core import EngineCore

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, EngineCore):
            inputs = getattr(owner, "input_queue", None)
            return inputs if isinstance(inputs, queue.Queue) else None
        frame = frame.f_back
    return None
