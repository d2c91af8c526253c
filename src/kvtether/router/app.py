"""The router's HTTP surface: OpenAI-compatible endpoints, the session API, health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvtether import protocol as p
from kvtether._validation import first_field_error
from kvtether.router._clock import Clock, SystemClock
from kvtether.router._deps import RouterDeps
from kvtether.router._errors import (
    RouterHTTPError,
    UpstreamError,
    error_response,
    is_anthropic_path,
    parse_json_body,
)
from kvtether.router.apis import API_PATHS, api_for
from kvtether.router.access import AccessMiddleware, KeyRing, tenant_of
from kvtether.router.backends import BackendPool
from kvtether.router.conversations import (
    ConversationStore,
    ConversationTableFullError,
    InMemoryConversationStore,
    StoreError,
)
from kvtether.router.leases import LeaseClient
from kvtether.router.identity import identify
from kvtether.router.metrics import RouterMetrics
from kvtether.router.prompts import PromptTokenizer
from kvtether.router.retention import Retention
from kvtether.router.sessions import SessionAPI
from kvtether.router.settings import RouterSettings
from kvtether.router.turns import TurnRequest, TurnRunner

logger = logging.getLogger(__name__)

__all__ = ["create_app"]

# At shutdown, how long the router's own tasks (releases under way) may take to finish.
_DRAIN_S = 5.0


class _ServedModels:
    """The model names prefill serves: ``/v1/models`` relayed, and remembered for checking a
    request's ``model`` (one fetch loop for both)."""

    def __init__(self, pool: BackendPool) -> None:
        self._pool = pool
        self._names: list[str] | None = None

    async def listing(self) -> httpx.Response | None:
        """The first reachable prefill instance's ``/v1/models`` answer; None if none answers."""
        for b in self._pool.prefill:
            try:
                r = await b.client.get("/v1/models", timeout=5.0)
            except httpx.HTTPError as exc:
                if isinstance(exc, httpx.ConnectError):  # slow is not down
                    b.mark_down(repr(exc))
                continue
            if r.status_code == 200 and self._names is None:
                with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
                    self._names = [m["id"] for m in r.json().get("data", [])]
            return r
        return None

    async def names(self) -> list[str] | None:
        if self._names is None:
            await self.listing()
        return self._names


def create_app(
    settings: RouterSettings,
    store: ConversationStore | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    clock: Clock | None = None,
) -> Starlette:
    """Build the router app.

    ``transport`` replaces the network to the vLLM instances and ``clock`` the wall clock
    that leases, idle times and turn records are measured with (both for tests). Handlers are
    module functions that find what they need on ``request.app.state``.
    """
    clock = clock or SystemClock()
    keys = KeyRing.from_settings(settings)  # a bad key file fails here, before serving
    pool = BackendPool(settings, transport)
    metrics = RouterMetrics()
    for backend in pool.all:
        metrics.prompt_backlog_tokens.labels(backend.name).set_function(
            lambda b=backend: b.prompt_backlog_tokens)

    def release_dropped(conv) -> None:  # noqa: ANN001
        if conv.retained is not None:
            deps.tasks.start(retention.release(conv, p.MissCause.EVICTED))

    if store is None:
        store = _make_store(settings, release_dropped, clock, metrics)
    secret = settings.control_secret.get_secret_value() if settings.control_secret else None
    deps = RouterDeps(settings, pool, store, LeaseClient(control_secret=secret), metrics, clock)
    retention = Retention(deps)
    sessions = SessionAPI(deps, retention)
    routes = [
        *(Route(path, _turn, methods=["POST"]) for path in API_PATHS),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/health", _health, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
        *sessions.routes(),
    ]
    app = Starlette(
        routes=routes,
        lifespan=_lifespan,
        middleware=[Middleware(
            AccessMiddleware, keys=keys, settings=settings,
            on_error=lambda status: metrics.errors.labels(str(status)).inc(),
        )],
        exception_handlers={
            RouterHTTPError: _counted(_router_error, metrics),
            HTTPException: _counted(_http_error, metrics),
            ConversationTableFullError: _counted(_table_full, metrics),
            ClientDisconnect: _client_gone,
            Exception: _counted(_internal_error, metrics),
        },
    )
    app.state.deps = deps
    app.state.runner = TurnRunner(deps, retention)
    app.state.tokenizer_load = None  # the task loading RouterSettings.tokenizer
    app.state.retention = retention
    app.state.sessions = sessions
    app.state.clock = clock
    app.state.pool = pool
    app.state.store = store
    app.state.metrics = metrics
    app.state.models = _ServedModels(pool)
    return app


