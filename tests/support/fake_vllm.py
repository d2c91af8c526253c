"""A fake vLLM 0.32 OpenAI server running the NIXL connector with bidirectional KV transfer.

Faithful enough to exercise the kvtether router, with no model and no engine:

- ``/health``, ``/v1/models`` (serves ``tiny``), ``/tokenize``, ``/v1/chat/completions`` and
  ``/v1/completions`` (stream and not), and ``/v1/responses`` / ``/v1/messages`` (stream and
  not: rendered as the chat they amount to; answers in those APIs' shapes, token ids reported
  in ``kv_transfer_params`` as kvtether's connector does), with vLLM 0.32's response shapes:
  ``return_token_ids`` gives top-level ``prompt_token_ids`` + per-choice ``token_ids`` for chat, and per-choice
  ``prompt_token_ids`` + ``token_ids`` for completions; streamed chunks carry the prompt ids in
  the first chunk, the delta ids in each chunk, a usage chunk if
  ``stream_options.include_usage``, then ``data: [DONE]``. Errors use vLLM's ``ErrorResponse``
  shape ``{"error": {"message", "type", "param", "code": <int>}}``.
- Tokenization is word level: one id per whitespace-separated word (a stable hash), with
  ChatML-like markers (``BOS``, ``<|im_start|>`` + role id, ``<|im_end|>``). "Generation" is a
  deterministic function of the prompt ids that ends with ``<|im_end|>`` (the EOS), so the next
  turn's rendered prompt repeats the previous prompt + output exactly, as a real chat template
  does.
- Every instance is ``kv_both``, like vLLM with the NIXL connector: a request whose
  ``kv_transfer_params.do_remote_decode`` is true is a prefill leg (it may read a decode
  instance's handle first); one with ``do_remote_prefill`` true is a decode leg (it reads the
  prefill's blocks and, on finish, retains its own KV and returns a handle in non-streamed
  responses only, like 0.32).
- The NIXL side is simulated by :class:`Cluster`: it knows which engine holds which blocks for
  which token sequence, so a read can be checked for correctness. Reading KV that does not
  match the prompt, reading blocks the holder already freed (a stale, consumed or released
  handle), or misaligned block ids are recorded in ``Cluster.violations`` -- the "never wrong
  KV" invariant, checked on every read.
- Optional kvtether connector control channel on decode instances (``control=True``): handles
  of streamed turns published under ``kvtether_handle_key``, leases renewed and released
  through ``/kvtether/v1/...``, using the models in :mod:`kvtether.protocol`.
- Failure modes: :meth:`FakeVLLM.fail_next` (500, vLLM 400s, hang, wrong shapes, garbage) and
  :attr:`FakeVLLM.down` (connection refused, in :class:`RoutingTransport`).

:class:`RoutingTransport` dispatches httpx requests by URL ``host:port`` to one fake app per
instance, so a router built with ``create_app(settings, transport=...)`` talks to distinct
prefill and decode fakes with their own state.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvtether import protocol as p
from kvtether.protocol import _kv_params as kv_keys

BLOCK_SIZE = 32
MODEL = "tiny"
MAX_MODEL_LEN = 4096

BOS, IM_START, IM_END = 1, 2, 3
EOS = IM_END
ROLE_IDS = {"system": 10, "user": 11, "assistant": 12, "tool": 13, "developer": 14}
TOOL_MARK = 20

VOCAB = (  # noqa: SIM905
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu one two three "
    "four five six seven eight nine ten red green blue cyan magenta yellow black white gray "
    "north south east west up down left right sun moon star rain snow wind fire stone water"
).split()


# --------------------------------------------------------------------------- tokenizer
@functools.lru_cache(maxsize=65536)
def word_id(word: str) -> int:
    """Stable id of one whitespace-separated word (ids < 1000 are special)."""
    return 1000 + int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "big")


def text_ids(text: str) -> list[int]:
    return [word_id(w) for w in text.split()]


def content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            part.get("text", "") for part in content if isinstance(part, dict)
        )
    return str(content)


def tool_call_ids(name: str, arguments: str) -> list[int]:
    return [TOOL_MARK, word_id(name), *text_ids(arguments)]


def render_message(m: dict[str, Any]) -> list[int]:
    ids = [IM_START, ROLE_IDS.get(str(m.get("role")), 15)]
    ids += text_ids(content_text(m.get("content")))
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function") or {}
        ids += tool_call_ids(str(fn.get("name")), str(fn.get("arguments") or ""))
    ids.append(IM_END)
    return ids


def render_chat(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a ChatML-like rendering of ``messages``."""
    ids = [BOS]
    for m in messages:
        ids += render_message(m)
    if add_generation_prompt:
        ids += [IM_START, ROLE_IDS["assistant"]]
    return ids


def invalid_request(body: Any, chat: bool) -> str | None:
    """What vLLM's request validation refuses (with 400) among what this fake reads."""
    if not isinstance(body, dict):
        return "request body must be an object"

    def typed(name: str, *types: type, minimum: int | None = None) -> str | None:
        value = body.get(name)
        if value is None:
            return None
        if not isinstance(value, types) or (bool in (type(value),) and bool not in types):
            return f"{name}: wrong type"
        if minimum is not None and value < minimum:
            return f"{name}: must be at least {minimum}"
        return None

    for problem in (typed("model", str), typed("max_tokens", int, minimum=1),
                    typed("max_completion_tokens", int, minimum=1), typed("n", int, minimum=1),
                    typed("stream", bool), typed("stream_options", dict),
                    typed("return_token_ids", bool), typed("add_generation_prompt", bool),
                    typed("temperature", int, float), typed("tools", list)):
        if problem:
            return problem
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None  # answered by the caller's own check
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                return "messages: each message needs a string role"
            content = m.get("content")
            if content is not None and not isinstance(content, (str, list)):
                return "messages: content must be a string or a list of parts"
            if isinstance(content, list) and not all(isinstance(x, dict) for x in content):
                return "messages: content parts must be objects"
            calls = m.get("tool_calls")
            if calls is not None and (not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function", {}), dict)
                    for c in calls)):
                return "messages: tool_calls must be a list of objects"
    elif "prompt" in body:
        prompt = body["prompt"]
        ok = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and (
            all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
            or all(isinstance(t, str) for t in prompt)))
        if not ok:
            return "prompt: must be a string, a list of strings or a list of token ids"
    return None


def prompt_ids_of(body: dict[str, Any], chat: bool) -> list[int]:
    if chat:
        return render_chat(body["messages"], bool(body.get("add_generation_prompt", True)))
    prompt = body["prompt"]
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise TypeError("prompt must be a string or a list of token ids")
    return [BOS, *text_ids(prompt)]


def _digest(ids: list[int], salt: int = 0) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(salt.to_bytes(4, "big"))
    h.update(",".join(map(str, ids)).encode())
    return int.from_bytes(h.digest(), "big")


@dataclass
class Generation:
    token_ids: list[int]
    words: list[str]  # one per non-EOS token (tool calls: the rendered words)
    finish_reason: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return " ".join(self.words)


