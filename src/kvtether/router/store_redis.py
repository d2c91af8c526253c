"""The conversation table in Redis (or Valkey): one table for several router replicas.

Keys, under ``store_key_prefix`` (``kvtether:``); a *member* is ``{tenant}:{conversation id}``
(tenant names have no ``:``)::

    c:{member}            hash: the conversation (see _dump); idle expiry store_conversation_ttl_s
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
import json
import logging
import time
from array import array
from collections import deque
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvtether.protocol import MissCause, Phase, TurnRecord
from kvtether.router.conversations import (
    DEFAULT_MAX_TURN_RECORDS,
    Conversation,
    ConversationBusyError,
    HeldConversation,
    RetainedKV,
    StoreFencedError,
    StoreUnavailableError,
)

logger = logging.getLogger(__name__)

__all__ = ["RedisConversationStore"]

_LOCK = """
-- A turn loads the whole conversation; a heartbeat, release or reap what leases need.
local function load()
  if ARGV[2] == 'turn' then return redis.call('HGETALL', KEYS[2]) end
  local out, names = {}, {'meta', 'ret', 'rtok'}
  local values = redis.call('HMGET', KEYS[2], unpack(names))
  for i, name in ipairs(names) do
    if values[i] then out[#out + 1] = name; out[#out + 1] = values[i] end
  end
  return out
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  if ARGV[2] == 'mark' then redis.call('SET', KEYS[4], '1', 'PX', ARGV[3]) end
  local data = {}
  if ARGV[2] ~= 'turn' then data = load() end
  return {0, redis.call('PTTL', KEYS[1]), data}
end
if ARGV[2] ~= 'turn' and redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('ZREM', KEYS[5], ARGV[4])  -- expired while it held KV: the reaper lets go
  return {-1, 0, {}}
end
local token = redis.call('INCR', KEYS[3])
redis.call('SET', KEYS[1], token, 'PX', ARGV[1])
return {token, 0, load()}
"""

# ARGV[9]: '0' save only, '1' save and unlock, '2' save and unlock even if a release is pending
# (it stays pending for the next holder). -1: fenced out; 1: saved (and unlocked if asked);
# 2: saved, a release was asked for while the conversation retains KV: still locked.
_SAVE = """
local cur = redis.call('GET', KEYS[1])
local token = ARGV[1]
if cur and cur ~= token then return -1 end
local written = tonumber(redis.call('HGET', KEYS[2], 'fence') or '0')
if written > tonumber(token) then return -1 end
local member, tenant, holding = ARGV[3], ARGV[4], ARGV[5]
local ord = redis.call('HGET', KEYS[2], 'rd') or ''
local ort = tonumber(redis.call('HGET', KEYS[2], 'rt') or '0')
if ord ~= '' then
  redis.call('HINCRBY', KEYS[4], ord, -ort)
  redis.call('HINCRBY', KEYS[5], tenant, -ort)
  redis.call('ZREM', holding .. ord, member)
end
local rd, rt = ARGV[6], tonumber(ARGV[7])
if rd ~= '' then
  redis.call('HINCRBY', KEYS[4], rd, rt)
  redis.call('HINCRBY', KEYS[5], tenant, rt)
  redis.call('ZADD', holding .. rd, rt, member)
  redis.call('ZADD', KEYS[6], ARGV[8], member)
else
  redis.call('ZREM', KEYS[6], member)
end
local fields = {'fence', token, 'rd', rd, 'rt', ARGV[7]}
for i = 11, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[2], unpack(fields))
redis.call('PEXPIRE', KEYS[2], ARGV[2])
if ARGV[9] == '0' then return 1 end
if redis.call('EXISTS', KEYS[3]) == 1 then
  if rd == '' then
    redis.call('DEL', KEYS[3])
  elseif ARGV[9] == '1' then
    redis.call('SET', KEYS[1], token, 'PX', ARGV[10])
    return 2
  end