async def _turn(request: Request) -> Response:
    """Every API's turn (chat, completions, responses, messages): one pipeline."""
    state = request.app.state
    body = await _json_body(request)
    endpoint = request.url.path
    api_for(endpoint).check(body)
    model = body.get("model")
    if model is not None:
        names = await state.models.names()
        if names is not None and model not in names:
            raise RouterHTTPError(
                404, f"The model `{model}` does not exist. Served: {', '.join(names)}",
                param="model", code="model_not_found",
            )
    who = identify(request.headers, body)
    hints = _hints(request, body)
    if who.end:
        # The agent's last turn: its KV is released once answered.
        hints = (hints or p.TurnHints()).model_copy(update={"phase": p.Phase.FINAL})
    for field in p.KVTETHER_BODY_FIELDS:
        body.pop(field, None)
    # kv_transfer_params is the router's to set; a client's would bypass the prefix check.
    body.pop("kv_transfer_params", None)
    return await state.runner.run(
        TurnRequest(endpoint, body, who.conversation_id, hints, tenant=tenant_of(request),
                    parent_id=who.parent_id)
    )


async def _models(request: Request) -> Response:
    r = await request.app.state.models.listing()
    if r is None:
        raise RouterHTTPError(503, "no prefill instance is reachable")
    return JSONResponse(r.json(), status_code=r.status_code)


async def _health(request: Request) -> Response:
    state = request.app.state
    pool, store = state.pool, state.store
    status = await pool.check_health()
    ok = any(status[b.name] for b in pool.prefill) and any(status[b.name] for b in pool.decode)
    # A store that is down does not make the router unhealthy: turns are still answered
    # (as plain P/D), and a load balancer taking every replica out would answer none.
    store_ok = await store.check()
    return JSONResponse(
        {"status": "ok" if ok else "degraded", "backends": status,
         "conversations": store.count(),
         "store": {"kind": store.kind, "ok": store_ok},
         "tokenizer": _tokenizer_state(state),
         "protocol_version": p.PROTOCOL_VERSION},
        status_code=200 if ok else 503,
    )


def _tokenizer_state(state: Any) -> str:
    """Who tokenizes prompts before a turn: "router" (its own tokenizer), "loading" (prefill
    until the router's has loaded) or "prefill"."""
    if state.tokenizer_load is not None and not state.tokenizer_load.done():
        return "loading"
    prompts = state.runner.prompts
    return "router" if prompts is not None and prompts.enabled else "prefill"


async def _metrics(request: Request) -> Response:
    state = request.app.state
    count = state.store.count()
    if count is not None:
        state.metrics.conversations.set(count)
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


async def _housekeeping(retention: Retention, pool: BackendPool) -> None:
    """Expire lapsed leases and take the shared retained-token counts every second; probe
    instance health every few seconds."""
    tick = 0
    store_down = False
    while True:
        await asyncio.sleep(1.0)
        tick += 1
        try:
            await retention.reap_expired()
            await retention.refresh_shared_counts()
            if store_down:
                logger.warning("conversation store is back")
            store_down = False
        except StoreError as exc:
            if not store_down:
                logger.warning("conversation store unavailable: %s", exc)
            store_down = True
        except Exception:  # housekeeping must never die
            logger.exception("router housekeeping failed")
        if tick % 5 == 0:
            try:
                await pool.check_health()
                await _check_stalls(retention.deps)
            except Exception:
                logger.exception("router housekeeping failed")


async def _check_stalls(deps: RouterDeps) -> None:
    """Mark instances whose engine step has waited for its worker past ``stall_after_s``
    stalled (their legs in flight give up), and those stepping again not."""
    after_s = deps.settings.stall_after_s
    if not after_s:
        return
    backends = [b for b in deps.pool.all if b.control_url]
    steps = await asyncio.gather(*(deps.leases.step_running_s(b) for b in backends))
    for backend, (known, step_s) in zip(backends, steps, strict=True):
        if not known:
            continue  # a control channel that does not answer says nothing about the engine
        if step_s is not None and step_s >= after_s:
            if backend.mark_stalled(step_s):
                deps.metrics.stalls.labels(backend.name).inc()
        else:
            backend.mark_stepping()
        deps.metrics.stalled.labels(backend.name).set(backend.stalled_step_s is not None)


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    state = app.state
    tasks = [asyncio.create_task(_housekeeping(state.retention, state.pool))]
    path = state.runner.s.tokenizer
    if path is not None:
        state.tokenizer_load = asyncio.create_task(_load_tokenizer(state.runner, path))
        tasks.append(state.tokenizer_load)
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # Releases still under way are let finish (the instances free the KV), within bounds.
        await state.deps.tasks.drain(_DRAIN_S)
        if state.runner.prompts is not None:
            state.runner.prompts.close()
        await state.pool.aclose()
        await state.store.aclose()


