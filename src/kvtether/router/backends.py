"""The vLLM instances behind the router and how one is picked for each leg of a turn."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

import httpx

from kvtether.router._errors import RouterHTTPError
from kvtether.router.settings import RouterSettings

logger = logging.getLogger(__name__)

__all__ = ["Backend", "BackendPool", "BackendStalledError", "Slot", "watch"]

T = TypeVar("T")

# After a connection failure an instance is skipped for this long (then tried again).
_DOWN_BACKOFF_S = 2.0


@dataclass(eq=False)
class Backend:
    name: str
    role: str  # "prefill" | "decode"
    url: str
    control_url: str | None
    client: httpx.AsyncClient
    # Requests in flight here, and the prompt backlog below: changed only through
    # :meth:`slot` / :meth:`prompt_work`, whose :class:`Slot` gives back what it took.
    inflight: int = 0
    # Prompt tokens this router sent here that have not produced their first token yet: a
    # prefill instance's legs in flight, a decode instance's local-prefill turns. The queue of
    # prompt work ahead of the next turn, as far as this router knows (``_prefills_locally``).
    prompt_backlog_tokens: int = 0
    retained_tokens: int = 0
    down_until_monotonic_s: float = 0.0
    last_error: str | None = None
    served_models: list[str] = field(default_factory=list)
    # Set while the instance's connector reports an engine step that has waited for its
    # worker longer than the router's stall_after_s (a frozen worker); see :func:`watch`.
    stalled_step_s: float | None = None
    _stall: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def slot(self, prompt_tokens: int = 0) -> Slot:
        """One request in flight here, with the ``prompt_tokens`` it computes counted in the
        prompt backlog until :meth:`Slot.prompt_computed` or :meth:`Slot.release`."""
        return Slot(self, inflight=1, prompt_tokens=prompt_tokens)

    def prompt_work(self, prompt_tokens: int) -> Slot:
        """Prompt tokens a request will compute here, counted before it is sent (a decode
        instance's local prefill, while the decode leg opens)."""
        return Slot(self, inflight=0, prompt_tokens=prompt_tokens)

    @property
    def available(self) -> bool:
        return self.stalled_step_s is None and time.monotonic() >= self.down_until_monotonic_s

    def mark_down(self, error: str) -> None:
        if time.monotonic() >= self.down_until_monotonic_s:
            logger.warning("%s %s unreachable: %s", self.role, self.name, error)
        self.down_until_monotonic_s = time.monotonic() + _DOWN_BACKOFF_S
        self.last_error = error

    def mark_up(self) -> None:
        self.down_until_monotonic_s = 0.0
        self.last_error = None

    def mark_stalled(self, step_s: float) -> bool:
        """The engine's step has waited ``step_s`` for its worker: give up on every call in
        flight on this instance (:func:`watch`) and send it nothing new until it steps again.
        True when it was not stalled before."""
        first = self.stalled_step_s is None
        if first:
            logger.warning("%s %s stalled: its engine step has waited %.0f s for its worker; "
                           "its legs in flight are given up, no new ones go to it",
                           self.role, self.name, step_s)
            self._stall.set()
        self.stalled_step_s = step_s
        return first

    def mark_stepping(self) -> None:
        """The engine steps again (or never stalled)."""
        if self.stalled_step_s is not None:
            logger.warning("%s %s steps again", self.role, self.name)
            self._stall = asyncio.Event()
        self.stalled_step_s = None

    async def watch_lines(self, lines: AsyncIterator[str]) -> AsyncIterator[str]:
        """``lines`` (a streamed leg's), ending with :class:`BackendStalledError` if the instance
        stalls while it streams.

        One task per stream reads ``lines`` into a small queue; a stall cancels that task
        (closing the leg, so vLLM aborts it) and wakes the reader here. Per line that costs a
        queue hand-off, not a task.
        """
        queue: asyncio.Queue[object] = asyncio.Queue(maxsize=_LINE_QUEUE)
        stalled = False

        async def pump() -> None:
            try:
                async for line in lines:
                    await queue.put(line)
                await queue.put(_END)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # the leg failed: the reader raises it
                await queue.put(_Failed(exc))

        def on_stall(_: asyncio.Future[object]) -> None:
            nonlocal stalled
            stalled = True
            reader.cancel()
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(_END)

        reader = asyncio.ensure_future(pump())
        stall = asyncio.ensure_future(self._stall.wait())
        stall.add_done_callback(on_stall)
        try:
            while True:
                item = await queue.get()
                if stalled:
                    raise BackendStalledError(self)
                if item is _END:
                    return
                if isinstance(item, _Failed):
                    raise item.exc
                yield item  # type: ignore[misc]
        finally:
            stall.remove_done_callback(on_stall)
            stall.cancel()
            if not reader.done():
                reader.cancel()
                with contextlib.suppress(BaseException):
                    await reader


class Slot:
    """A request's share of a backend's load counts (``inflight``, ``prompt_backlog_tokens``),
    taken when made and given back exactly once: by :meth:`release` (idempotent), at the end
    of a ``with`` block, or, for the backlog alone, by :meth:`prompt_computed`. A stream that
    outlives the function that opened it carries its slot and releases it when it ends."""

    __slots__ = ("backend", "_inflight", "_prompt_tokens")

    def __init__(self, backend: Backend, *, inflight: int, prompt_tokens: int) -> None:
        self.backend = backend
        self._inflight = inflight
        self._prompt_tokens = prompt_tokens
        backend.inflight += inflight
        backend.prompt_backlog_tokens += prompt_tokens

    def prompt_computed(self) -> None:
        """The request's prompt is computed (its first token came): drop its backlog."""
        self.backend.prompt_backlog_tokens -= self._prompt_tokens
        self._prompt_tokens = 0

    def release(self) -> None:
        self.prompt_computed()
        self.backend.inflight -= self._inflight
        self._inflight = 0

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


_LINE_QUEUE = 64  # lines read ahead of the relay, at most
_END = object()


@dataclass(frozen=True)
class _Failed:
    exc: BaseException


class BackendStalledError(RouterHTTPError):
    """An instance's engine step has waited for its worker past the router's
    ``stall_after_s``: a frozen worker, whose calls would otherwise hang until vLLM's own
    300 s RPC timeout ends the engine."""

    def __init__(self, backend: Backend) -> None:
        waited = backend.stalled_step_s
        super().__init__(
            503, f"{backend.role} instance {backend.name} is stalled (its engine step has "
                 f"waited {waited or 0:.0f} s for its worker); retry shortly",
            code="upstream_stalled")
        self.backend = backend


async def watch(call: Awaitable[T], *backends: Backend | None) -> T:
    """Await ``call``; if any of ``backends`` is or becomes stalled first, cancel it (vLLM
    aborts a request whose connection closes) and raise that instance's
    :class:`BackendStalledError`. Several: a leg that waits on the instance it runs on and on the
    one whose KV it reads (a frozen worker does not serve NIXL reads of its KV either)."""
    watched = [b for b in backends if b is not None]
    for b in watched:
        if b.stalled_step_s is not None:
            if asyncio.iscoroutine(call):
                call.close()
            raise BackendStalledError(b)
    task = asyncio.ensure_future(call)
    stalls = {asyncio.ensure_future(b._stall.wait()): b for b in watched}
    try:
        await asyncio.wait({task, *stalls}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in stalls:
            waiter.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        stalled = next((b for b in watched if b.stalled_step_s is not None), watched[0])
        raise BackendStalledError(stalled)
    return task.result()


KEEPALIVE_EXPIRY_S = 2.0


class BackendPool:
    """Prefill instances are picked by load; decode instances by conversation affinity.

    Load: a prefill instance's prompt backlog, then its requests in flight; a decode
    instance's requests in flight (queue depth), then its retained KV tokens, for a
    conversation that has no instance yet. Ties go round-robin, each role with its own
    rotation (with one counter advanced by both roles in turn, every decode tie could land on
    the same instance).
    """

    def __init__(
        self, settings: RouterSettings, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        timeout = httpx.Timeout(
            settings.upstream_timeout_s, connect=settings.upstream_connect_timeout_s
        )
        # Idle connections are dropped before vLLM's server drops them (uvicorn's keep-alive,
        # VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default, like httpx's own expiry): with equal
        # timers a request could go out on a connection the server was closing (ReadError, 502).
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100,
                              keepalive_expiry=KEEPALIVE_EXPIRY_S)

        def make(role: str, urls: list[str], controls: list[str]) -> list[Backend]:
            out = []
            for i, url in enumerate(urls):
                url = url.rstrip("/")
                out.append(
                    Backend(
                        name=f"{role}-{i}",
                        role=role,
                        url=url,
                        control_url=controls[i].rstrip("/") if i < len(controls) else None,
                        client=httpx.AsyncClient(
                            base_url=url, timeout=timeout, limits=limits, transport=transport
                        ),
                    )
                )
            return out

        self.prefill = make("prefill", settings.prefill_urls, settings.prefill_control_urls)
        self.decode = make("decode", settings.decode_urls, settings.decode_control_urls)
        self._tie_rotation = {"prefill": 0, "decode": 0}
        self._decode_rr = 0

    @property
    def all(self) -> list[Backend]:
        return [*self.prefill, *self.decode]

    def by_name(self, name: str | None) -> Backend | None:
        return next((b for b in self.all if b.name == name), None)

    def _least_loaded(self, backends: list[Backend], key) -> Backend | None:
        if not backends:
            return None
        # All marked down: try anyway (the soonest to come back first, stalled last) rather
        # than refuse; a stalled one answers at once (watch).
        live = [b for b in backends if b.available] or sorted(
            backends, key=lambda b: (b.stalled_step_s is not None, b.down_until_monotonic_s)
        )[:1]
        role = backends[0].role
        self._tie_rotation[role] += 1
        # Rotate first so ties are broken round-robin.
        k = self._tie_rotation[role] % len(live)
        live = live[k:] + live[:k]
        return min(live, key=key)

    def pick_prefill(self, exclude: set[str] = frozenset()) -> Backend | None:  # type: ignore[assignment]
        return self._least_loaded(
            [b for b in self.prefill if b.name not in exclude],
            # Prompt tokens in flight first: one long first turn is more work than two short
            # legs (the same measure local prefill balances by); then the number of legs.
            key=lambda b: (b.prompt_backlog_tokens, b.inflight),
        )

    def pick_decode(self, preferred: str | None, exclude: set[str] = frozenset()) -> Backend | None:  # type: ignore[assignment]
        pref = self.by_name(preferred)
        if pref is not None and pref.role == "decode" and pref.available and pref.name not in exclude:
            return pref
        return self._least_loaded(
            [b for b in self.decode if b.name not in exclude],
            # Queue depth first, so a burst of new conversations spreads at once (by retained
            # KV alone, a whole burst would go to the instance that happens to retain less);
            # retained tokens then spread what arrives while the instances are equally busy.
            key=lambda b: (b.inflight, b.retained_tokens),
        )

    def next_decode(self, exclude: frozenset[str] | set[str] = frozenset()) -> Backend | None:
        """Round-robin over reachable decode instances, no affinity (vLLM's example proxy)."""
        live = [b for b in self.decode if b.name not in exclude and b.available]
        if not live:
            return self.pick_decode(None, exclude)
        self._decode_rr += 1
        return live[(self._decode_rr - 1) % len(live)]

    async def check_health(self) -> dict[str, bool]:
        async def one(b: Backend) -> tuple[str, bool]:
            try:
                r = await b.client.get("/health", timeout=10.0)
                ok = r.status_code == 200
            except httpx.ConnectError as exc:  # refused: the process is gone
                b.mark_down(repr(exc))
                return b.name, False
            except httpx.HTTPError:
                # Slow is not down: a busy instance still holds its conversations' KV.
                return b.name, False
            if ok:
                b.mark_up()
            return b.name, ok and b.stalled_step_s is None  # a stalled engine answers nothing

        return dict(await asyncio.gather(*(one(b) for b in self.all)))

    async def aclose(self) -> None:
        await asyncio.gather(*(b.client.aclose() for b in self.all), return_exceptions=True)