end
if cur then redis.call('DEL', KEYS[1]) end
return 1
"""

_EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

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
        task = asyncio.get_running_loop().create_task(self._commit_logged())
        self._store._background.add(task)
        task.add_done_callback(self._store._background.discard)

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
        self._background: set[asyncio.Task[Any]] = set()
        self._lock_script = self._r.register_script(_LOCK)
        self._save_script = self._r.register_script(_SAVE)
        self._extend_script = self._r.register_script(_EXTEND)

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
                loaded = _fields(data)
                conv = self._load(conversation_id, tenant, loaded)
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
        loaded = _fields(data)
        conv = self._load(conversation_id, tenant, loaded)
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
        names = (_FIELDS if not held.partial
                 else [f for f in _FIELDS if f.encode() in held.loaded])
        for name, value in _dump(conv, names).items():
            if held.loaded.get(name) != value:
                args += [name, value]
        return int(await self._call("save", self._save_script(
            keys=[lock, conv_key, marker, f"{p}retained:decode", f"{p}retained:tenant",
                  f"{p}leases"],
            args=args,
        )))

    async def _extend_lock(self, conv: Conversation, token: int) -> bool:
        lock, _, _ = self._keys(f"{conv.tenant}:{conv.conversation_id}")
        return bool(await self._call("extend", self._extend_script(
            keys=[lock], args=[token, self._lock_ttl_ms])))

    # ---------------------------------------------------------------- reading
    async def read(self, conversation_id: str, tenant: str) -> Conversation | None:
        _, conv_key, _ = self._keys(f"{tenant}:{conversation_id}")
        data = await self._call("read", self._r.hgetall(conv_key))
        return self._load(conversation_id, tenant, _fields(data)) if data else None

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
                conv = self._load(cid, t, data)
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
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._r.aclose()

    # ---------------------------------------------------------------- (de)serializing
    def _load(self, conversation_id: str, tenant: str, data: dict[bytes, bytes]) -> Conversation:
        conv = Conversation(conversation_id, tenant,
                            turns=deque(maxlen=self._max_turn_records))
        if not data:
            return conv
        meta = json.loads(data[b"meta"])
        conv.decode_instance = meta["decode"]
        conv.gone_cause = MissCause(meta["gone"]) if meta["gone"] else None
        conv.turn_count = meta["turn_count"]
        conv.fired_turns = meta["fired_turns"]
        conv.prompt_tokens_total = meta["prompt_tokens_total"]
        conv.reused_tokens_total = meta["reused_tokens_total"]
        conv.last_active_unix_s = meta["last_active_unix_s"]
        conv.phase = Phase(meta["phase"]) if meta["phase"] else None
        conv.expected_next_prompt_tokens = meta["expected_next_prompt_tokens"]
        if b"turns" in data:
            conv.turns.extend(TurnRecord.model_validate(t) for t in json.loads(data[b"turns"]))
        conv.last_token_ids = _unpack(data.get(b"seq", b""))
        ret = data.get(b"ret")
        if ret:
            r = json.loads(ret)
            tokens = _unpack(data.get(b"rtok", b""))
            conv.retained = RetainedKV(
                decode_instance=r["decode_instance"], params=r["params"],
                token_ids=list(tokens) if tokens is not None else [],
                retained_tokens=r["retained_tokens"],
                lease_deadline_unix_s=r["lease_deadline_unix_s"],
                handle_key=r["handle_key"], created_unix_s=r["created_unix_s"],
            )
        return conv


_FIELDS = ["meta", "turns", "seq", "ret", "rtok"]


def _fields(data: Any) -> dict[bytes, bytes]:
    """A script's HGETALL (flat field, value pairs) or a client's, as {field: value}."""
    if isinstance(data, list):
        data = dict(zip(data[::2], data[1::2], strict=True))
    return {(k.encode() if isinstance(k, str) else k): v for k, v in data.items()}


def _dump(conv: Conversation, names: list[str]) -> dict[bytes, bytes]:
    """The named fields of the conversation's hash, as bytes (compared with what was read)."""
    out: dict[bytes, bytes] = {}
    r = conv.retained
    for name in names:
        if name == "meta":
            value: bytes = json.dumps({
                "decode": conv.decode_instance,
                "gone": conv.gone_cause.value if conv.gone_cause else None,
                "turn_count": conv.turn_count,
                "fired_turns": conv.fired_turns,
                "prompt_tokens_total": conv.prompt_tokens_total,
                "reused_tokens_total": conv.reused_tokens_total,
                "last_active_unix_s": conv.last_active_unix_s,
                "phase": conv.phase.value if conv.phase else None,
                "expected_next_prompt_tokens": conv.expected_next_prompt_tokens,
            }, separators=(",", ":")).encode()
        elif name == "turns":
            value = json.dumps([t.model_dump(mode="json") for t in conv.turns],
                               separators=(",", ":")).encode()
        elif name == "seq":
            value = _pack(conv.last_token_ids)
        elif name == "ret":
            value = b"" if r is None else json.dumps({
                "decode_instance": r.decode_instance, "params": r.params,
                "retained_tokens": r.retained_tokens,
                "lease_deadline_unix_s": r.lease_deadline_unix_s, "handle_key": r.handle_key,
                "created_unix_s": r.created_unix_s,
            }, separators=(",", ":")).encode()
        else:  # rtok
            value = b"" if r is None else _pack(r.token_ids)
        out[name.encode()] = value
    return out


def _pack(ids: Any) -> bytes:
    """Token ids as the bytes of an ``array`` (4 bytes a token), its typecode first."""
    if ids is None or len(ids) == 0:
        return b""
    if isinstance(ids, array):
        return ids.typecode.encode() + ids.tobytes()
    try:
        a = array("I", ids)
    except OverflowError:
        a = array("q", ids)
    return a.typecode.encode() + a.tobytes()


def _unpack(raw: bytes) -> array | None:
    if not raw:
        return None
    a = array(raw[:1].decode())
    a.frombytes(raw[1:])
    return a
