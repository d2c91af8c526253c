"""The vLLM instances behind the router and how one is picked for each leg of a turn."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx

from kvtether.router.settings import RouterSettings

logger = logging.getLogger(__name__)

__all__ = ["Backend", "BackendPool"]

# After a connection failure an instance is skipped for this long (then tried again).
_DOWN_BACKOFF_S = 2.0


@dataclass(eq=False)
class Backend:
    name: str
    role: str  # "prefill" | "decode"
    url: str
    control_url: str | None
    client: httpx.AsyncClient
    inflight: int = 0
    retained_tokens: int = 0
    down_until_monotonic_s: float = 0.0
    last_error: str | None = None
    served_models: list[str] = field(default_factory=list)

    @property
    def available(self) -> bool:
        return time.monotonic() >= self.down_until_monotonic_s

    def mark_down(self, error: str) -> None:
        if self.available:
            logger.warning("%s %s unreachable: %s", self.role, self.name, error)
        self.down_until_monotonic_s = time.monotonic() + _DOWN_BACKOFF_S
        self.last_error = error

    def mark_up(self) -> None:
        self.down_until_monotonic_s = 0.0
        self.last_error = None


KEEPALIVE_EXPIRY_S = 2.0


class BackendPool:
    """Prefill instances are picked by load; decode instances by conversation affinity.

    Load: a prefill instance's requests in flight; a decode instance's requests in flight
    (queue depth), then its retained KV tokens, for a conversation that has no instance yet. Ties go
    round-robin, each role with its own rotation (one shared counter, advanced by prefill and
    decode picks in turn, gave every decode tie to the same instance).
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
        # All marked down: try anyway (the soonest to come back first) rather than refuse.
        live = [b for b in backends if b.available] or sorted(
            backends, key=lambda b: b.down_until_monotonic_s
        )[:1]
        role = backends[0].role
        self._tie_rotation[role] += 1
        # Rotate first so ties are broken round-robin.
        k = self._tie_rotation[role] % len(live)
        live = live[k:] + live[:k]
        return min(live, key=key)

    def pick_prefill(self, exclude: set[str] = frozenset()) -> Backend | None:  # type: ignore[assignment]
        return self._least_loaded(
            [b for b in self.prefill if b.name not in exclude], key=lambda b: b.inflight
        )

    def pick_decode(self, preferred: str | None, exclude: set[str] = frozenset()) -> Backend | None:  # type: ignore[assignment]
        pref = self.by_name(preferred)
        if pref is not None and pref.role == "decode" and pref.available and pref.name not in exclude:
            return pref
        return self._least_loaded(
            [b for b in self.decode if b.name not in exclude],
            # Queue depth first: a burst of new conversations spreads at once (retained KV
            # first sent a whole burst to the instance that happened to retain less); retained
            # tokens then spread what arrives while the instances are equally busy.
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
            return b.name, ok

        return dict(await asyncio.gather(*(one(b) for b in self.all)))

    async def aclose(self) -> None:
        await asyncio.gather(*(b.client.aclose() for b in self.all), return_exceptions=True)
