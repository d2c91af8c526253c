"""``KVTetherProvider``: the Agents SDK's ``ModelProvider`` pointed at a kvtether router.

Every model is an ``OpenAIChatCompletionsModel`` over one ``AsyncOpenAI`` client wrapped by an
``AsyncSessionPool``: each request goes to the session of its run's conversation key. The key
is the runner's own grouping (``conversation_id``, then the SDK ``Session``'s id, then
``RunConfig.group_id``, else one key per run): the runner hands it to models that ask for a
default prompt-cache key, and the model takes it back out of the request before sending, so
the request body is exactly what the plain model would send.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import openai
from agents.models.interface import Model, ModelProvider
from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel
from agents.model_settings import ModelSettings
from kvtether.session import AsyncSession, AsyncSessionPool, SessionSettings

__all__ = ["KVTetherProvider"]

logger = logging.getLogger(__name__)

# The conversation key of the model request being sent, read by the pool's resolver.
_RUN_KEY: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvtether_openai_agents_run_key", default=None
)
_KEY_FIELD = "prompt_cache_key"
_GENERATED_PREFIX = "agents-sdk:"  # how the runner's generated keys begin


def _take_key(settings: ModelSettings) -> tuple[ModelSettings, str | None]:
    """The run's grouping key, and the settings without it if the runner (not the user) put it
    there; a key the user set stays in the request and is used as is."""
    for field in ("extra_args", "extra_body"):
        extra = getattr(settings, field)
        if isinstance(extra, dict) and isinstance(extra.get(_KEY_FIELD), str):
            key: str = extra[_KEY_FIELD]
            if field == "extra_args" and key.startswith(_GENERATED_PREFIX):
                rest = {k: v for k, v in extra.items() if k != _KEY_FIELD}
                settings = dataclasses.replace(settings, extra_args=rest or None)
            return settings, key
    return settings, None


class _TetheredModel(OpenAIChatCompletionsModel):
    """A Chat Completions model whose requests carry their run's conversation id."""

    def __init__(
        self, model: str | None, client: openai.AsyncOpenAI, provider: KVTetherProvider
    ) -> None:
        # None: the agent named no model; the router's served model, asked for at first use.
        super().__init__(model=model or "", openai_client=client)
        self._provider = provider
        self._named = model is not None

    async def _ensure_model(self) -> None:
        if not self._named:
            self.model = await self._provider._default_model_name()
            self._named = True

    def _supports_default_prompt_cache_key(self) -> bool:
        # Ask the runner for its grouping key; _take_key removes it before the request leaves.
        return True

    def _begin(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        if "model_settings" in kwargs:
            kwargs["model_settings"], key = _take_key(kwargs["model_settings"])
        else:
            settings, key = _take_key(args[2])
            args = (*args[:2], settings, *args[3:])
        return args, key  # type: ignore[return-value]

    async def get_response(self, *args: Any, **kwargs: Any) -> Any:
        await self._ensure_model()
        args, key = self._begin(args, kwargs)
        await self._provider._close_stale_tool_calls(key)
        token = _RUN_KEY.set(key)
        try:
            return await super().get_response(*args, **kwargs)
        except openai.APIConnectionError as exc:
            fallback = self._provider._fallback_model(self.model, exc)
            if fallback is None:
                raise
        finally:
            _RUN_KEY.reset(token)
        return await fallback.get_response(*args, **kwargs)

    async def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:  # type: ignore[override]
        await self._ensure_model()
        args, key = self._begin(args, kwargs)
        await self._provider._close_stale_tool_calls(key)
        token = _RUN_KEY.set(key)
        started = False
        fallback: Model | None = None
        try:
            async for event in super().stream_response(*args, **kwargs):
                started = True
                yield event
        except openai.APIConnectionError as exc:
            fallback = None if started else self._provider._fallback_model(self.model, exc)
            if fallback is None:
                raise
        finally:
            try:
                _RUN_KEY.reset(token)
            except ValueError:  # resumed in another context: just clear it
                _RUN_KEY.set(None)
        if fallback is not None:
            async for event in fallback.stream_response(*args, **kwargs):
                yield event


class KVTetherProvider(ModelProvider):
    """``RunConfig(model_provider=KVTetherProvider("http://127.0.0.1:8000"))``.

    ``base_url``: the kvtether router's root (its OpenAI API is ``base_url + "/v1"``).
    ``api_key``: the router's key; used only for requests to the router, never for tracing.
    ``openai_client``: your own ``AsyncOpenAI`` for the router instead (retries, timeouts).
    ``fallback_client``: an ``AsyncOpenAI`` for a plain OpenAI-compatible endpoint (vLLM's own
    server) that answers when the router cannot be reached; such turns are recorded as misses.
    ``pool``: your own ``AsyncSessionPool``; else one is made from ``max_sessions``,
    ``idle_ttl_s`` and ``settings``. ``hooks`` heartbeats while function tools run.
    ``model``: what an agent that names no model gets (``get_model(None)``); by default the
    model the router serves (its ``/v1/models``, asked once).
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        openai_client: openai.AsyncOpenAI | None = None,
        fallback_client: openai.AsyncOpenAI | None = None,
        pool: AsyncSessionPool | None = None,
        max_sessions: int = 1024,
        idle_ttl_s: float | None = 900.0,
        settings: SessionSettings | None = None,
        model: str | None = None,
    ) -> None:
        self._owned_client: openai.AsyncOpenAI | None = None
        self._default_model = model
        if openai_client is None:
            if base_url is None:
                raise ValueError("KVTetherProvider needs the router's base_url or an openai_client")
            # Its own client, with the router's key: never the SDK's default client or key, so
            # the tracing exporter never sends traces to OpenAI with the router's key.
            openai_client = self._owned_client = openai.AsyncOpenAI(
                base_url=base_url.rstrip("/") + "/v1", api_key=api_key or "-"
            )
        self._pool = pool or AsyncSessionPool(
            base_url, max_sessions=max_sessions, idle_ttl_s=idle_ttl_s, settings=settings,
            api_key=api_key,
        )
        self._client = self._pool.wrap(openai_client, resolver=_RUN_KEY.get)
        self._fallback_client = fallback_client
        self._models: dict[str, _TetheredModel] = {}
        self._fallbacks: dict[str, Model] = {}
        self._warned_unreachable = False
        self.fallback_turns = 0  # model calls the router could not take (answered by fallback)

    @property
    def pool(self) -> AsyncSessionPool:
        """The sessions, one per conversation key: ``provider.pool.get(key).report()``."""
        return self._pool

    def session_for(
        self,
        *,
        conversation_id: str | None = None,
        session: Any = None,
        group_id: str | None = None,
    ) -> AsyncSession:
        """The kvtether session of the runs grouped by ``conversation_id``, an SDK ``Session``
        (or its ``session_id``) or ``group_id`` — the first given, in the runner's own order.

        The runner hands models a prompt-cache key derived from that grouping (a hash of the id
        in openai-agents 0.24); this derives it the runner's way, so ``kv.session_for(
        session=sdk_session).report()`` shows that conversation's turns.
        """
        from agents.run_internal.prompt_cache_key import _prompt_cache_key_for_grouping

        if conversation_id is not None:
            kind, value = "conversation", conversation_id
        elif session is not None:
            kind, value = "session", str(getattr(session, "session_id", session))
        elif group_id is not None:
            kind, value = "group", group_id
        else:
            raise ValueError("session_for() needs conversation_id, session or group_id")
        return self._pool.get(_prompt_cache_key_for_grouping(kind, value))

    @property
    def hooks(self) -> Any:
        """``RunHooks`` that heartbeat while function tools run: ``Runner.run(..., hooks=...)``."""
        from kvtether_openai_agents._hooks import KVTetherHooks

        return KVTetherHooks(self)

    def get_model(self, model_name: str | None) -> Model:
        name = model_name or self._default_model
        model = self._models.get(name or "")
        if model is None:
            model = self._models[name or ""] = _TetheredModel(name, self._client, self)
        return model

    async def _default_model_name(self) -> str:
        """The model an agent without one gets: ``model=``, else the router's first served."""
        if self._default_model is None:
            try:
                served = [m.id async for m in self._client.models.list()]
            except openai.OpenAIError as exc:
                raise ValueError(
                    "the agent names no model and the router's /v1/models could not be read "
                    f"({exc}); name one (Agent(model=...)) or KVTetherProvider(model=...)"
                ) from exc
            if not served:
                raise ValueError(
                    "the router serves no model; name one: KVTetherProvider(model=...)")
            self._default_model = served[0]
        return self._default_model

    async def aclose(self) -> None:
        """Stop tool heartbeats still running and release the KV of every pooled session.
        The runner never calls this for a provider you passed it; call it when you are done."""
        await self._pool.aclose()  # ends the tool runs still open first
        if self._owned_client is not None:
            await self._owned_client.close()

    async def __aenter__(self) -> KVTetherProvider:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # --- used by the model and the hooks ----------------------------------------------------
    def _fallback_model(self, model: Any, exc: Exception) -> Model | None:
        if self._fallback_client is None:
            return None
        message = (
            "kvtether router unreachable (%s); answering through the fallback endpoint without "
            "KV reuse (each such turn is a miss)"
        )
        level = logging.DEBUG if self._warned_unreachable else logging.WARNING
        self._warned_unreachable = True
        logger.log(level, message, exc)
        self.fallback_turns += 1
        name = str(model)
        fallback = self._fallbacks.get(name)
        if fallback is None:
            fallback = self._fallbacks[name] = OpenAIChatCompletionsModel(
                model=name, openai_client=self._fallback_client
            )
        return fallback

    async def _tool_started(self, tool_call_id: str | None, name: str, arguments: Any) -> None:
        if not tool_call_id:
            return
        try:
            args = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            args = arguments
        # Not followed when its reply came from no tethered request (fallback, another client).
        await self._pool.abegin_tool(tool_call_id, name, tool_call_id=tool_call_id, args=args)

    async def _tool_ended(self, tool_call_id: str | None) -> None:
        if tool_call_id:
            await self._pool.aend_tool(tool_call_id)

    async def _close_stale_tool_calls(self, key: str | None) -> None:
        """A model call of a conversation means its tools are done: close any whose end hook
        never came (a tool error that ended the hooks, a cancelled run resumed)."""
        if not self._pool.open_tool_runs():
            return
        cid = self._pool.get(key).conversation_id if key is not None else None
        for run_id in self._pool.open_tool_runs(cid):
            await self._pool.aend_tool(run_id)
