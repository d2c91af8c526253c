"""The conversation table in Redis (or Valkey): one table for several router replicas.

Keys, under ``store_key_prefix`` (``kvtether:``); a *member* is ``{tenant}:{conversation id}``
(tenant names have no ``:``)::

    c:{member}            hash: the conversation (_redis_codec), idle expiry (conversation_ttl_s)
    lock:{member}         the conversation's lock: the holder's fencing token, with an expiry
    rel:{member}          a release asked for while a turn held the conversation
    fence                 the fencing token counter (INCR)
    retained:decode       hash: retained tokens per decode instance
    retained:tenant       hash: retained tokens per tenant
    holding:{decode}      sorted set: conversations retaining KV on that instance
    leases                sorted set: conversations retaining KV, by lease deadline

A turn costs two round trips (lock + load in one script, save + accounting + unlock in
another); a holder past a third of the lock's expiry extends it from a watchdog task. A save
is fenced: refused when another holder has locked the conversation, or written it, since this
holder's token was issued. The scripts build some key names themselves: one Redis/Valkey
server (or a primary with replicas), not Redis Cluster.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvtether.router import _redis_lua as lua
from kvtether.router._redis_codec import FIELDS, dump, fields, load
from kvtether.router.conversations import (
    DEFAULT_MAX_TURN_RECORDS,
    Conversation,
    ConversationBusyError,
    HeldConversation,
    StoreFencedError,
    StoreUnavailableError,
)
from kvtether.router.tasks import TaskOwner

logger = logging.getLogger(__name__)

__all__ = ["RedisConversationStore"]

_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, OSError)


class _RedisHeld:
    """A conversation loaded under its lock (``busy``: a snapshot; another holder has it)."""

    def __init__(self, store: RedisConversationStore, conv: Conversation, token: int,
                 busy: bool, loaded: dict[bytes, bytes], partial: bool) -> None:
        self.conv = conv
        # What was read: a save writes only the fields that changed (and, after a partial
        # load, only fields it read).
        self.loaded = loaded
        self.partial = partial
        self.busy = busy
        self.writable = not busy
        self._store = store
        self._token = token
        self._done = busy
        self._watchdog: asyncio.Task[None] | None = None
        if not busy:
            self._watchdog = asyncio.get_running_loop().create_task(self._extend())

    async def _extend(self) -> None:
        """Keep the lock while a long (e.g. streamed) turn runs."""
        every_s = self._store.lock_ttl_s / 3
        while True:
            await asyncio.sleep(every_s)
            try:
                kept = await self._store._extend_lock(self.conv, self._token)
            except StoreUnavailableError:
                logger.warning("cannot extend the lock of %s: store unavailable",
                               self.conv.conversation_id)
                continue
            if not kept:
                logger.warning("lock of %s was lost (expired); this turn's save will be refused",
                               self.conv.conversation_id)
                return

    def _finish(self) -> None:
        self._done = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    async def commit(self, *, pending_release_ok: bool = False) -> bool:
        if self._done:
            return False
        try:
            code = await self._store._save(self, unlock="2" if pending_release_ok else "1")
        except BaseException:
            self._finish()
            raise
        if code == 2:
            return True
        self._finish()
        if code == -1:
            raise StoreFencedError(
                f"conversation {self.conv.conversation_id!r} was taken by a newer holder "
                f"after this one's lock expired; its state was not saved"
            )
        return False

    def commit_soon(self) -> None:
        if self._done:
            return
        self._store._tasks.start(self._commit_logged(), name="store commit")

    async def _commit_logged(self) -> None:
        try:
            # Nobody is here to free KV a release asked for: never leave the lock held.
            await self.commit(pending_release_ok=True)
        except Exception as exc:  # noqa: BLE001 - nothing waits for this task
            logger.warning("saving conversation %s failed: %r", self.conv.conversation_id, exc)


class RedisConversationStore:
    """:class:`~kvtether.router.conversations.ConversationStore` on a Redis/Valkey server.

    ``metrics`` (a :class:`~kvtether.router.metrics.RouterMetrics`) counts every round trip
    by operation and times it. Redis's ``maxmemory`` bounds the table (conversations also
    expire after ``conversation_ttl_s`` idle); ``max_conversations`` does not apply.
    """

    kind = "redis"

    def __init__(
        self, url: str, *, key_prefix: str = "kvtether:", conversation_ttl_s: float = 86400.0,
        lock_ttl_s: float = 10.0, timeout_s: float = 1.0,
        max_turn_records: int = DEFAULT_MAX_TURN_RECORDS, metrics: Any = None,
    ) -> None:
        self._r = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1), decode_responses=False,
        )
        self.url = url
        self.prefix = key_prefix
        self.conversation_ttl_ms = int(conversation_ttl_s * 1000)
        self.lock_ttl_s = lock_ttl_s
        self._lock_ttl_ms = max(1, int(lock_ttl_s * 1000))
        self._max_turn_records = max_turn_records
        self.metrics = metrics
        self._tasks = TaskOwner()  # commits nobody awaits (commit_soon)
        self._lock_script = self._r.register_script(lua.LOCK)
        self._save_script = self._r.register_script(lua.SAVE)
        self._extend_script = self._r.register_script(lua.EXTEND)

    # ---------------------------------------------------------------- plumbing
    def _keys(self, member: str) -> tuple[str, str, str]:
        p = self.prefix
        return f"{p}lock:{member}", f"{p}c:{member}", f"{p}rel:{member}"

    async def _call(self, op: str, coro: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await coro
        except _UNAVAILABLE as exc:
            raise StoreUnavailableError(f"conversation store {op}: {exc!r}") from None
        except RedisError as exc:
            if "LOADING" in str(exc) or "BUSY" in str(exc):
                raise StoreUnavailableError(f"conversation store {op}: {exc!r}") from None
            raise
        finally:
            if self.metrics is not None:
                self.metrics.store_ops.labels(op).inc()
                self.metrics.store_call_s.labels(op).observe(time.perf_counter() - t0)

    # ---------------------------------------------------------------- holding
    async def lock(
        self, conversation_id: str, tenant: str, *, wait_s: float
    ) -> HeldConversation:
        member = f"{tenant}:{conversation_id}"
        lock, conv_key, marker = self._keys(member)
        deadline = time.monotonic() + wait_s
        pause_s = 0.005
        while True:
            token, pttl_ms, data = await self._call("lock", self._lock_script(
                keys=[lock, conv_key, f"{self.prefix}fence", marker, f"{self.prefix}leases"],
                args=[self._lock_ttl_ms, "turn", self.conversation_ttl_ms, member],
            ))
            if token > 0:
                loaded = fields(data)
                conv = load(conversation_id, tenant, loaded, self._max_turn_records)
                return _RedisHeld(self, conv, int(token), busy=False, loaded=loaded,
                                  partial=False)
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise ConversationBusyError(conversation_id)
            await asyncio.sleep(min(pause_s, left_s, max(pttl_ms, 1) / 1000))
            pause_s = min(pause_s * 2, 0.1)

    async def try_lock(
        self, conversation_id: str, tenant: str, *, release_after_turn: bool = False
    ) -> HeldConversation | None:
        member = f"{tenant}:{conversation_id}"
        lock, conv_key, marker = self._keys(member)
        token, _, data = await self._call("try_lock", self._lock_script(
            keys=[lock, conv_key, f"{self.prefix}fence", marker, f"{self.prefix}leases"],
            args=[self._lock_ttl_ms, "mark" if release_after_turn else "try",
                  self.conversation_ttl_ms, member],
        ))
        if token < 0:
            return None
        # Busy and not yet saved: the conversation's first turn is in flight.
        loaded = fields(data)
        conv = load(conversation_id, tenant, loaded, self._max_turn_records)
        return _RedisHeld(self, conv, int(token), busy=token == 0, loaded=loaded, partial=True)

    async def _save(self, held: _RedisHeld, *, unlock: str) -> int:
        conv, token = held.conv, held._token
        member = f"{conv.tenant}:{conv.conversation_id}"
        lock, conv_key, marker = self._keys(member)
        p = self.prefix
        r = conv.retained
        args: list[Any] = [
            token, self.conversation_ttl_ms, member, conv.tenant, f"{p}holding:",
            r.decode_instance if r else "", r.retained_tokens if r else 0,
            repr(r.lease_deadline_unix_s) if r else 0, unlock, self._lock_ttl_ms,
        ]
        names = (FIELDS if not held.partial
                 else [f for f in FIELDS if f.encode() in held.loaded])
        changed = {name: value for name, value in dump(conv, names).items()
                   if held.loaded.get(name) != value}
        for name, value in changed.items():
            args += [name, value]
        code = int(await self._call("save", self._save_script(
            keys=[lock, conv_key, marker, f"{p}retained:decode", f"{p}retained:tenant",
                  f"{p}leases"],
            args=args,
        )))
        if code != -1:
            held.loaded.update(changed)  # what the store now holds
        return code

    async def _extend_lock(self, conv: Conversation, token: int) -> bool:
        lock, _, _ = self._keys(f"{conv.tenant}:{conv.conversation_id}")
        return bool(await self._call("extend", self._extend_script(
            keys=[lock], args=[token, self._lock_ttl_ms])))

    # ---------------------------------------------------------------- reading
    async def read(self, conversation_id: str, tenant: str) -> Conversation | None:
        _, conv_key, _ = self._keys(f"{tenant}:{conversation_id}")
        data = await self._call("read", self._r.hgetall(conv_key))
        return (load(conversation_id, tenant, fields(data), self._max_turn_records)
                if data else None)

    async def holders(self, decode_instance: str | None = None,
                      tenant: str | None = None) -> list[Conversation]:
        p = self.prefix
        if decode_instance is not None:
            members = await self._call("holders", self._r.zrange(
                f"{p}holding:{decode_instance}", 0, -1))
        else:
            members = await self._call("holders", self._r.zrange(f"{p}leases", 0, -1))
        keys = [m.decode() for m in members]
        if tenant is not None:
            keys = [m for m in keys if m.partition(":")[0] == tenant]
        if not keys:
            return []
        pipe = self._r.pipeline(transaction=False)
        for m in keys:
            pipe.hmget(f"{p}c:{m}", ["meta", "ret"])
        rows = await self._call("holders", pipe.execute())
        out = []
        for m, (meta, ret) in zip(keys, rows, strict=True):
            t, _, cid = m.partition(":")
            if meta is not None:
                data = {b"meta": meta, b"ret": ret or b""}
                conv = load(cid, t, data, self._max_turn_records)
                if conv.retained is not None and (
                        decode_instance is None
                        or conv.retained.decode_instance == decode_instance):
                    out.append(conv)
        return out

    async def lapsed(self, now_unix_s: float) -> list[tuple[str, str]]:
        members = await self._call("lapsed", self._r.zrangebyscore(
            f"{self.prefix}leases", "-inf", now_unix_s, start=0, num=1000))
        out = []
        for m in members:
            t, _, cid = m.decode().partition(":")
            out.append((t, cid))
        return out

    async def shared_counts(self) -> tuple[dict[str, int], dict[str, int]] | None:
        pipe = self._r.pipeline(transaction=False)
        pipe.hgetall(f"{self.prefix}retained:decode")
        pipe.hgetall(f"{self.prefix}retained:tenant")
        by_decode, by_tenant = await self._call("counts", pipe.execute())
        return ({k.decode(): int(v) for k, v in by_decode.items()},
                {k.decode(): int(v) for k, v in by_tenant.items() if int(v) > 0})

    async def check(self) -> bool:
        try:
            await self._call("ping", self._r.ping())
        except StoreUnavailableError:
            return False
        return True

    def count(self) -> int | None:
        return None

    async def aclose(self) -> None:
        # A commit still running past the lock's TTL would be fenced anyway.
        await self._tasks.drain(self.lock_ttl_s)
        await self._r.aclose()