def generate(
    prompt: list[int], max_tokens: int | None, *, tools: Any = None,
    wants_tool: bool = False, output_words: int | None = None,
    tool_arguments: dict[str, Any] | None = None,
) -> Generation:
    """Greedy "decoding": a deterministic function of the prompt ids, ending with EOS.
    A tool call (``wants_tool`` and ``tools`` offered) calls the first tool, with
    ``tool_arguments`` or a made-up query."""
    h = _digest(prompt)
    if tools and wants_tool:
        name = str(tools[0].get("function", {}).get("name", "tool"))
        query = " ".join(VOCAB[(h >> (5 * i)) % len(VOCAB)] for i in range(2))
        arguments = json.dumps(tool_arguments if tool_arguments is not None
                               else {"query": query})
        call = {
            "id": f"chatcmpl-tool-{h % 10**12:012d}",
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        ids = [*tool_call_ids(name, arguments), EOS]
        return Generation(ids, ["<tool>", name, *arguments.split()], "tool_calls", [call])
    n = output_words if output_words is not None else 6 + h % 7
    words = [VOCAB[_digest(prompt, i + 1) % len(VOCAB)] for i in range(n)]
    ids = [*(word_id(w) for w in words), EOS]
    if max_tokens is not None and max_tokens < len(ids):
        return Generation(ids[:max_tokens], words[:max_tokens], "length")
    return Generation(ids, words, "stop")


# --------------------------------------------------------------------------- NIXL side
@dataclass
class Retention:
    """Blocks one engine holds so that another engine can read them (NIXL)."""

    engine_id: str
    request_id: str
    holder: str  # instance name
    role: str  # "prefill" (P's prompt blocks, for D) | "decode" (D's retained turn, for P)
    seq: list[int]  # tokens the blocks hold KV for (the first num_tokens are computed)
    num_tokens: int
    block_ids: list[int]
    expiry_perf: float
    state: str = "held"  # held | consumed | released | expired
    lease_key: str | None = None
    renewals: int = 0
    created_unix_s: float = field(default_factory=time.time)
    ended_unix_s: float | None = None
    # The clock lease deadlines are reported in (the router's, when a test moves it by hand);
    # leases still expire in real time.
    now_unix_s: Callable[[], float] = field(default=time.time, repr=False)

    def refresh(self) -> None:
        if self.state == "held" and time.perf_counter() >= self.expiry_perf:
            self.end("expired")

    def end(self, state: str) -> None:
        if self.state == "held":
            self.state = state
            self.ended_unix_s = time.time()

    def lease_info(self) -> p.LeaseInfo:
        self.refresh()
        remaining = max(0.0, self.expiry_perf - time.perf_counter())
        state = {"held": p.LeaseState.ACTIVE}.get(self.state) or p.LeaseState(self.state)
        return p.LeaseInfo(
            key=self.lease_key or self.request_id,
            request_id=self.request_id,
            state=state,
            retained_blocks=len(self.block_ids) if self.state == "held" else 0,
            retained_tokens=self.num_tokens if self.state == "held" else 0,
            deadline_unix_s=self.now_unix_s() + remaining,
            remaining_s=remaining,
            remote_blocks_expiry_time=self.expiry_perf,
            renewals=self.renewals,
            created_unix_s=self.created_unix_s,
            ended_unix_s=self.ended_unix_s,
        )


@dataclass
class ReadEvent:
    """One attempt of an engine to read another engine's blocks."""

    reader: str
    holder_engine: str
    request_id: str
    offered_tokens: int
    read_tokens: int
    result: str  # read | skipped_below_threshold | refused_expiry | failed | holder_down


class Cluster:
    """State the fakes share: who holds which blocks, every read, every invariant violation."""

    def __init__(self) -> None:
        self.instances: dict[str, FakeVLLM] = {}  # "host:port" -> instance
        self.retentions: dict[tuple[str, str], Retention] = {}
        self.reads: list[ReadEvent] = []
        self.violations: list[str] = []
        self._next_block = 1000
        self.now_unix_s: Callable[[], float] = time.time  # what lease deadlines are told in

    def add(self, inst: FakeVLLM, *hostports: str) -> FakeVLLM:
        for hp in hostports:
            self.instances[hp] = inst
        return inst

    def by_engine(self, engine_id: str) -> FakeVLLM | None:
        return next((i for i in self.instances.values() if i.engine_id == engine_id), None)

    def allocate_blocks(self, n: int) -> list[int]:
        ids = list(range(self._next_block, self._next_block + n))
        self._next_block += n
        return ids

    def retain(self, inst: FakeVLLM, role: str, request_id: str, seq: list[int],
               num_tokens: int, ttl_s: float, lease_key: str | None = None) -> Retention:
        n_blocks = max(1, math.ceil(num_tokens / BLOCK_SIZE))
        r = Retention(
            engine_id=inst.engine_id, request_id=request_id, holder=inst.name, role=role,
            seq=list(seq),
            num_tokens=num_tokens, block_ids=self.allocate_blocks(n_blocks),
            expiry_perf=time.perf_counter() + ttl_s, lease_key=lease_key,
            now_unix_s=self.now_unix_s,
        )
        self.retentions[(inst.engine_id, request_id)] = r
        return r

    def held_prefix(self, inst: FakeVLLM, prompt: list[int]) -> int:
        """Prompt tokens ``inst``'s prefix cache finds in the KV it holds: whole blocks, at
        most all but the prompt's last token (vLLM's rule)."""
        return self.cached_prefix(inst, prompt[:-1])

    def cached_prefix(self, inst: FakeVLLM, tokens: list[int]) -> int:
        """Leading whole blocks of ``tokens`` in ``inst``'s prefix cache: KV it holds, and with
        ``inst.keeps_freed_kv`` KV it has freed too (vLLM keeps a freed block findable until
        it needs the space)."""
        best = 0
        for r in self.retentions.values():
            r.refresh()
            if r.holder != inst.name or (r.state != "held" and not inst.keeps_freed_kv):
                continue
            held, n = r.seq[: r.num_tokens], 0
            while n < min(len(held), len(tokens)) and held[n] == tokens[n]:
                n += 1
            best = max(best, n // BLOCK_SIZE * BLOCK_SIZE)
        return best

    def read(self, reader: FakeVLLM, params: dict[str, Any], prompt: list[int], *,
             threshold: int, margin_s: float | None, fail: bool = False,
             local_tokens: int = 0) -> ReadEvent:
        """``reader`` reads what ``params`` offers for ``prompt`` (vLLM's pull path), beyond
        the ``local_tokens`` its own prefix cache holds."""
        engine, rid = params.get("remote_engine_id"), params.get("remote_request_id")
        offered = min(int(params.get("remote_num_tokens") or 0), len(prompt))
        ev = ReadEvent(reader.name, str(engine), str(rid), offered, 0, "read")
        self.reads.append(ev)
        r = self.retentions.get((engine, rid))
        holder = self.by_engine(str(engine))
        if holder is None or holder.down:
            ev.result = "holder_down"  # NIXL handshake fails: load failure, recompute
            return ev
        if offered <= 0:
            ev.result = "skipped_below_threshold"
            return ev
        if 0 < local_tokens and offered - local_tokens <= 0:
            ev.result = "local_hit"  # nothing to pull: vLLM reads nothing, D is notified
            if r is not None:
                r.end("consumed")
            return ev
        if threshold > 0 and offered - local_tokens < threshold:
            ev.result = "skipped_below_threshold"  # vLLM skips the pull; D is notified
            if r is not None:
                r.end("consumed")
            return ev
        expiry = params.get("remote_blocks_expiry_time")
        if margin_s is not None and expiry is not None and expiry - time.perf_counter() < margin_s:
            ev.result = "refused_expiry"  # vLLM declines to read a handle about to expire
            return ev
        if r is None:
            self.violations.append(f"{reader.name} read unknown blocks {engine}/{rid}")
            ev.read_tokens = offered
            return ev
        r.refresh()
        if r.state != "held":
            # One-sided NIXL read of freed (maybe reused) blocks: silently wrong KV.
            self.violations.append(
                f"{reader.name} read {r.state} blocks of {r.holder}/{rid} ({offered} tokens)"
            )
        if r.seq[:offered] != prompt[:offered]:
            i = next(i for i, (a, b) in enumerate(zip(r.seq, prompt)) if a != b)
            self.violations.append(
                f"{reader.name} read KV of {r.holder}/{rid} that differs from its prompt at "
                f"token {i} (read {offered})"
            )
        # vLLM's worker aligns by taking the LAST n of the handle's block ids.
        groups = params.get("remote_block_ids")
        n_blocks = math.ceil(offered / BLOCK_SIZE)
        if not (isinstance(groups, list) and groups and isinstance(groups[0], list)):
            self.violations.append(f"{reader.name} got malformed remote_block_ids {groups!r}")
        elif groups[0][-n_blocks:] != r.block_ids[:n_blocks]:
            self.violations.append(
                f"{reader.name} read misaligned blocks of {r.holder}/{rid}: "
                f"{groups[0][-n_blocks:]} != {r.block_ids[:n_blocks]}"
            )
        if fail:
            ev.result = "failed"
            return ev
        ev.read_tokens = offered
        r.end("consumed")  # single use: the holder frees the blocks once read
        return ev


# --------------------------------------------------------------------------- one instance
@dataclass
class Received:
    endpoint: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class Failure:
    mode: str
    endpoint: str | None
    times: int
    when: Callable[[dict[str, Any]], bool] | None


class FakeVLLM:
    """One fake vLLM OpenAI server (``kv_both``) with the NIXL connector, bidirectional."""

    def __init__(
        self, cluster: Cluster, name: str, host: str, port: int, *,
        control: bool = False, side_channel_port: int = 5600,
        max_model_len: int = MAX_MODEL_LEN, delay_s: float = 0.0, queue_delay_s: float = 0.0,
        decoder_kv_blocks_ttl_s: float = 480.0, kv_recompute_threshold: int = 16,
        read_margin_s: float = p.PREFILL_READ_MARGIN_S, kvtether_connector: bool = False,
        output_words: int | None = None, control_secret: str | None = None,
    ) -> None:
        self.cluster = cluster
        self.name = name
        self.host = host
        self.port = port
        self.url = f"http://{host}:{port}"
        self.control = control
        self.control_url = f"http://{host}-control:{port + 1000}" if control else None
        self.control_secret = control_secret  # like KVTETHER_CONTROL_SECRET on the connector
        self.side_channel_port = side_channel_port
        self.engine_id = f"{name}-{uuid.uuid4()}"
        self.max_model_len = max_model_len
        self.delay_s = delay_s  # "compute" time, after reading any remote KV
        self.queue_delay_s = queue_delay_s  # time waiting to be scheduled, before reading it
        # What the control channel reports as the engine step in flight's wait (a frozen
        # worker when it keeps growing); None between steps.
        self.step_running_s: float | None = None
        self.decoder_kv_blocks_ttl_s = decoder_kv_blocks_ttl_s
        self.kv_recompute_threshold = kv_recompute_threshold
        self.read_margin_s = read_margin_s
        self.kvtether_connector = kvtether_connector
        self.output_words = output_words
        # Tool calls: None, when the last message is a user's asking "use_tool"; True, whenever
        # tools are offered (an agent loop); False, never. With these arguments if set.
        self.call_tools: bool | None = None
        self.tool_arguments: dict[str, Any] | None = None
        self.down = False
        # Streamed answers break off after this many bytes, as when the process dies.
        self.cut_streams_after: int | None = None
        # A chat stream stops (as a frozen engine would) after this many tokens.
        self.freeze_streams_after_tokens: int | None = None
        self.unhealthy = False
        self.pull_failure = False  # reads of decode handles fail (P recomputes)
        self.local_hit_tokens: Callable[[list[int]], int] = lambda prompt: 0
        # The prefix cache finds KV this instance freed (released, lapsed) until evicted.
        self.keeps_freed_kv = False
        self.prefix_cache_lookup = True  # False: a vLLM without kvtether's scheduler (501)
        self.prefix_cache_queries: list[list[int]] = []  # POST /kvtether/v1/prefix-cache

        self.requests: list[Received] = []  # every completion request, as received
        self.prefill_handles: list[dict[str, Any] | None] = []  # kv_transfer_params, P legs
        self.decode_params: list[dict[str, Any]] = []  # kv_transfer_params, D legs
        # kv_transfer_params["prompt_token_ids"] of each generation request (None: rendered)
        self.forwarded_prompt_ids: list[list[int] | None] = []
        self.responses: list[dict[str, Any]] = []  # non-streamed bodies sent
        self.stream_chunks: list[list[dict[str, Any]]] = []  # streamed chunks sent
        self.tokenize_calls = 0
        self.control_calls: list[tuple[str, str]] = []  # (method, path)
        self.renewals: list[tuple[str, float]] = []
        self.releases: list[str] = []
        self.published: dict[str, dict[str, Any]] = {}
        self._publish_events: dict[str, asyncio.Event] = {}
        self.leases: dict[str, Retention] = {}
        self._failures: list[Failure] = []
        self._hold: asyncio.Event | None = None
        self.control_down = False  # the control channel refuses connections (engine is up)
        self._control_failures: list[int] = []  # statuses for the next control calls
        self.not_retained_keys: set[str] = set()
        self.holding = False
        self.inflight = 0
        self.max_inflight = 0

        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/v1/chat/completions", self.completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/responses", self.completions, methods=["POST"]),
            Route("/v1/messages", self.completions, methods=["POST"]),
            Route("/kvtether/v1/status", self.ctl_status, methods=["GET"]),
            Route("/kvtether/v1/handles/{key}", self.ctl_handle, methods=["GET"]),
            Route("/kvtether/v1/leases/{key}", self.ctl_lease, methods=["GET"]),
            Route("/kvtether/v1/leases/{key}", self.ctl_release, methods=["DELETE"]),
            Route("/kvtether/v1/leases/{key}/renew", self.ctl_renew, methods=["POST"]),
            Route("/kvtether/v1/prefix-cache", self.ctl_prefix_cache, methods=["POST"]),
        ]
        self.app = Starlette(routes=routes)
        self.transport = httpx.ASGITransport(app=self.app)

    # ------------------------------------------------------------------ test controls
    def fail_next(
        self, mode: str, *, endpoint: str | None = None, times: int = 1,
        when: Callable[[dict[str, Any]], bool] | None = None,
    ) -> None:
        """Make the next ``times`` completion requests (optionally only on ``endpoint`` and
        only those for which ``when(body)``) fail with ``mode``:

        ``500`` (vLLM InternalServerError), ``500_after_read`` (reads the handle it was given,
        then fails), ``400`` (vLLM BadRequestError), ``object_error`` (the older
        ``{"object": "error", ...}`` shape), ``hang``, ``no_kv_params`` (200 without
        ``kv_transfer_params``), ``garbage`` (200, not JSON), ``flat_block_ids`` (decode handle
        with ``remote_block_ids`` not nested per KV cache group), ``no_handle`` (finished
        without retaining, as after an abort), ``stream_error`` (a streamed answer that
        breaks off with vLLM's in-stream ``data: {"error": ...}`` chunk; nothing retained),
        ``other_first_token`` (the first generated token is another word: as if this
        instance's numerics broke a near-tie differently).
        """
        self._failures.append(Failure(mode, endpoint, times, when))

    def fail_control_next(self, status: int = 500, times: int = 1) -> None:
        """The next ``times`` control-channel calls answer ``status``."""
        self._control_failures += [status] * times

    def hold_next(self) -> asyncio.Event:
        """The next completion request waits (as in the scheduler's queue, before reading any
        remote KV) until the returned event is set; ``holding`` is true while it waits."""
        self._hold = asyncio.Event()
        return self._hold

    def _take_failure(self, endpoint: str, body: dict[str, Any]) -> str | None:
        for f in self._failures:
            if f.times <= 0 or (f.endpoint and f.endpoint != endpoint):
                continue
            if f.when is not None and not f.when(body):
                continue
            f.times -= 1
            return f.mode
        return None

    @property
    def prefill_requests(self) -> list[Received]:
        return [r for r in self.requests if _is_prefill(r.body)]

    @property
    def decode_requests(self) -> list[Received]:
        return [r for r in self.requests if not _is_prefill(r.body)]

    # ------------------------------------------------------------------ endpoints
    async def health(self, request: Request) -> Response:
        return Response(status_code=503 if self.unhealthy else 200)

    async def models(self, request: Request) -> Response:
        now = int(time.time())
        return JSONResponse({
            "object": "list",
            "data": [{
                "id": MODEL, "object": "model", "created": now, "owned_by": "vllm",
                "root": f"/models/{MODEL}", "parent": None, "max_model_len": self.max_model_len,
                "permission": [{
                    "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                    "created": now, "allow_create_engine": False, "allow_sampling": True,
                    "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                    "allow_fine_tuning": False, "organization": "*", "group": None,
                    "is_blocking": False,
                }],
            }],
        })

    async def tokenize(self, request: Request) -> Response:
        self.tokenize_calls += 1
        body = await request.json()
        try:
            if (problem := invalid_request(body, chat="messages" in body)) is not None:
                return vllm_error(problem)
            if body.get("model") not in (None, MODEL):
                return _model_not_found(body["model"])
            ids = prompt_ids_of(body, chat="messages" in body)
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            return vllm_error(f"invalid tokenize request: {exc!r}")
        return JSONResponse({"count": len(ids), "max_model_len": self.max_model_len,
                             "tokens": ids, "token_strs": None})

    async def completions(self, request: Request) -> Response:
        endpoint = request.url.path
        api = _API_OF.get(endpoint, "completions")
        chat = api != "completions"
        try:
            received = body = await request.json()
        except json.JSONDecodeError as exc:
            return vllm_error(f"JSON decode error: {exc}")
        if api in ("responses", "messages"):
            try:
                body = as_chat(received, api)
            except KeyError as exc:
                return vllm_error(f"{exc.args[0]}: Field required", param=str(exc.args[0]))
            except (TypeError, ValueError, AttributeError):
                return vllm_error(f"invalid {api} request: a field has the wrong type")
        if (problem := invalid_request(body, chat)) is not None:
            return vllm_error(problem)  # vLLM's pydantic request models answer 400
        self.requests.append(Received(endpoint, received, dict(request.headers)))
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            return await self._complete(request, endpoint, chat, body, api)
        finally:
            self.inflight -= 1

    async def _complete(self, request: Request, endpoint: str, chat: bool,
                        body: dict[str, Any], api: str = "chat") -> Response:
        failure = self._take_failure(endpoint, body)
        if failure == "500":
            return vllm_error("EngineCore encountered an issue.", "InternalServerError", 500)
        if failure == "hang":
            await asyncio.sleep(3600)
        if failure == "garbage":
            return Response(b"<html>502 Bad Gateway</html>", media_type="text/html")
        if failure == "object_error":
            return JSONResponse({"object": "error", "message": "bad request (old shape)",
                                 "type": "BadRequestError", "param": None, "code": 400},
                                status_code=400)
        if failure == "400":
            return vllm_error("a vLLM validation error (parameter=temperature)",
                              param="temperature")

        if body.get("model") not in (None, MODEL):
            return _model_not_found(body["model"])
        if chat and not isinstance(body.get("messages"), list):
            return vllm_error("messages: Field required", param="messages")
        if not chat and "prompt" not in body:
            return vllm_error("prompt: Field required", param="prompt")
        try:
            prompt = prompt_ids_of(body, chat)
        except (ValueError, TypeError, KeyError) as exc:
            return vllm_error(str(exc))
        # vLLM 0.32 (renderers.online_renderer): a chat request's forwarded ids replace its
        # rendering, and are taken out of kv_transfer_params.
        kvp_in = body.get("kv_transfer_params")
        forwarded = kvp_in.pop("prompt_token_ids", None) if chat and isinstance(kvp_in, dict) else None
        if forwarded is not None:
            if (not isinstance(forwarded, list) or not forwarded
                    or any(type(t) is not int or t < 0 for t in forwarded)):
                return vllm_error("`kv_transfer_params['prompt_token_ids']` must be a non-empty "
                                  "list of non-negative integers.",
                                  param="kv_transfer_params.prompt_token_ids")
            prompt = list(forwarded)
        self.forwarded_prompt_ids.append(forwarded)
        if len(prompt) > self.max_model_len:
            return vllm_error(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt contains {len(prompt)} input tokens, which exceeds this limit "
                f"even without any output tokens. Please reduce the length of the input "
                f"prompt. (parameter=input_tokens, value={len(prompt)})",
                param="input_tokens",
            )

        # vLLM: "<prefix>-<X-Request-Id>-<random>"; both legs of a turn share the header.
        base_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{base_id}-{uuid.uuid4().hex[:8]}"
        kvp = body.get("kv_transfer_params")
        kvp = kvp if isinstance(kvp, dict) else None
        is_prefill = bool(kvp and kvp.get("do_remote_decode"))
        # kvtether's connector: a local-prefill turn (no prefill leg) is a decode request too.
        is_local = bool(kvp and kvp.get(kv_keys.KV_PARAM_LOCAL_PREFILL)) and self.kvtether_connector
        is_decode = bool(kvp and kvp.get("do_remote_prefill")) or is_local
        cached = 0
        read: ReadEvent | None = None
        broken = False  # a prefill's check found the prompt diverging from the handle's
        if self.queue_delay_s:
            await asyncio.sleep(self.queue_delay_s)
        hold, self._hold = self._hold, None
        if hold is not None:
            self.holding = True
            await hold.wait()
            self.holding = False
        if is_prefill:
            self.prefill_handles.append(dict(kvp) if kvp.get("remote_block_ids") else None)
            if kvp.get("remote_block_ids"):
                offer = kvp
                if self.kvtether_connector and kv_keys.KV_PARAM_BLOCK_HASHES in kvp:
                    offer = checked_by_hashes(kvp, prompt)
                    broken = offer is not kvp
                read = self.cluster.read(
                    self, offer, prompt, threshold=self.kv_recompute_threshold,
                    margin_s=self.read_margin_s, fail=self.pull_failure,
                    local_tokens=min(self.local_hit_tokens(prompt), len(prompt) - 1),
                )
                cached = read.read_tokens
            cached = max(cached, min(self.local_hit_tokens(prompt), len(prompt) - 1))
        elif is_decode:
            self.decode_params.append(dict(kvp))
            if is_local:
                cached = self.cluster.held_prefix(self, prompt)
            elif kvp.get("remote_block_ids"):
                ev = self.cluster.read(self, kvp, prompt, threshold=0, margin_s=None)
                if ev.result != "read":
                    self.cluster.violations.append(
                        f"{self.name}: decode leg could not read the prefill's KV ({ev.result})"
                    )
        if failure == "500_after_read":
            return vllm_error("EngineCore encountered an issue.", "InternalServerError", 500)

        last = (body.get("messages") or [{}])[-1] if chat else {}
        wants_tool = last.get("role") == "user" and "use_tool" in content_text(last.get("content"))
        if self.call_tools is not None:
            wants_tool = self.call_tools
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        gen = generate(prompt, max_tokens, tools=body.get("tools") if chat else None,
                       wants_tool=wants_tool, output_words=self.output_words,
                       tool_arguments=self.tool_arguments)
        if failure == "other_first_token" and gen.words:
            other = next(w for w in VOCAB if w != gen.words[0])
            gen = Generation([word_id(other), *gen.token_ids[1:]], [other, *gen.words[1:]],
                             gen.finish_reason)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)

        kv_out: dict[str, Any] | None = None
        if is_prefill:
            r = self.cluster.retain(self, "prefill", request_id, prompt, len(prompt),
                                    ttl_s=30.0)
            kv_out = self._handle(r, do_remote_prefill=True)
            kv_out["remote_prefill_cached_tokens"] = cached
            if self.kvtether_connector and read is not None:
                kv_out.update({
                    kv_keys.KV_PARAM_PULL: "pulled" if read.read_tokens else (
                        "failed" if read.result in ("failed", "refused_expiry", "holder_down")
                        else "local_hit" if read.result == "local_hit"
                        else "below_threshold"),
                    kv_keys.KV_PARAM_REUSED_TOKENS: read.read_tokens,
                    kv_keys.KV_PARAM_REMOTE_TOKENS: read.offered_tokens,
                    kv_keys.KV_PARAM_PREFIX_MATCH_TOKENS: read.offered_tokens,
                    kv_keys.KV_PARAM_PREFIX_BREAK: broken,
                })
        elif is_decode and failure not in ("no_handle", "stream_error"):
            seq = prompt + gen.token_ids
            key = kvp.get(kv_keys.KV_PARAM_HANDLE_KEY) if self.control else None
            ttl = float(kvp.get(kv_keys.KV_PARAM_LEASE_TTL_S) or self.decoder_kv_blocks_ttl_s) \
                if key else self.decoder_kv_blocks_ttl_s
            r = self.cluster.retain(self, "decode", request_id, seq, len(seq) - 1, ttl_s=ttl,
                                    lease_key=key)
            kv_out = self._handle(r, do_remote_prefill=False)
            if self.kvtether_connector:
                # kvtether's connector: the prefix identity of what it retains, for a prefill
                # to check a prompt the router could not tokenize against.
                held = seq[: r.num_tokens]
                kv_out[kv_keys.KV_PARAM_BLOCK_SIZE] = BLOCK_SIZE
                kv_out[kv_keys.KV_PARAM_BLOCK_HASHES] = p.block_hashes(held, BLOCK_SIZE)
                kv_out[kv_keys.KV_PARAM_TAIL_HASH] = p.tail_block_hash(held, BLOCK_SIZE)
            if failure == "flat_block_ids":
                kv_out["remote_block_ids"] = list(r.block_ids)
            if key:
                kv_out[kv_keys.KV_PARAM_LEASE_KEY] = key
                self.leases[key] = r
            if is_local:
                kv_out[kv_keys.KV_PARAM_CACHED_TOKENS] = cached
        if kv_out is not None and self.kvtether_connector:
            # Like the kvtether connector: how this leg went inside the engine.
            kv_out[kv_keys.KV_PARAM_TIMINGS] = {
                "queue_s": self.queue_delay_s,
                "read_s": 0.001 if (read is not None and read.read_tokens) or is_decode else None,
                "engine_s": self.queue_delay_s + self.delay_s,
            }
        if failure == "no_kv_params":
            kv_out = None
        if kv_out is not None and (kvp or {}).get(kv_keys.KV_PARAM_REPORT_TOKEN_IDS):
            # kvtether's connector reports the sequence for APIs whose answers carry no ids.
            kv_out[kv_keys.KV_PARAM_PROMPT_TOKEN_IDS] = list(prompt)
            if is_decode:
                kv_out[kv_keys.KV_PARAM_OUTPUT_TOKEN_IDS] = list(gen.token_ids)

        if body.get("stream"):
            events = (self._stream(body, chat, request_id, prompt, gen, kv_out,
                                   error=failure == "stream_error")
                      if api in ("chat", "completions")
                      else self._named_stream(api, body, request_id, prompt, gen, kv_out))
            return StreamingResponse(events, media_type="text/event-stream")
        if is_decode:
            self._publish((kvp or {}).get(kv_keys.KV_PARAM_HANDLE_KEY) if self.control else None,
                          kv_out)
        if api in ("responses", "messages"):
            data = _named_api_body(api, request_id, prompt, gen, kv_out)
            self.responses.append(data)
            return JSONResponse(data)
        data = self._response(body, chat, request_id, prompt, gen, kv_out, cached)
        self.responses.append(data)
        return JSONResponse(data)

    def _handle(self, r: Retention, *, do_remote_prefill: bool) -> dict[str, Any]:
        return {
            "do_remote_prefill": do_remote_prefill,
            "do_remote_decode": not do_remote_prefill,
            "remote_block_ids": [list(r.block_ids)],
            "remote_engine_id": self.engine_id,
            "remote_request_id": r.request_id,
            "remote_host": self.host,
            "remote_port": self.side_channel_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": r.num_tokens,
            "remote_blocks_expiry_time": None if do_remote_prefill else r.expiry_perf,
            "transfer_mode": "pull",
        }

    def _publish(self, key: str | None, kv_out: dict[str, Any] | None) -> None:
        """The connector publishes a finished request's handle (or that it kept nothing)."""
        if not key:
            return
        if kv_out is None:
            self.not_retained_keys.add(key)
        else:
            self.published[key] = kv_out
        self._publish_events.setdefault(key, asyncio.Event()).set()

    def _usage(self, prompt: list[int], gen: Generation, cached: int = 0) -> dict[str, Any]:
        return {
            "prompt_tokens": len(prompt),
            "total_tokens": len(prompt) + len(gen.token_ids),
            "completion_tokens": len(gen.token_ids),
            "prompt_tokens_details": {"cached_tokens": cached} if cached else None,
        }

    def _response(self, body, chat, request_id, prompt, gen, kv_out, cached) -> dict[str, Any]:
        ids = bool(body.get("return_token_ids"))
        base = {"id": request_id, "created": int(time.time()), "model": MODEL}
        if chat:
            message: dict[str, Any] = {
                "role": "assistant", "content": None if gen.tool_calls else gen.text,
                "refusal": None, "annotations": None, "audio": None, "function_call": None,
                "reasoning": None,
            }
            if gen.tool_calls:
                message["tool_calls"] = gen.tool_calls
            return {
                **base, "object": "chat.completion",
                "choices": [{
                    "index": 0, "message": message, "logprobs": None,
                    "finish_reason": gen.finish_reason, "stop_reason": None,
                    "token_ids": gen.token_ids if ids else None, "routed_experts": None,
                }],
                "service_tier": None, "system_fingerprint": None,
                "usage": self._usage(prompt, gen, cached),
                "prompt_logprobs": None,
                "prompt_token_ids": prompt if ids else None,
                "prompt_text": None,
                "kv_transfer_params": kv_out,
                "ec_transfer_params": None,
                "metrics": None,
            }
        return {
            **base, "object": "text_completion",
            "choices": [{
                "index": 0, "text": " " + gen.text if gen.words else "", "logprobs": None,
                "finish_reason": gen.finish_reason, "stop_reason": None,
                "token_ids": gen.token_ids if ids else None, "prompt_logprobs": None,
                "prompt_token_ids": prompt if ids else None, "routed_experts": None,
            }],
            "service_tier": None, "system_fingerprint": None,
            "usage": self._usage(prompt, gen, cached),
            "kv_transfer_params": kv_out,
            "ec_transfer_params": None,
            "metrics": None,
        }

    async def _stream(self, body, chat, request_id, prompt, gen, kv_out,
                      error: bool = False) -> AsyncIterator[str]:
        ids = bool(body.get("return_token_ids"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        created = int(time.time())
        sent: list[dict[str, Any]] = []
        self.stream_chunks.append(sent)

        def emit(chunk: dict[str, Any]) -> str:
            sent.append(chunk)
            return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"

        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": request_id, "object": obj, "created": created, "model": MODEL}
        kvp = body.get("kv_transfer_params") or {}
        key = kvp.get(kv_keys.KV_PARAM_HANDLE_KEY) if self.control else None
        if error:
            # vLLM: an engine error mid-stream becomes one error chunk, then [DONE].
            first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                               "content": ""},
                                          "logprobs": None, "finish_reason": None}]}
            yield emit(first)
            yield emit({"error": {"message": "EngineCore encountered an issue.",
                                  "type": "InternalServerError", "param": None, "code": 500}})
            self._publish(key, None)
            yield "data: [DONE]\n\n"
            return
        n = len(gen.token_ids)
        if chat:
            first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                               "content": ""},
                                          "logprobs": None, "finish_reason": None}]}
            if ids:
                first["prompt_token_ids"] = prompt
            yield emit(first)
            if gen.tool_calls:
                tc = gen.tool_calls[0]
                delta = {"tool_calls": [{"index": 0, "id": tc["id"], "type": "function",
                                         "function": tc["function"]}]}
                choice = {"index": 0, "delta": delta, "logprobs": None,
                          "finish_reason": "tool_calls", "stop_reason": None}
                if ids:
                    choice["token_ids"] = gen.token_ids
                yield emit({**head, "choices": [choice]})
            else:
                for i, tok in enumerate(gen.token_ids):
                    if i == self.freeze_streams_after_tokens:
                        await asyncio.sleep(3600)
                    last = i == n - 1
                    word = gen.words[i] if i < len(gen.words) else ""
                    delta = {"content": (" " if i else "") + word} if word else {}
                    choice = {"index": 0, "delta": delta, "logprobs": None,
                              "finish_reason": gen.finish_reason if last else None}
                    if last:
                        choice["stop_reason"] = None
                    if ids:
                        choice["token_ids"] = [tok]
                    yield emit({**head, "choices": [choice]})
                    await asyncio.sleep(0)
        else:
            for i, tok in enumerate(gen.token_ids):
                last = i == n - 1
                word = gen.words[i] if i < len(gen.words) else ""
                choice = {"index": 0, "text": (" " + word) if word else "", "logprobs": None,
                          "finish_reason": gen.finish_reason if last else None,
                          "stop_reason": None}
                if ids:
                    if i == 0:
                        choice["prompt_token_ids"] = prompt
                    choice["token_ids"] = [tok]
                yield emit({**head, "choices": [choice]})
                await asyncio.sleep(0)
        # The request finished on the engine: the connector publishes the handle.
        self._publish(key, kv_out)
        if include_usage:
            yield emit({**head, "choices": [], "usage": self._usage(prompt, gen)})
        yield "data: [DONE]\n\n"

    async def _named_stream(self, api: str, body: dict[str, Any], request_id: str,
                            prompt: list[int], gen: Generation,
                            kv_out: dict[str, Any] | None) -> AsyncIterator[str]:
        """A Responses or Messages stream (named events), as vLLM frames them; the handle is
        published before the last event (the router fetches it before relaying that)."""
        sent: list[dict[str, Any]] = []
        self.stream_chunks.append(sent)
        kvp = body.get("kv_transfer_params") or {}
        key = kvp.get(kv_keys.KV_PARAM_HANDLE_KEY) if self.control else None
        events = _named_events(api, request_id, prompt, gen)
        for i, (name, data) in enumerate(events):
            if i == len(events) - 1:
                self._publish(key, kv_out)
            sent.append(data)
            yield f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
            await asyncio.sleep(0)

    # ------------------------------------------------------------------ control channel
    def _ctl(self, request: Request) -> Response | None:
        self.control_calls.append((request.method, request.url.path))
        if self.control_secret is not None and \
                request.headers.get("authorization") != f"Bearer {self.control_secret}":
            return JSONResponse(p.error_body("missing or wrong control-channel secret",
                                             "authentication_error"), status_code=401)
        if self._control_failures:
            status = self._control_failures.pop(0)
            return JSONResponse(p.error_body("control channel failure", "server_error"),
                                status_code=status)
        return None

    def _ctl_gone(self, r: Retention) -> Response:
        info = r.lease_info()
        body = p.error_body(f"lease {info.key} ended: {info.state.value}", "gone_error",
                            code=info.state.value)
        body["lease"] = info.model_dump(mode="json")
        return JSONResponse(body, status_code=410)

    async def ctl_status(self, request: Request) -> Response:
        if (failed := self._ctl(request)) is not None:
            return failed
        held = self.held_leases()
        return JSONResponse(p.ConnectorStatus(
            engine_id=self.engine_id, role="kv_both", vllm_version="0.32.0",
            block_size=BLOCK_SIZE, default_lease_ttl_s=60.0, max_lease_ttl_s=900.0,
            totals=p.LeaseTotals(active_leases=len(held),
                                 retained_blocks=sum(len(r.block_ids) for r in held),
                                 retained_tokens=sum(r.num_tokens for r in held)),
            counters={}, unix_time=time.time(), perf_counter=time.perf_counter(),
            step_running_s=self.step_running_s,
        ).model_dump(mode="json"))

    async def ctl_handle(self, request: Request) -> Response:
        if (failed := self._ctl(request)) is not None:
            return failed
        key = request.path_params["key"]
        wait_s = float(request.query_params.get("wait_s", "0"))
        if key not in self.published:
            ev = self._publish_events.setdefault(key, asyncio.Event())
            try:
                await asyncio.wait_for(ev.wait(), wait_s)
            except asyncio.TimeoutError:
                return JSONResponse(p.error_body(f"no handle {key}", "not_found_error"),
                                    status_code=404)
        if key in self.not_retained_keys:
            now = time.time()
            body = p.error_body(f"request {key} ended without retaining KV", "gone_error",
                                code=p.LeaseState.NOT_RETAINED.value)
            body["lease"] = p.LeaseInfo(
                key=key, request_id=key, state=p.LeaseState.NOT_RETAINED, retained_blocks=0,
                retained_tokens=0, deadline_unix_s=now, remaining_s=0.0,
                remote_blocks_expiry_time=time.perf_counter(), created_unix_s=now,
                ended_unix_s=now,
            ).model_dump(mode="json")
            return JSONResponse(body, status_code=410)
        r = self.leases.get(key)
        if r is None:
            return JSONResponse(p.error_body(f"no lease {key}", "not_found_error"),
                                status_code=404)
        r.refresh()
        if r.state != "held":
            return self._ctl_gone(r)
        params = dict(self.published[key])
        params["remote_blocks_expiry_time"] = r.expiry_perf
        return JSONResponse(p.HandleResponse(key=key, lease=r.lease_info(),
                                             kv_transfer_params=params).model_dump(mode="json"))

    async def ctl_lease(self, request: Request) -> Response:
        if (failed := self._ctl(request)) is not None:
            return failed
        r = self.leases.get(request.path_params["key"])
        if r is None:
            return JSONResponse(p.error_body("no such lease", "not_found_error"), status_code=404)
        return JSONResponse(r.lease_info().model_dump(mode="json"))

    async def ctl_renew(self, request: Request) -> Response:
        if (failed := self._ctl(request)) is not None:
            return failed
        key = request.path_params["key"]
        r = self.leases.get(key)
        if r is None:
            return JSONResponse(p.error_body("no such lease", "not_found_error"), status_code=404)
        try:
            req = p.LeaseRenewRequest.model_validate(await request.json())
        except (ValueError, json.JSONDecodeError) as exc:
            return JSONResponse(p.error_body(str(exc), "invalid_request_error"), status_code=422)
        r.refresh()
        if r.state != "held":
            return self._ctl_gone(r)
        r.expiry_perf = max(r.expiry_perf, time.perf_counter() + req.ttl_s)
        r.renewals += 1
        self.renewals.append((key, req.ttl_s))
        return JSONResponse(r.lease_info().model_dump(mode="json"))

    async def ctl_release(self, request: Request) -> Response:
        if (failed := self._ctl(request)) is not None:
            return failed
        key = request.path_params["key"]
        r = self.leases.get(key)
        if r is None:
            return JSONResponse(p.error_body("no such lease", "not_found_error"), status_code=404)
        self.releases.append(key)
        r.end("released")
        return JSONResponse(r.lease_info().model_dump(mode="json"))

    async def ctl_prefix_cache(self, request: Request) -> Response:
        if (failed := self._ctl(request)) is not None:
            return failed
        try:
            query = p.PrefixCacheQuery.model_validate(await request.json())
        except (ValueError, json.JSONDecodeError) as exc:
            return JSONResponse(p.error_body(str(exc), "invalid_request_error"), status_code=400)
        self.prefix_cache_queries.append(query.token_ids)
        if not self.prefix_cache_lookup:
            return JSONResponse(p.error_body("this engine cannot look up its prefix cache",
                                             "server_error", code="not_supported"),
                                status_code=501)
        return JSONResponse(p.PrefixCacheAnswer(
            cached_tokens=self.cluster.cached_prefix(self, query.token_ids), block_size=BLOCK_SIZE,
        ).model_dump(mode="json"))

    def evict_freed_kv(self) -> None:
        """vLLM reused the space: KV this instance freed is no longer in its prefix cache."""
        for key, r in list(self.cluster.retentions.items()):
            if r.holder == self.name and r.state != "held":
                del self.cluster.retentions[key]

    def held_leases(self) -> list[Retention]:
        """Decode-side retentions still holding blocks (with or without a lease key)."""
        out = []
        for r in self.cluster.retentions.values():
            if r.holder == self.name and r.role == "decode":
                r.refresh()
                if r.state == "held":
                    out.append(r)
        return out