async def _load_tokenizer(runner: TurnRunner, path: Path) -> None:
    """The router's own tokenizer, loaded in a thread while the router already serves (turns
    ask prefill's /tokenize until it is there)."""
    runner.prompts = await asyncio.to_thread(PromptTokenizer.load, path)


def _make_store(settings: RouterSettings, on_drop, clock: Clock,  # noqa: ANN001
                metrics: RouterMetrics) -> ConversationStore:
    if settings.store == "memory":
        return InMemoryConversationStore(
            settings.max_conversations, on_drop, clock.now_unix_s,
            max_turn_records=settings.max_turn_records,
        )
    from kvtether.router.store_redis import RedisConversationStore

    return RedisConversationStore(
        settings.store, key_prefix=settings.store_key_prefix,
        conversation_ttl_s=settings.store_conversation_ttl_s,
        lock_ttl_s=settings.store_lock_ttl_s, timeout_s=settings.store_timeout_s,
        max_turn_records=settings.max_turn_records, metrics=metrics,
    )


async def _json_body(request: Request) -> dict[str, Any]:
    body = parse_json_body(await request.body())
    if not isinstance(body, dict):
        raise RouterHTTPError(400, "request body must be a JSON object")
    return body


def _hints(request: Request, body: dict[str, Any]) -> p.TurnHints | None:
    header = request.headers.get(p.HEADER_HINTS)
    try:
        if header is not None:
            return p.parse_hints_header(header)
        if p.BODY_HINTS in body:
            return p.TurnHints.model_validate(body[p.BODY_HINTS])
    except ValidationError as exc:
        raise RouterHTTPError(
            400, f"invalid {p.BODY_HINTS}: {first_field_error(exc)}", param=p.BODY_HINTS
        ) from None
    except ValueError as exc:  # the header's own parse errors, already readable
        raise RouterHTTPError(400, str(exc), param=p.BODY_HINTS) from None
    return None


def _counted(handler, metrics: RouterMetrics):  # noqa: ANN001, ANN202
    async def counted(request: Request, exc: Exception) -> Response:
        response = await handler(request, exc)
        metrics.errors.labels(str(response.status_code)).inc()
        return response

    return counted


async def _router_error(request: Request, exc: Exception) -> Response:
    anthropic = is_anthropic_path(request.url.path)
    if isinstance(exc, UpstreamError):
        return exc.to_response(anthropic=anthropic)
    assert isinstance(exc, RouterHTTPError)
    return error_response(exc.status, exc.message, param=exc.param, code=exc.code,
                          anthropic=anthropic)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(exc.status_code, exc.detail or "request failed",
                          anthropic=is_anthropic_path(request.url.path))


async def _table_full(request: Request, exc: Exception) -> Response:
    return error_response(503, "the router's conversation table is full and every "
                               "conversation in it has a turn in flight; retry shortly",
                          code="conversation_table_full",
                          anthropic=is_anthropic_path(request.url.path))


async def _client_gone(request: Request, exc: Exception) -> Response:
    # The client hung up before its request body arrived (e.g. a session stopping a heartbeat
    # when the tool ends): nothing was done and nobody reads the answer.
    logger.debug("%s %s: client disconnected", request.method, request.url.path)
    return error_response(400, "the client disconnected before sending its request",
                          code="client_disconnected",
                          anthropic=is_anthropic_path(request.url.path))


async def _internal_error(request: Request, exc: Exception) -> Response:
    # The detail goes to the log, under an id the client can quote; never to the client.
    request_id = uuid.uuid4().hex
    logger.error("unhandled error on %s %s (request id %s)", request.method, request.url.path,
                 request_id, exc_info=exc)
    response = error_response(
        500, f"internal router error (request id {request_id}; the router's log has the "
             "details)", code="internal_error", anthropic=is_anthropic_path(request.url.path),
    )
    response.headers["X-Request-Id"] = request_id
    return response
