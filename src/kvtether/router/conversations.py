"""The conversation table: conversation id → decode instance, retained-KV handle, lease, turns.

State sits behind :class:`ConversationStore`: :class:`InMemoryConversationStore` for one router,
:class:`~kvtether.router.store_redis.RedisConversationStore` when several router replicas share
one table. Every change to a conversation happens while :class:`HeldConversation` holds it: a
turn waits for the conversation's lock (bounded), a heartbeat, release or reap takes it without
waiting and sees ``busy`` when a turn (on any replica) has it.
Conversations are keyed by (tenant, conversation id): a tenant's id never finds another
tenant's conversation (the anonymous tenant, ``""``, is the only one without API keys).
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtether.errors import KVTetherError
from kvtether.protocol import LeaseInfo, MissCause, Phase, SessionStatus, TurnRecord
from kvtether.router.tool_leases import AwaitingTools, LeaseBasis, ToolGaps

__all__ = [
    "RetainedKV",
    "Conversation",
    "ConversationBusyError",
    "ConversationStore",
    "ConversationTableFullError",
    "HeldConversation",
    "InMemoryConversationStore",
    "StoreError",
    "StoreFencedError",
    "StoreUnavailableError",
]

# Turn records kept per conversation when the store is not told otherwise.
DEFAULT_MAX_TURN_RECORDS = 64


class ConversationTableFullError(KVTetherError):
    """Every conversation in a full table has a turn in flight: none can be dropped (the router
    answers 503; internal to the router, like the store errors below)."""


class StoreError(KVTetherError):
    """The conversation store could not do what was asked."""


class StoreUnavailableError(StoreError):
    """The shared store did not answer (refused, timed out): the router degrades to plain P/D."""


class StoreFencedError(StoreError):
    """A save was refused: this holder's lock expired and a newer holder has the conversation."""


class ConversationBusyError(StoreError):
    """Another turn of the conversation held it for longer than the router waits."""


@dataclass
class RetainedKV:
    """A decode instance's handle on one conversation's KV, as vLLM returned it."""

    decode_instance: str
    params: dict[str, Any]  # D's kv_transfer_params (single-use: forwarding consumes it)
    token_ids: list[int]  # the sequence D holds KV for (prompt + output)
    retained_tokens: int  # D's remote_num_tokens: tokens with computed KV
    lease_deadline_unix_s: float  # the router's view; never forwarded past it minus a margin
    handle_key: str | None = None  # key of the lease on the kvtether connector, if any
    created_unix_s: float = field(default_factory=time.time)

    def renewed(self, lease: LeaseInfo) -> None:
        """Take D's answer to a renewal: the new deadline, and the handle that carries it."""
        self.lease_deadline_unix_s = lease.deadline_unix_s
        # Forward the renewed deadline (in D's clock) with the handle, or P declines it.
        self.params["remote_blocks_expiry_time"] = lease.remote_blocks_expiry_time


