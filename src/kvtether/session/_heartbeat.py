"""Lease heartbeats while a tool runs: a daemon thread for sync code, a task for async code.

A heartbeat must never hurt the tool it accompanies: failures are logged once, counted, and
retried with exponential backoff; a 404, 409 (a router policy without leases) or 410 stops the
beats quietly (nothing left to keep); stopping never waits for more than one in-flight request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import httpx

from kvtether.protocol import HeartbeatResponse
from kvtether.session._records import EventKind, ToolRun

if TYPE_CHECKING:
    from kvtether.session._state import SessionState

__all__ = ["Beat", "HeartbeatPlan", "ThreadHeartbeat", "TaskHeartbeat"]

logger = logging.getLogger(__name__)


class Beat(Protocol):
    """A running heartbeat; stop() from sync code, astop() from async code."""

    def stop(self) -> None: ...

    async def astop(self) -> None: ...


_MIN_INTERVAL_S = 0.05  # a router reporting ~0 s left must not make us spin
_JOIN_TIMEOUT_S = 1.0  # stop() returns at once unless a heartbeat is in flight


class HeartbeatPlan:
    """What one tool run's heartbeats say, and how long to wait between them.

    Used by one heartbeat at a time; reads and reports through the session's ``SessionState``.
    """

    def __init__(self, state: SessionState, run: ToolRun, eta_s: float | None) -> None:
        self._state = state
        self._run = run
        self._eta_s = eta_s
        self._started_s = state.clock()
        self._failures = 0  # in a row; resets on success
        self.url = state.session_url("/heartbeat")

    def headers(self) -> dict[str, str]:
        return {"Content-Type": "application/json", **self._state.auth_headers()}

    @property
    def timeout_s(self) -> float:
        """How long one heartbeat waits for its answer: ``request_timeout_s``, or up to the
        heartbeat interval when that is longer. Nobody waits on a heartbeat (it runs beside
        the tool), and a loaded router answers late, not never: the renewal waits for decode's
        next engine step, which a step with prefill work in it can hold for seconds. One
        heartbeat at a time is in flight either way."""
        settings = self._state.settings
        return max(settings.request_timeout_s, settings.heartbeat_interval_s)

    @property
    def wanted(self) -> bool:
        return self.url is not None and self._state.has_lease

    def body(self) -> bytes | None:
        """The next heartbeat's JSON, or None when there is no lease to keep."""
        if self.url is None:
            return None
        elapsed_s = self._state.clock() - self._started_s
        request = self._state.heartbeat_request(self._run, elapsed_s=elapsed_s, eta_s=self._eta_s)
        return None if request is None else request.model_dump_json(exclude_none=True).encode()

    def on_response(self, status_code: int, content: bytes) -> float | None:
        """Seconds until the next heartbeat, or None to stop."""
        state = self._state
        if status_code == 200:
            try:
                remaining_s = HeartbeatResponse.model_validate_json(content).lease_remaining_s
            except ValueError:
                return self._failed("unreadable heartbeat response")
            state.heartbeat_renewed(self._run, remaining_s)
            self._failures = 0
            interval_s = state.settings.heartbeat_interval_s
            return max(_MIN_INTERVAL_S, min(interval_s, remaining_s / 3))
        if status_code == 404:
            state.lose_lease(EventKind.LEASE_NOT_FOUND, "router holds no lease", kv_gone=False)
            return None
        if status_code == 410:
            state.lose_lease(EventKind.KV_GONE, "KV released, evicted or expired", kv_gone=True)
            return None
        if status_code == 409:
            # The router's reuse policy keeps no leases (upstream, off): nothing to renew.
            state.lose_lease(EventKind.LEASE_NOT_FOUND, "router keeps no leases", kv_gone=False)
            return None
        if 400 <= status_code < 500 and status_code != 429:
            detail = content[:200].decode(errors="replace")
            state.record(EventKind.HEARTBEAT_REJECTED, f"HTTP {status_code}: {detail}")
            state.warn_once(
                "heartbeat_rejected",
                "router rejected a heartbeat (HTTP %s): %s",
                status_code,
                detail,
            )
            return None
        return self._failed(f"HTTP {status_code}")

    def on_error(self, exc: BaseException) -> float:
        return self._failed(f"{type(exc).__name__}: {exc}")

    def _failed(self, detail: str) -> float:
        self._state.heartbeat_failed(self._run, detail, first=self._failures == 0)
        self._failures += 1
        settings = self._state.settings
        return min(
            settings.heartbeat_interval_s * 2.0**self._failures, settings.max_heartbeat_backoff_s
        )


class ThreadHeartbeat:
    """Beats from a daemon thread: works whatever the tool does, even block an event loop."""

    def __init__(self, plan: HeartbeatPlan, client: Callable[[], httpx.Client], name: str):
        self._plan = plan
        self._client = client
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            self._beat()
        except Exception:  # noqa: BLE001 - a heartbeat bug must not surface in the agent
            logger.debug("kvtether heartbeat thread stopped on an error", exc_info=True)

    def _beat(self) -> None:
        delay_s: float | None = 0.0
        while delay_s is not None and not self._stop.wait(delay_s):
            body = self._plan.body()
            if body is None or self._plan.url is None:
                return
            try:
                response = self._client().post(
                    self._plan.url, content=body, headers=self._plan.headers(),
                    timeout=self._plan.timeout_s,
                )
            except (httpx.HTTPError, RuntimeError) as exc:  # RuntimeError: client closed
                delay_s = self._plan.on_error(exc)
            else:
                delay_s = self._plan.on_response(response.status_code, response.content)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(_JOIN_TIMEOUT_S)

    async def astop(self) -> None:
        self.stop()


class TaskHeartbeat:
    """Beats from an asyncio task next to an async tool; cancelled (mid-request) on stop."""

    def __init__(self, plan: HeartbeatPlan, client: Callable[[], httpx.AsyncClient], name: str):
        self._plan = plan
        self._client = client
        self._task = asyncio.get_running_loop().create_task(self._main(), name=name)

    async def _main(self) -> None:
        try:
            await self._beat()
        except Exception:  # noqa: BLE001 - a heartbeat bug must not surface in the agent
            logger.debug("kvtether heartbeat task stopped on an error", exc_info=True)

    async def _beat(self) -> None:
        delay_s: float | None = 0.0
        while delay_s is not None:
            if delay_s:
                await asyncio.sleep(delay_s)
            body = self._plan.body()
            if body is None or self._plan.url is None:
                return
            try:
                response = await self._client().post(
                    self._plan.url, content=body, headers=self._plan.headers(),
                    timeout=self._plan.timeout_s,
                )
            except (httpx.HTTPError, RuntimeError) as exc:
                delay_s = self._plan.on_error(exc)
            else:
                delay_s = self._plan.on_response(response.status_code, response.content)

    def stop(self) -> None:
        self._task.cancel()

    async def astop(self) -> None:
        self._task.cancel()
        # wait(), not await: the tool's own cancellation must still reach the caller.
        await asyncio.wait({self._task})