def checked_by_hashes(kvp: dict[str, Any], prompt: list[int]) -> dict[str, Any]:
    """What kvtether's prefill connector reads of a handle with block hashes: all of it when
    the prompt repeats every token it holds, else the whole blocks that match (maybe none)."""
    n = int(kvp.get("remote_num_tokens") or 0)
    want = kvp[kv_keys.KV_PARAM_BLOCK_HASHES]
    have = p.block_hashes(prompt[:n], BLOCK_SIZE)
    if len(prompt) > n and have == want and (
            p.tail_block_hash(prompt[:n], BLOCK_SIZE) == kvp.get(kv_keys.KV_PARAM_TAIL_HASH)):
        return kvp
    match = 0
    while match < min(len(want), len(have)) and want[match] == have[match]:
        match += 1
    return p.truncate_handle(kvp, match, BLOCK_SIZE) or {**kvp, "remote_num_tokens": 0}


def _is_prefill(body: dict[str, Any]) -> bool:
    kvp = body.get("kv_transfer_params")
    return isinstance(kvp, dict) and bool(kvp.get("do_remote_decode"))


def vllm_error(message: str, err_type: str = "BadRequestError", status: int = 400,
               param: str | None = None) -> JSONResponse:
    """vLLM 0.32's ``ErrorResponse``: ``{"error": {message, type, param, code: <int>}}``."""
    return JSONResponse(
        {"error": {"message": message, "type": err_type, "param": param, "code": status}},
        status_code=status,
    )