@dataclass
class Conversation:
    conversation_id: str
    tenant: str = ""  # who created it (router.access); only that tenant's requests find it
    parent_id: str | None = None  # the conversation this one was spawned from (a subagent's)
    decode_instance: str | None = None
    retained: RetainedKV | None = None
    # Why there is no retained KV right now (released, evicted, expired...), for the next turn.
    gone_cause: MissCause | None = None
    # The last turns only (bounded); the totals below count every turn.
    turns: deque[TurnRecord] = field(
        default_factory=lambda: deque(maxlen=DEFAULT_MAX_TURN_RECORDS)
    )
    turn_count: int = 0
    fired_turns: int = 0
    prompt_tokens_total: int = 0
    reused_tokens_total: int = 0
    # The token sequence (prompt + output) the last finished turn built, kept after its KV is
    # gone: what the next turn could have reused. One sequence, 4 bytes a token.
    last_token_ids: array | None = field(default=None, repr=False)
    last_active_unix_s: float = field(default_factory=time.time)
    # Latest client hints (turn hints or heartbeats), used to value the lease.
    phase: Phase | None = None
    expected_next_prompt_tokens: int | None = None
    # A client without hints (router.tool_leases): how long its tool calls kept it away
    # (bounded), the last answer's calls until the next turn comes, and how the last lease
    # was sized.
    tool_gaps: ToolGaps = field(default_factory=ToolGaps, repr=False)
    awaiting_tools: AwaitingTools | None = None
    lease_basis: LeaseBasis | None = None
    # A DELETE that came while this turn was in flight: free its KV as soon as it settles.
    release_after_turn: int | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False, compare=False)

    @property
    def key(self) -> tuple[str, str]:
        return (self.tenant, self.conversation_id)

    @property
    def next_turn(self) -> int:
        return self.turn_count + 1

    def add_turn(self, record: TurnRecord) -> None:
        """Keep a finished (or failed) turn's record; the oldest record beyond the cap goes."""
        self.turns.append(record)
        self.turn_count += 1
        self.fired_turns += record.outcome == "fired"
        self.prompt_tokens_total += record.prompt_tokens
        self.reused_tokens_total += record.reused_tokens

    def remember_sequence(self, token_ids: list[int]) -> None:
        """Keep what a finished turn built (replacing the previous turn's)."""
        if not token_ids:
            return
        try:
            self.last_token_ids = array("I", token_ids)
        except OverflowError:  # not a vocabulary index; keep it anyway
            self.last_token_ids = array("q", token_ids)

    def lease_state(self, now_unix_s: float) -> str:
        if self.retained is not None:
            return "active" if self.retained.lease_deadline_unix_s > now_unix_s else "expired"
        if self.gone_cause == MissCause.RELEASED:
            return "released"
        if self.gone_cause == MissCause.EVICTED:
            return "evicted"
        if self.gone_cause == MissCause.LEASE_EXPIRED:
            return "expired"
        return "none"

    def status(self, now_unix_s: float | None = None) -> SessionStatus:
        now = time.time() if now_unix_s is None else now_unix_s
        r = self.retained
        return SessionStatus(
            conversation_id=self.conversation_id,
            decode_instance=self.decode_instance,
            parent_id=self.parent_id,
            retained_tokens=r.retained_tokens if r else 0,
            lease_deadline_unix_s=r.lease_deadline_unix_s if r else None,
            lease_state=self.lease_state(now),  # type: ignore[arg-type]
            lease_key=r.handle_key if r else None,
            lease_basis=self.lease_basis,
            turns=list(self.turns),
            turn_count=self.turn_count,
            fired_turns=self.fired_turns,
            prompt_tokens_total=self.prompt_tokens_total,
            reused_tokens_total=self.reused_tokens_total,
        )


class HeldConversation(Protocol):
    """A conversation taken from the store; :meth:`commit` saves it and lets it go.

    ``busy``: a turn holds the conversation (here or on another replica). ``writable``: changes
    to ``conv`` count (a shared store's view of a busy conversation is a read-only snapshot).
    """

    conv: Conversation
    busy: bool
    writable: bool

    async def commit(self) -> bool:
        """Save and unlock. True: a release was asked for meanwhile and ``conv`` still retains
        KV; the conversation stays held: free it, then commit again. Idempotent once done."""
        ...

    def commit_soon(self) -> None:
        """:meth:`commit` from synchronous code (a stream's end, a failed turn), at once or
        in the background; it always lets go (a release asked for stays pending for the
        next holder)."""
        ...


class ConversationStore(Protocol):
    """What the router needs from a conversation table."""

    kind: str  # "memory" | "redis"

    async def lock(
        self, conversation_id: str, tenant: str, *, wait_s: float
    ) -> HeldConversation:
        """Hold the conversation for a turn (creating it), waiting up to ``wait_s`` for a turn
        in flight; else :class:`ConversationBusyError`."""
        ...

    async def try_lock(
        self, conversation_id: str, tenant: str, *, release_after_turn: bool = False
    ) -> HeldConversation | None:
        """Hold it without waiting (``busy`` if a turn has it); None if it does not exist.
        ``release_after_turn``: if busy, the turn in flight frees its KV when it settles."""
        ...

    async def read(self, conversation_id: str, tenant: str) -> Conversation | None:
        """A lock-free view (GET of the session)."""
        ...

    async def holders(self, decode_instance: str | None = None,
                      tenant: str | None = None) -> list[Conversation]:
        """Views of the conversations retaining KV (on one instance, or of one tenant)."""
        ...

    async def lapsed(self, now_unix_s: float) -> list[tuple[str, str]]:
        """(tenant, conversation id) of retained KV whose lease deadline has passed."""
        ...

    async def shared_counts(self) -> tuple[dict[str, int], dict[str, int]] | None:
        """Retained tokens per decode instance and per tenant, as every replica sees them;
        None for a store private to this router (its own counts are exact)."""
        ...

    async def check(self) -> bool:
        """Whether the store answers."""
        ...

    def count(self) -> int | None:
        """Conversations in the table, when known cheaply."""
        ...

    async def aclose(self) -> None: ...


