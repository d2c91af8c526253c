"""The vLLM the connector builds on, and every private name of it the connector uses.

vLLM's NIXL pull connector keeps the state kvtether changes (which finished requests wait for
a remote reader, until when) in underscore attributes, and offers its hooks as underscore
methods. This module is the only place that touches them: :class:`PullScheduler` and
:class:`PullWorker` put them behind names kvtether owns, so the rest of the connector reads as
plain subclasses and a new vLLM is checked here (``nixl/pull_scheduler.py``,
``nixl/pull_worker.py`` and ``nixl/base_worker.py`` in vLLM's ``kv_connector/v1``).

Its first import is the version check: on another vLLM, importing this module raises
:class:`~kvtether.errors.VLLMVersionError` before it imports any of vLLM's internals.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtether.connector._compat import VLLM_VERSION

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPullConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    _KV_BLOCKS_EXPIRY_SAFETY_MARGIN,
    NixlPullConnectorWorker,
)
from vllm.distributed.nixl_utils import NixlWrapper
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator
from vllm.v1.core.kv_cache_utils import hash_block_tokens
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreRequestType

__all__ = [
    "AsyncScheduler",
    "EXPIRED_SEND_MESSAGE",
    "EngineCoreRequestType",
    "KVConnectorRole",
    "NixlBaseConnector",
    "NixlPullConnector",
    "NixlWrapper",
    "PullScheduler",
    "PullWorker",
    "READ_MARGIN_S",
    "Scheduler",
    "UPSTREAM_WORKER_LOGGER",
    "UnitaryKVCacheCoordinator",
    "VLLM_VERSION",
    "get_hash_fn_by_name",
    "hash_block_tokens",
]

# How close to a remote deadline the pull worker declines a read (seconds).
READ_MARGIN_S: float = _KV_BLOCKS_EXPIRY_SAFETY_MARGIN

# The worker logger that warns about every send-side deadline that passes, and that message.
UPSTREAM_WORKER_LOGGER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
EXPIRED_SEND_MESSAGE = "Releasing expired KV blocks"

class PullScheduler(NixlPullConnectorScheduler):
    """Upstream's pull scheduler, with the send-side state kvtether changes made public.

    ``_reqs_need_send`` (request id -> deadline of blocks held for a remote reader) rides to
    the worker as ``reqs_to_send`` at each step, and the worker overwrites its deadline for
    every request it holds; ``_reqs_in_batch`` makes the worker track a request for a reader.
    """

    def send_deadline(self, request_id: str) -> float | None:
        return self._reqs_need_send.get(request_id)

    def send_deadlines(self) -> Mapping[str, float]:
        """The deadlines the worker is sent at the next step (read-only view)."""
        return self._reqs_need_send

    def set_send_deadlines(self, deadlines: Mapping[str, float]) -> None:
        self._reqs_need_send.update(deadlines)

    def drop_send_deadline(self, request_id: str) -> None:
        self._reqs_need_send.pop(request_id, None)

    def track_for_reader(self, request_id: str) -> None:
        """Have the worker hold this request's blocks for a remote reader once it finishes."""
        self._reqs_in_batch.add(request_id)


class PullWorker(NixlPullConnectorWorker):
    """Upstream's pull worker; its private hooks call public ones subclasses override."""

    @property
    def lease_extension_s(self) -> float:
        """How far one heartbeat extends a remote hold (``kv_lease_duration * 2/3``)."""
        return float(self._lease_extension)

    def handshaken(self, engine_id: str) -> bool:
        """A NIXL handshake with ``engine_id`` is done (heartbeats to it are sent)."""
        return engine_id in self._remote_agents

    def clock_offset(self, engine_id: str) -> float:
        """``engine_id``'s ``perf_counter()`` minus this process's, from the handshake."""
        return float(self._engine_clock_offset[engine_id])

    def _send_heartbeats(self, metadata: Any) -> None:
        super()._send_heartbeats(metadata)
        self.heartbeats_sent(metadata)

    def _is_turn2_read_expired(self, meta: Any) -> bool:
        return self.late_read_expired(meta, super()._is_turn2_read_expired(meta))

    def heartbeats_sent(self, metadata: Any) -> None:
        """Called after upstream sent a step's heartbeats (``metadata.heartbeat_by_engine``)."""

    def late_read_expired(self, meta: Any, upstream_expired: bool) -> bool:
        """Whether to decline a read of a new turn's KV; ``upstream_expired`` is upstream's
        answer (``meta.remote.blocks_expiry_time`` is past, less :data:`READ_MARGIN_S`)."""
        return upstream_expired
