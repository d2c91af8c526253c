"""The two upstream legs of a turn: tokenize and prefill on P, then open the decode leg on D.

Plain functions over a :class:`~kvtether.router.backends.Backend`; they know HTTP and vLLM's
answers, not conversations (the turn runner decides what a leg's result means for reuse).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

from kvtether import protocol as p
from kvtether.protocol import _kv_params as kv_keys
from kvtether.router import _json
from kvtether.router._errors import RouterHTTPError, UpstreamError
from kvtether.router.apis import api_for
from kvtether.router.backends import Backend, BackendPool, BackendStalledError, Slot, watch

logger = logging.getLogger(__name__)

__all__ = [
    "DecodeLeg", "FirstToken", "PrefillRefusedError", "PrefillResult", "PrefillStalledError",
    "PrefillTimedOutError",
    "engine_timings", "failure_kind", "json_or_502",
    "note_failure",
    "open_decode", "prefill",
    "prompt_ids", "reported_token_ids", "tokenize",
]

# A prefill leg with no handle to read: P computes the prompt and keeps its KV for D.
_FRESH_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Chat fields /tokenize needs to render the prompt exactly as the prefill leg will.
_TOKENIZE_CHAT_KEYS = ("model", "messages", "tools", "chat_template", "chat_template_kwargs",
                       "add_generation_prompt", "continue_final_message", "add_special_tokens")


class PrefillRefusedError(RouterHTTPError):
    """A prefill instance refused the connection: nothing reached it, so the turn may go to
    another prefill instance (any of them can read the conversation's KV from decode)."""

    def __init__(self, backend: Backend) -> None:
        super().__init__(502, f"prefill instance {backend.name} failed: connection refused",
                         code="upstream_unavailable")
        self.backend = backend


class PrefillTimedOutError(RouterHTTPError):
    """A prefill leg got no answer in time (a frozen worker, or a queue longer than the
    router's ``prefill_leg_timeout_s``): the turn may still be answered by decode alone."""

    def __init__(self, backend: Backend, timeout_s: float) -> None:
        super().__init__(504, f"prefill instance {backend.name} did not answer the prefill leg "
                              f"within {timeout_s:g} s", code="upstream_timeout")
        self.backend = backend
        self.timeout_s = timeout_s


class PrefillStalledError(PrefillTimedOutError):
    """The prefill instance stalled during the leg (or before it): given up at once, and the
    turn may still be answered by decode alone."""

    def __init__(self, backend: Backend, waited_s: float, stalled: Backend) -> None:
        super().__init__(backend, waited_s)
        whose = "" if stalled is backend else ", whose KV the prefill leg reads,"
        self.message = (f"{stalled.role} instance {stalled.name}{whose} stalled (its engine "
                        f"step waited {stalled.stalled_step_s or 0:.0f} s for its worker); the "
                        f"prefill leg was given up after {waited_s:.1f} s")
        self.code = "upstream_stalled"


def _prefill_failed(
    backend: Backend, exc: httpx.HTTPError, timeout_s: float | None = None
) -> RouterHTTPError:
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
        return PrefillTimedOutError(backend, _read_timeout(backend, timeout_s))
    note_failure(backend, exc)
    if isinstance(exc, httpx.ConnectError):
        return PrefillRefusedError(backend)
    return RouterHTTPError(502, f"prefill instance {backend.name} failed: {failure_kind(exc)}",
                           code="upstream_unavailable")


@dataclass(frozen=True)
class FirstToken:
    """The one token a chat prefill leg generated, as it can be streamed to the client before
    decode's first step (:func:`kvtether.router.relay.relay_stream`)."""

    token_id: int
    text: str
    chunk_id: str
    created: int
    model: str
    prompt_token_ids: list[int]


def first_token(data: dict[str, Any]) -> FirstToken | None:
    """P's token from a chat answer, when it is plain text the client may see as is: one
    choice, one token, cut by ``max_tokens`` (not a stop), no tool call or reasoning split
    off, no partial UTF-8 character."""
    choices = data.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    message = choice.get("message")
    ids = choice.get("token_ids")
    if not isinstance(message, dict) or not isinstance(ids, list) or len(ids) != 1:
        return None
    text = message.get("content")
    if (choice.get("finish_reason") != "length" or not isinstance(text, str) or not text
            or "\ufffd" in text or message.get("tool_calls") or message.get("reasoning")
            or message.get("reasoning_content") or not isinstance(ids[0], int)):
        return None
    chunk_id, created, model = data.get("id"), data.get("created"), data.get("model")
    if not isinstance(chunk_id, str) or not isinstance(created, int) or not isinstance(model, str):
        return None
    return FirstToken(ids[0], text, chunk_id, created, model, prompt_ids(data))


@dataclass(frozen=True)
class PrefillResult:
    """What the prefill leg told us."""

    prefill: Backend
    params: dict[str, Any]  # P's kv_transfer_params: the handle D reads this turn's KV with
    prompt_token_ids: list[int]
    cached_tokens: int
    pulled_tokens: int | None  # from the kvtether connector on P, when it runs there
    pull: str | None  # a protocol.PullOutcome value, from the same
    leg_s: float
    engine: p.EngineTimings | None = None  # measured inside P by the kvtether connector
    first: FirstToken | None = None  # the token P generated (chat answers only)


async def tokenize(
    prefill: Backend, endpoint: str, body: dict[str, Any]
) -> list[int] | None:
    """The new prompt's token ids, exactly as the prefill instance will see them.

    An unreachable prefill instance fails here (502; :class:`PrefillRefusedError` when it refused
    the connection), before the router decides anything about the conversation's retained
    KV: decode keeps it for the retry.
    """
    # By endpoint, as vLLM reads the body: /v1/completions uses `prompt` even when the body
    # also has `messages` (tokenizing those would check the wrong prompt against D's KV).
    if not endpoint.endswith("/chat/completions"):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        if not isinstance(prompt, str):
            return None
        tok_body: dict[str, Any] = {"model": body.get("model"), "prompt": prompt}
    else:
        tok_body = {k: body[k] for k in _TOKENIZE_CHAT_KEYS if k in body}
        tok_body.setdefault("add_generation_prompt", True)
    try:
        r = await prefill.client.post("/tokenize", json=tok_body)
    except httpx.HTTPError as exc:
        raise _prefill_failed(prefill, exc) from None
    if r.status_code != 200:
        # The prefill leg will meet the same problem and report it to the client.
        return None
    return r.json().get("tokens")


async def prefill(
    backend: Backend, endpoint: str, body: dict[str, Any], request_id: str,
    handle: dict[str, Any] | None, *, timeout_s: float | None = None,
    holder: Backend | None = None, work_tokens: int = 0,
) -> PrefillResult:
    """Run the prompt on P (one token), reading ``handle`` from D when there is one.

    ``timeout_s``: how long to wait for P's answer (it comes whole, at the end of the leg);
    past it the request is dropped (vLLM aborts it) and :class:`PrefillTimedOutError` raised.
    ``holder``: the decode instance ``handle`` is on; if it (or P) stalls meanwhile, the leg
    is given up at once with :class:`PrefillStalledError`. ``work_tokens``: the prompt tokens P
    computes, counted in its ``prompt_backlog_tokens`` while the leg is in flight.
    """
    api = api_for(endpoint)
    leg_body = api.prefill_body(body)
    leg_body["kv_transfer_params"] = dict(handle or _FRESH_PREFILL_PARAMS)
    if not api.token_ids_in_answer:
        leg_body["kv_transfer_params"][kv_keys.KV_PARAM_REPORT_TOKEN_IDS] = True
    t0 = time.perf_counter()
    try:
        with backend.slot(prompt_tokens=work_tokens):
            r = await watch(backend.client.post(
                endpoint, content=_json.dumps(leg_body), headers=_json_headers(request_id),
                **({"timeout": _leg_timeout(backend, timeout_s)} if timeout_s else {}),
            ), backend, holder if handle else None)
    except httpx.HTTPError as exc:
        raise _prefill_failed(backend, exc, timeout_s) from None
    except BackendStalledError as exc:
        raise PrefillStalledError(backend, time.perf_counter() - t0, exc.backend) from None
    leg_s = time.perf_counter() - t0
    if r.status_code != 200:
        raise UpstreamError.from_response(r)
    data = json_or_502(r.content, backend)
    params = data.get("kv_transfer_params") or {}
    engine = engine_timings(params)
    reported = params.pop(kv_keys.KV_PARAM_PROMPT_TOKEN_IDS, None)
    if not params.get("do_remote_prefill"):
        raise RouterHTTPError(502, "prefill instance returned no KV handle; is it running "
                                   "with the NIXL connector?", code="upstream_misconfigured")
    return PrefillResult(
        prefill=backend,
        params=params,
        prompt_token_ids=(prompt_ids(data) if api.token_ids_in_answer
                          else _int_list(reported)),
        cached_tokens=int(params.get("remote_prefill_cached_tokens") or 0),
        pulled_tokens=params.get(kv_keys.KV_PARAM_REUSED_TOKENS),
        pull=params.get(kv_keys.KV_PARAM_PULL),
        leg_s=leg_s,
        engine=engine,
        first=first_token(data) if api.name == "chat" else None,
    )


def _int_list(value: Any) -> list[int]:
    if isinstance(value, list) and all(isinstance(t, int) for t in value):
        return value
    return []


def reported_token_ids(handle: dict[str, Any] | None) -> tuple[list[int], list[int]] | None:
    """Take the token ids decode's connector reported (Responses and Messages turns) out of
    its handle: (prompt, output), or None when it reported none."""
    if not isinstance(handle, dict):
        return None
    prompt = handle.pop(kv_keys.KV_PARAM_PROMPT_TOKEN_IDS, None)
    output = handle.pop(kv_keys.KV_PARAM_OUTPUT_TOKEN_IDS, None)
    if prompt is None:
        return None
    return _int_list(prompt), _int_list(output)


def reported_cached_tokens(handle: dict[str, Any] | None) -> int | None:
    """Take out of decode's handle the prompt tokens a local-prefill turn found in decode's
    prefix cache (None when it reported none)."""
    raw = handle.pop(kv_keys.KV_PARAM_CACHED_TOKENS, None) if isinstance(handle, dict) else None
    return raw if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0 else None


def _read_timeout(backend: Backend, timeout_s: float | None) -> float:
    """How long a leg waits for P's answer: ``timeout_s``, or the client's own if shorter."""
    own = backend.client.timeout.read
    if timeout_s is None:
        return own or 0.0
    return min(timeout_s, own) if own is not None else timeout_s


def _leg_timeout(backend: Backend, timeout_s: float) -> httpx.Timeout:
    """The client's own timeouts, with reading (P's whole answer) bounded by ``timeout_s``."""
    base = backend.client.timeout
    return httpx.Timeout(connect=base.connect, read=_read_timeout(backend, timeout_s),
                         write=base.write, pool=base.pool)


def engine_timings(params: dict[str, Any] | None) -> p.EngineTimings | None:
    """Take the connector's timings out of a leg's ``kv_transfer_params`` (they are not part
    of the handle the other instance reads)."""
    raw = params.pop(kv_keys.KV_PARAM_TIMINGS, None) if isinstance(params, dict) else None
    if not isinstance(raw, dict):
        return None
    try:
        return p.EngineTimings.model_validate(raw)
    except ValueError:
        return None


@dataclass(frozen=True)
class DecodeLeg:
    """An open decode leg: the instance, its answer (unread) and the slot it holds there
    (released when the answer has been relayed)."""

    backend: Backend
    upstream: httpx.Response
    slot: Slot


async def open_decode(
    pool: BackendPool, preferred: str | None, endpoint: str, body: dict[str, Any],
    request_id: str, *, round_robin: bool = False, stream_idle_timeout_s: float | None = None,
    source: Backend | None = None,
) -> DecodeLeg:
    """Send the decode leg, to the conversation's instance when it is reachable.

    ``round_robin``: ignore ``preferred`` and take the next instance in turn (the reuse
    policies that emulate vLLM's example proxy). ``stream_idle_timeout_s``: for a streamed
    leg, the longest wait for D's next bytes (its first chunk included); past it the relay
    ends the stream with an error event.

    An instance that refuses the connection is skipped for the next one: P keeps this
    turn's KV for a while, so any decode instance can still read it. The answer is returned
    unread (a stream), with the instance's slot still held for the caller.
    ``source``: the prefill instance whose KV the leg reads; if it stalls before the answer
    starts, the leg is given up (no other decode instance could read that KV either).
    """
    tried: set[str] = set()
    stalled: BackendStalledError | None = None
    while True:
        decode = (pool.next_decode(tried) if round_robin
                  else pool.pick_decode(preferred, exclude=tried))
        if decode is None:
            if stalled is not None:
                raise stalled
            raise RouterHTTPError(503, "no decode instance is reachable; retry shortly",
                                  code="upstream_unavailable")
        tried.add(decode.name)
        extra: dict[str, Any] = {}
        if stream_idle_timeout_s is not None and body.get("stream"):
            extra["timeout"] = _leg_timeout(decode, stream_idle_timeout_s)
        request = decode.client.build_request(
            "POST", endpoint, content=_json.dumps(body), headers=_json_headers(request_id),
            **extra
        )
        slot = decode.slot()
        try:
            upstream = await watch(decode.client.send(request, stream=True), decode, source)
        except BackendStalledError as exc:
            slot.release()
            if exc.backend is not decode:
                raise  # the KV to read is on a stalled prefill instance
            # Given up (vLLM aborts the request); P still holds this turn's KV, so another
            # decode instance can take the leg.
            stalled = exc
            continue
        except httpx.ConnectError as exc:
            slot.release()
            decode.mark_down(repr(exc))
            continue
        except BaseException as exc:
            slot.release()
            if not isinstance(exc, httpx.HTTPError):
                raise
            note_failure(decode, exc)
            raise RouterHTTPError(502, f"decode instance {decode.name} failed: "
                                  f"{failure_kind(exc)}", code="upstream_unavailable") from None
        if upstream.status_code != 200:
            slot.release()
            await upstream.aread()
            await upstream.aclose()
            raise UpstreamError.from_response(upstream)
        return DecodeLeg(decode, upstream, slot)


def prompt_ids(data: dict[str, Any]) -> list[int]:
    """Prompt token ids of a chat (top level) or completions (per choice) answer or chunk."""
    ids = data.get("prompt_token_ids")
    if not ids:
        choices = data.get("choices") or [{}]
        ids = choices[0].get("prompt_token_ids") if choices else None
    return list(ids or [])


def _json_headers(request_id: str) -> dict[str, str]:
    return {"X-Request-Id": request_id, "Content-Type": "application/json"}


def json_or_502(raw: bytes, backend: Backend) -> dict[str, Any]:
    try:
        data = _json.loads(raw)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        data = None
    if not isinstance(data, dict):
        raise RouterHTTPError(502, f"{backend.role} instance {backend.name} answered with "
                                   "something that is not a JSON object", code="upstream_error")
    return data


def failure_kind(exc: httpx.HTTPError) -> str:
    """What went wrong with an upstream call, in words fit for a client (no repr, no paths)."""
    if isinstance(exc, httpx.TimeoutException):
        return "it did not answer in time"
    if isinstance(exc, httpx.ConnectError):
        return "connection refused"
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
        return "the connection broke off"
    return "the request could not be completed"


def note_failure(backend: Backend, exc: httpx.HTTPError) -> None:
    """Only a refused connection marks an instance down; a slow one still holds its KV."""
    if isinstance(exc, httpx.ConnectError):
        backend.mark_down(repr(exc))
    else:
        logger.warning("%s %s: %r", backend.role, backend.name, exc)