def _model_not_found(model: Any) -> JSONResponse:
    return vllm_error(f"The model `{model}` does not exist.", "NotFoundError", 404)


# --------------------------------------------------------------------------- Responses, Messages
_API_OF = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
           "/v1/responses": "responses", "/v1/messages": "messages"}


def _texts(content: Any) -> str:
    """The text of a string, or of a list of text parts / blocks (any ``text`` field)."""
    return content_text(content) if content is not None else ""


def as_chat(body: dict[str, Any], api: str) -> dict[str, Any]:
    """A Responses or Messages request as the chat request it renders like: messages (a
    function call / tool_use is an assistant message's tool call with its arguments as JSON,
    its result a ``tool`` message), tools in chat's shape, the token cap as ``max_tokens``."""
    messages: list[dict[str, Any]] = []
    if api == "responses":
        if body.get("instructions"):
            messages.append({"role": "system", "content": body["instructions"]})
        items = body["input"]
        for item in [{"role": "user", "content": items}] if isinstance(items, str) else items:
            kind = item.get("type", "message")
            if kind == "message":
                messages.append({"role": item["role"], "content": _texts(item.get("content"))})
            elif kind == "function_call":
                messages.append({"role": "assistant", "content": None, "tool_calls": [{
                    "id": item.get("call_id"), "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}]})
            elif kind == "function_call_output":
                messages.append({"role": "tool", "content": _texts(item.get("output"))})
        tools = [{"type": "function", "function": {"name": t.get("name")}}
                 for t in body.get("tools") or [] if t.get("type") == "function"]
        max_tokens = body.get("max_output_tokens")
    else:
        if body.get("system"):
            messages.append({"role": "system", "content": _texts(body["system"])})
        for m in body["messages"]:
            content = m["content"]
            if isinstance(content, str):
                messages.append({"role": m["role"], "content": content})
                continue
            text = " ".join(b.get("text", "") for b in content if b.get("type") == "text")
            if m["role"] == "assistant":
                calls = [{"id": b.get("id"), "type": "function", "function": {
                    "name": b["name"], "arguments": json.dumps(b.get("input") or {})}}
                    for b in content if b.get("type") == "tool_use"]
                msg: dict[str, Any] = {"role": "assistant", "content": text or None}
                if calls:
                    msg["tool_calls"] = calls
                messages.append(msg)
                continue
            for b in content:
                if b.get("type") == "tool_result":
                    messages.append({"role": "tool", "content": _texts(b.get("content"))})
            if text:
                messages.append({"role": m["role"], "content": text})
        tools = [{"type": "function", "function": {"name": t.get("name")}}
                 for t in body.get("tools") or []]
        max_tokens = body.get("max_tokens")
    out: dict[str, Any] = {"model": body.get("model"), "messages": messages,
                           "stream": bool(body.get("stream"))}
    for name, value in (("tools", tools or None), ("max_tokens", max_tokens),
                        ("kv_transfer_params", body.get("kv_transfer_params"))):
        if value is not None:
            out[name] = value
    return out


def _tool_call(gen: Generation) -> tuple[str, str, str]:
    call = gen.tool_calls[0]
    return call["id"], call["function"]["name"], call["function"]["arguments"]


def _named_api_body(api: str, request_id: str, prompt: list[int], gen: Generation,
                    kv_out: dict[str, Any] | None) -> dict[str, Any]:
    """A whole Responses or Messages answer."""
    n = len(gen.token_ids)
    if api == "responses":
        if gen.tool_calls:
            call_id, name, arguments = _tool_call(gen)
            item: dict[str, Any] = {"type": "function_call", "id": f"fc_{call_id}",
                                    "call_id": call_id, "name": name,
                                    "arguments": arguments, "status": "completed"}
        else:
            item = {"type": "message", "id": f"msg_{request_id}", "role": "assistant",
                    "status": "completed", "content": [
                        {"type": "output_text", "text": gen.text, "annotations": []}]}
        return {"id": f"resp_{request_id}", "object": "response",
                "created_at": int(time.time()), "model": MODEL,
                "status": "completed" if gen.finish_reason != "length" else "incomplete",
                "output": [item], "tools": [], "parallel_tool_calls": True,
                "usage": {"input_tokens": len(prompt), "output_tokens": n,
                          "total_tokens": len(prompt) + n},
                "kv_transfer_params": kv_out}
    if gen.tool_calls:
        call_id, name, arguments = _tool_call(gen)
        content = [{"type": "tool_use", "id": f"toolu_{call_id}", "name": name,
                    "input": json.loads(arguments)}]
        stop = "tool_use"
    else:
        content = [{"type": "text", "text": gen.text}]
        stop = "max_tokens" if gen.finish_reason == "length" else "end_turn"
    data: dict[str, Any] = {"id": f"msg_{request_id}", "type": "message", "role": "assistant",
                            "model": MODEL, "content": content, "stop_reason": stop,
                            "stop_sequence": None,
                            "usage": {"input_tokens": len(prompt), "output_tokens": n}}
    if kv_out is not None:
        data["kv_transfer_params"] = kv_out
    return data


def _named_events(api: str, request_id: str, prompt: list[int],
                  gen: Generation) -> list[tuple[str, dict[str, Any]]]:
    """The events of a streamed Responses or Messages answer (a tool call's arguments in two
    pieces, as a model streams them), each ``(name, data)``."""
    whole = _named_api_body(api, request_id, prompt, gen, None)
    events: list[tuple[str, dict[str, Any]]] = []
    if api == "responses":
        def add(name: str, **data: Any) -> None:
            events.append((name, {"type": name, "sequence_number": len(events), **data}))
        start = {**whole, "status": "in_progress", "output": [], "usage": None}
        add("response.created", response=start)
        add("response.in_progress", response=start)
        item = whole["output"][0]
        if item["type"] == "function_call":
            add("response.output_item.added", output_index=0, item={**item, "arguments": ""})
            half = len(item["arguments"]) // 2
            for piece in (item["arguments"][:half], item["arguments"][half:]):
                add("response.function_call_arguments.delta", output_index=0,
                    item_id=item["id"], delta=piece)
            add("response.function_call_arguments.done", output_index=0, item_id=item["id"],
                arguments=item["arguments"])
        else:
            add("response.output_item.added", output_index=0, item={**item, "content": []})
            for i, word in enumerate(gen.words):
                add("response.output_text.delta", output_index=0, content_index=0,
                    item_id=item["id"], delta=(" " if i else "") + word)
        add("response.output_item.done", output_index=0, item=item)
        add("response.completed", response=whole)
        return events
    events.append(("message_start", {"type": "message_start", "message": {
        **whole, "content": [], "stop_reason": None,
        "usage": {"input_tokens": len(prompt), "output_tokens": 0}}}))
    block = whole["content"][0]
    if block["type"] == "tool_use":
        events.append(("content_block_start", {"type": "content_block_start", "index": 0,
                                                "content_block": {**block, "input": {}}}))
        arguments = json.dumps(block["input"])
        half = len(arguments) // 2
        for piece in (arguments[:half], arguments[half:]):
            events.append(("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                    "delta": {"type": "input_json_delta",
                                                              "partial_json": piece}}))
    else:
        events.append(("content_block_start", {"type": "content_block_start", "index": 0,
                                                "content_block": {"type": "text", "text": ""}}))
        for i, word in enumerate(gen.words):
            events.append(("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                    "delta": {"type": "text_delta",
                                                              "text": (" " if i else "") + word}}))
    events.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
    events.append(("message_delta", {"type": "message_delta", "delta": {
        "stop_reason": whole["stop_reason"], "stop_sequence": None},
        "usage": {"output_tokens": len(gen.token_ids)}}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events


# --------------------------------------------------------------------------- transport
class SocketLikeStream(httpx.AsyncByteStream):
    """A response body that behaves like one read from a socket: every chunk and the close
    are await points (``httpx.ASGITransport`` hands back a fully buffered body that never
    yields, which would hide cancellation bugs)."""

    def __init__(self, inner: httpx.AsyncByteStream, cut_after: int | None = None) -> None:
        self._inner = inner
        self._cut_after = cut_after  # bytes, then the peer "dies" (connection reset)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        left = self._cut_after
        async for chunk in self._inner:
            await asyncio.sleep(0)
            if left is not None and len(chunk) >= left:
                yield chunk[:left]
                raise httpx.RemoteProtocolError("peer closed connection without sending "
                                                "complete message body")
            if left is not None:
                left -= len(chunk)
            yield chunk

    async def aclose(self) -> None:
        await asyncio.sleep(0)
        await self._inner.aclose()


class RoutingTransport(httpx.AsyncBaseTransport):
    """Dispatches each request by URL ``host:port`` to that instance's ASGI app.

    A missing or ``down`` instance refuses the connection (``httpx.ConnectError``). The read
    timeout the client set is enforced (``httpx.ReadTimeout``), as a socket would.
    """

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.requests = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        hostport = f"{request.url.host}:{request.url.port}"
        inst = self.cluster.instances.get(hostport)
        is_control = inst is not None and hostport != f"{inst.host}:{inst.port}"
        if inst is None or inst.down or (is_control and inst.control_down):
            raise httpx.ConnectError(f"[Errno 111] Connection refused ({hostport})",
                                     request=request)
        timeout = (request.extensions.get("timeout") or {}).get("read")
        try:
            r = await asyncio.wait_for(inst.transport.handle_async_request(request), timeout)
        except asyncio.TimeoutError:
            raise httpx.ReadTimeout(f"timed out after {timeout}s ({hostport})",
                                    request=request) from None
        assert isinstance(r.stream, httpx.AsyncByteStream)
        streamed = r.headers.get("content-type", "").startswith("text/event-stream")
        cut = inst.cut_streams_after if streamed and not is_control else None
        return httpx.Response(r.status_code, headers=r.headers,
                              stream=SocketLikeStream(r.stream, cut), extensions=r.extensions)
