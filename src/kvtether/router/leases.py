"""Client of the kvtether connector's control channel on each vLLM instance.

Instances without a control URL run the upstream NIXL connector: their KV is held for vLLM's
fixed ``decoder_kv_blocks_ttl`` and nothing here can renew or release it, so every call is a
no-op that says so in its return value.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

import httpx

from kvtether.protocol import CONTROL_API_PREFIX as _PREFIX
from kvtether.protocol import LeaseInfo, PrefixCacheAnswer
from kvtether.router.backends import Backend

logger = logging.getLogger(__name__)

__all__ = ["LeaseClient", "RenewResult", "RenewStatus"]


class RenewStatus(str, enum.Enum):
    """What D said to a lease renewal."""

    RENEWED = "renewed"
    GONE = "gone"  # D no longer holds the KV
    UNREACHABLE = "unreachable"  # not renewed; D may still hold it
    UNSUPPORTED = "unsupported"  # no connector on D: vLLM's fixed TTL applies


@dataclass(frozen=True)
class RenewResult:
    status: RenewStatus
    lease: LeaseInfo | None = None  # with RENEWED: D's new deadline and handle expiry


class LeaseClient:
    def __init__(
        self, timeout_s: float = 30.0, handle_wait_s: float = 15.0,
        control_secret: str | None = None,
    ) -> None:
        self._timeout_s = timeout_s
        self._handle_wait_s = handle_wait_s
        # The connectors' shared secret (KVTETHER_CONTROL_SECRET), sent on every call.
        self._headers = {"Authorization": f"Bearer {control_secret}"} if control_secret else {}

    async def step_running_s(self, backend: Backend) -> tuple[bool, float | None]:
        """How long the instance's engine step in flight has waited for its worker, from its
        connector's status: (known, seconds or None between steps). Not known: no control
        channel, or it did not answer."""
        if not backend.control_url:
            return False, None
        try:
            r = await backend.client.get(f"{backend.control_url}{_PREFIX}/status",
                                         headers=self._headers, timeout=5.0)
            if r.status_code != 200:
                return False, None
            value = r.json().get("step_running_s")
        except (httpx.HTTPError, ValueError, AttributeError):
            return False, None
        return True, float(value) if isinstance(value, (int, float)) else None

    async def fetch_handle(self, decode: Backend, key: str | None) -> dict[str, Any] | None:
        """D's handle for a streamed turn (vLLM does not put it in the stream)."""
        if not decode.control_url or not key:
            return None
        url = f"{decode.control_url}{_PREFIX}/handles/{key}"
        try:
            r = await decode.client.get(
                url,
                params={"wait_s": self._handle_wait_s},
                headers=self._headers,
                timeout=self._timeout_s + self._handle_wait_s,
            )
        except httpx.HTTPError as exc:
            logger.warning("handle fetch from %s failed: %r", decode.name, exc)
            return None
        if r.status_code != 200:
            _check_refused(decode, r)
            logger.info("no handle published on %s for %s (HTTP %s)", decode.name, key, r.status_code)
            return None
        return r.json().get("kv_transfer_params") or r.json()

    async def renew(self, decode: Backend, key: str | None, ttl_s: float) -> RenewResult:
        """Extend the lease on D to now + ``ttl_s``."""
        if not decode.control_url or not key:
            return RenewResult(RenewStatus.UNSUPPORTED)
        try:
            r = await decode.client.post(
                f"{decode.control_url}{_PREFIX}/leases/{key}/renew",
                json={"ttl_s": ttl_s},
                headers=self._headers,
                timeout=self._timeout_s,
            )
        except httpx.HTTPError as exc:
            logger.warning("lease renew on %s failed: %r", decode.name, exc)
            return RenewResult(RenewStatus.UNREACHABLE)
        _check_refused(decode, r)
        if r.status_code in (404, 410):
            return RenewResult(RenewStatus.GONE)
        if r.status_code != 200:
            return RenewResult(RenewStatus.UNREACHABLE)
        try:
            return RenewResult(RenewStatus.RENEWED, LeaseInfo.model_validate(r.json()))
        except ValueError:
            return RenewResult(RenewStatus.UNREACHABLE)

    async def check(self, decode: Backend, key: str | None) -> RenewStatus:
        """Whether D still holds the lease (a read of its lease table; nothing changes).

        RENEWED here means "active"; UNSUPPORTED without a connector.
        """
        if not decode.control_url or not key:
            return RenewStatus.UNSUPPORTED
        try:
            r = await decode.client.get(f"{decode.control_url}{_PREFIX}/leases/{key}",
                                        headers=self._headers, timeout=self._timeout_s)
        except httpx.HTTPError as exc:
            logger.warning("lease check on %s failed: %r", decode.name, exc)
            return RenewStatus.UNREACHABLE
        _check_refused(decode, r)
        if r.status_code in (404, 410):
            return RenewStatus.GONE
        if r.status_code != 200:
            return RenewStatus.UNREACHABLE
        try:
            active = LeaseInfo.model_validate(r.json()).state == "active"
        except ValueError:
            return RenewStatus.UNREACHABLE
        return RenewStatus.RENEWED if active else RenewStatus.GONE

    async def cached_prefix(self, decode: Backend, token_ids: list[int]) -> int | None:
        """How many leading tokens of ``token_ids`` D's prefix cache holds now (whole blocks);
        None where D cannot tell (no control channel or scheduler, an error, no answer)."""
        if not decode.control_url or not token_ids:
            return None
        try:
            r = await decode.client.post(
                f"{decode.control_url}{_PREFIX}/prefix-cache", json={"token_ids": token_ids},
                headers=self._headers, timeout=min(self._timeout_s, 5.0),
            )
        except httpx.HTTPError as exc:
            logger.warning("prefix-cache lookup on %s failed: %r", decode.name, exc)
            return None
        _check_refused(decode, r)
        if r.status_code != 200:
            return None
        try:
            return PrefixCacheAnswer.model_validate(r.json()).cached_tokens
        except ValueError:
            return None

    async def release(self, decode: Backend, key: str | None) -> bool:
        if not decode.control_url or not key:
            return False
        try:
            # wait_s=0: answered as soon as decode has started the release, not once its worker
            # has freed the blocks, a step or two later: on a loaded decode that can outlast a
            # session client's 2 s timeout.
            r = await decode.client.delete(
                f"{decode.control_url}{_PREFIX}/leases/{key}", headers=self._headers,
                params={"wait_s": 0}, timeout=self._timeout_s,
            )
        except httpx.HTTPError as exc:
            logger.warning("lease release on %s failed: %r", decode.name, exc)
            return False
        _check_refused(decode, r)
        return r.status_code in (200, 202, 204)


def _check_refused(decode: Backend, r: httpx.Response) -> None:
    if r.status_code in (401, 403):
        logger.error("the control channel of %s refused the router (HTTP %s): its "
                     "KVTETHER_CONTROL_SECRET and the router's --control-secret differ",
                     decode.name, r.status_code)