class _MemoryHeld:
    """A live conversation of :class:`InMemoryConversationStore` (changes are in place)."""

    __slots__ = ("conv", "busy", "writable", "_locked")

    def __init__(self, conv: Conversation, *, locked: bool, busy: bool) -> None:
        self.conv = conv
        self.busy = busy
        self.writable = True
        self._locked = locked

    async def commit(self) -> bool:
        conv = self.conv
        if not self._locked:
            return False
        if conv.release_after_turn is not None:
            conv.release_after_turn = None
            if conv.retained is not None:
                return True
        self._locked = False
        conv.lock.release()
        return False

    def commit_soon(self) -> None:
        if self._locked:
            if self.conv.retained is None:
                self.conv.release_after_turn = None
            self._locked = False
            self.conv.lock.release()


class InMemoryConversationStore:
    """Single-process table that never holds more than ``max_conversations``.

    A new conversation in a full table drops the least recently active one that has no turn in
    flight (``on_drop`` frees the KV it still retains); if every one is mid-turn, the new one is
    refused with :class:`ConversationTableFullError` rather than grow the table.
    """

    def __init__(
        self,
        max_conversations: int = 100_000,
        on_drop: Callable[[Conversation], None] | None = None,
        now_unix_s: Callable[[], float] = time.time,
        max_turn_records: int = DEFAULT_MAX_TURN_RECORDS,
    ) -> None:
        self._items: OrderedDict[tuple[str, str], Conversation] = OrderedDict()
        self._max = max_conversations
        self._on_drop = on_drop  # frees what a dropped conversation still holds
        self._now_unix_s = now_unix_s  # the router's clock, for new conversations' timestamps
        self._max_turn_records = max_turn_records

    def get(self, conversation_id: str, tenant: str = "") -> Conversation | None:
        conv = self._items.get((tenant, conversation_id))
        if conv is not None:
            self._items.move_to_end(conv.key)
        return conv

    def get_or_create(self, conversation_id: str, tenant: str = "") -> Conversation:
        conv = self.get(conversation_id, tenant)
        if conv is None:
            if len(self._items) >= self._max:
                self._drop_oldest_idle(len(self._items) - self._max + 1)
            conv = Conversation(
                conversation_id,
                tenant,
                last_active_unix_s=self._now_unix_s(),
                turns=deque(maxlen=self._max_turn_records),
            )
            self._items[conv.key] = conv
        return conv

    def _drop_oldest_idle(self, n: int) -> None:
        """Drop the ``n`` least recently active conversations that have no turn in flight."""
        victims = []
        for conv in self._items.values():  # oldest first
            if not conv.lock.locked():
                victims.append(conv)
                if len(victims) == n:
                    break
        if len(victims) < n:
            raise ConversationTableFullError(
                f"all {len(self._items)} conversations have a turn in flight"
            )
        for conv in victims:
            del self._items[conv.key]
            if self._on_drop is not None:
                self._on_drop(conv)

    def delete(self, conversation_id: str, tenant: str = "") -> Conversation | None:
        return self._items.pop((tenant, conversation_id), None)

    def values(self) -> list[Conversation]:
        return list(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    # ------------------------------------------------ the ConversationStore interface
    kind = "memory"

    async def lock(
        self, conversation_id: str, tenant: str, *, wait_s: float
    ) -> HeldConversation:
        conv = self.get_or_create(conversation_id, tenant)
        if conv.lock.locked():
            try:
                await asyncio.wait_for(conv.lock.acquire(), wait_s)
            except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
                raise ConversationBusyError(conversation_id) from None
        else:
            await conv.lock.acquire()
        return _MemoryHeld(conv, locked=True, busy=False)

    async def try_lock(
        self, conversation_id: str, tenant: str, *, release_after_turn: bool = False
    ) -> HeldConversation | None:
        # Not locked: one event loop, and what a heartbeat or release changes is read by
        # the turn in flight after its next await (the turn runner is written for that).
        conv = self.get(conversation_id, tenant)
        if conv is None:
            return None
        busy = conv.lock.locked()
        if busy and release_after_turn:
            conv.release_after_turn = conv.next_turn
        return _MemoryHeld(conv, locked=False, busy=busy)

    async def read(self, conversation_id: str, tenant: str) -> Conversation | None:
        return self.get(conversation_id, tenant)

    async def holders(self, decode_instance: str | None = None,
                      tenant: str | None = None) -> list[Conversation]:
        return [c for c in self._items.values() if c.retained is not None
                and (decode_instance is None or c.retained.decode_instance == decode_instance)
                and (tenant is None or c.tenant == tenant)]

    async def lapsed(self, now_unix_s: float) -> list[tuple[str, str]]:
        return [c.key for c in self._items.values()
                if c.retained is not None and c.retained.lease_deadline_unix_s <= now_unix_s]

    async def shared_counts(self) -> tuple[dict[str, int], dict[str, int]] | None:
        return None

    async def check(self) -> bool:
        return True

    def count(self) -> int | None:
        return len(self._items)

    async def aclose(self) -> None:
        return None
