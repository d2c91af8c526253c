"""vLLM scheduler that lets an engine sleep while it only holds KV for a remote reader.

Load it with ``--scheduler-cls kvtether.connector.scheduler.IdleSleepScheduler`` next to the
kvtether connector (kvtether's CPU stack profiles do both). Why: in vLLM 0.32 a request whose
blocks wait for a remote reader stays in ``Scheduler.requests``, so ``has_requests()`` stays
true and ``EngineCore.run_busy_loop`` steps every ~1 ms (schedule, an RPC to the worker,
NIXL polling) for the whole time decode retains a conversation's KV, and on prefill until
decode has read it. On a CPU host that is a core per engine, stolen from the turns.

This scheduler reports no work when nothing else is left, so the engine blocks on its input
queue like an idle one; :class:`~kvtether.connector._idle.EngineWaker` wakes it for the steps
retained KV needs (lease renewals and releases from the control channel, deadlines, and a
slow housekeeping tick for NIXL notifications). Everything else is upstream's ``Scheduler``.

The upstream change that would make this unnecessary: an engine loop that waits (on its input
queue, with a timeout from the connector) when the only unfinished work is connector-held
blocks, plus a connector hook to wake it.
"""

from __future__ import annotations

import logging
import queue
import sys
from typing import Any

from kvtether.connector._compat import check_vllm_version

check_vllm_version()

from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import EngineCoreRequestType  # noqa: E402

from kvtether.connector._idle import EngineWaker  # noqa: E402
from kvtether.connector.nixl import KVTetherScheduler  # noqa: E402

__all__ = ["IdleSleepScheduler"]

logger = logging.getLogger(__name__)


class IdleSleepScheduler(Scheduler):
    """Upstream's scheduler; an engine holding only remote-read KV sleeps until woken."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tether: KVTetherScheduler | None = None
        self._waker: EngineWaker | None = None
        tether = getattr(self.connector, "connector_scheduler", None)
        # Step begin and end, for the control channel's step_running_s (a frozen worker).
        self._steps = tether if isinstance(tether, KVTetherScheduler) else None
        if not isinstance(tether, KVTetherScheduler):
            logger.warning("IdleSleepScheduler needs the kvtether connector "
                           "(kv_connector_module_path=kvtether.connector.nixl); the engine "
                           "will step while it holds KV, as upstream does")
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
        if self._steps is not None:
            self._steps.step_began()  # the engine core now sends this step to its worker
        self._arm()
        return output

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        if self._steps is not None:
            self._steps.step_ended()
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
