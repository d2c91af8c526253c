"""``KVTetherProvider``: the Agents SDK's ``ModelProvider`` pointed at a kvtether router.

Every model is an ``OpenAIChatCompletionsModel`` over one ``AsyncOpenAI`` client wrapped by an
``AsyncSessionPool``: each request goes to the session of its run's conversation key. Models
get that key through the SDK's public surface only:

* ``kv.run`` / ``kv.run_streamed`` / ``kv.run_sync`` take ``Runner``'s own arguments and derive
  the key from them in the runner's grouping order (``conversation_id``, the SDK ``Session``'s
  id, ``RunConfig.group_id``, else one key per run); the run gets a provider bound to that key
  (``kv.bind(...)``, which also works with ``Runner`` directly).
* A run handed the provider itself (``RunConfig(model_provider=kv)``) uses the
  ``conversation_id`` the runner passes every model (a public ``Model.get_response``
  parameter), else one key per run: the run's trace (``agents.tracing.get_current_trace()``).
  An SDK ``Session`` and ``RunConfig.group_id`` never reach a model, hence ``kv.run``.

Requests leave unchanged: the body is exactly what the plain model sends.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import AsyncIterator, Mapping
from typing import Any

import openai
from agents import (
    Model,
    ModelProvider,
    OpenAIChatCompletionsModel,
    RunConfig,
    Runner,
    RunResult,
    RunResultStreaming,
)
from agents.tracing import get_current_trace
from kvtether.session import AsyncSession, AsyncSessionPool, SessionSettings

from kvtether_openai_agents._hooks import KVTetherHooks
from kvtether_openai_agents._keys import RUN_KEY, grouping_key, new_run_key

__all__ = ["KVTetherProvider"]

logger = logging.getLogger(__name__)


class _TetheredModel(OpenAIChatCompletionsModel):
    """A Chat Completions model whose requests carry their run's conversation key.

    Overrides only the public ``Model`` methods, with ``Model``'s own parameters: the seven
    positional ones by name, the keyword-only ones (``previous_response_id``,
    ``conversation_id``, ``prompt``, and any a later SDK adds) passed on as they came.
    Attributes are ``_kvt_``-prefixed so they can never collide with the SDK's own.
    """

    def __init__(
        self,
        model: str | None,
        client: openai.AsyncOpenAI,
        provider: KVTetherProvider,
        key: str | None = None,
    ) -> None:
        # None: the agent named no model; the router's served model, asked for at first use.
        super().__init__(model=model or "", openai_client=client)
        self._kvt_provider = provider
        self._kvt_key = key  # bound by kv.run / kv.bind; None: resolved per call
        self._kvt_named = model is not None

    async def _kvt_begin(self, conversation_id: Any) -> str | None:
        if not self._kvt_named:
            self.model = await self._kvt_provider._default_model_name()
            self._kvt_named = True
        key = self._kvt_key or self._kvt_provider._unbound_key(conversation_id)
        await self._kvt_provider._close_stale_tool_calls(key)
        return key

    async def get_response(  # type: ignore[override]
        self,
        system_instructions: Any,
        input: Any,
        model_settings: Any,
        tools: Any,
        output_schema: Any,
        handoffs: Any,
        tracing: Any,
        **kwargs: Any,
    ) -> Any:
        args = (system_instructions, input, model_settings, tools, output_schema, handoffs,
                tracing)
        key = await self._kvt_begin(kwargs.get("conversation_id"))
        token = RUN_KEY.set(key)
        try:
            return await super().get_response(*args, **kwargs)
        except openai.APIConnectionError as exc:
            fallback = self._kvt_provider._fallback_model(self.model, exc)
            if fallback is None:
                raise
        finally:
            RUN_KEY.reset(token)
        return await fallback.get_response(*args, **kwargs)

    async def stream_response(  # type: ignore[override]
        self,
        system_instructions: Any,
        input: Any,
        model_settings: Any,
        tools: Any,
        output_schema: Any,
        handoffs: Any,
        tracing: Any,
        **kwargs: Any,
    ) -> AsyncIterator[Any]:
        args = (system_instructions, input, model_settings, tools, output_schema, handoffs,
                tracing)
        key = await self._kvt_begin(kwargs.get("conversation_id"))
        token = RUN_KEY.set(key)
        started = False
        fallback: Model | None = None
        try:
            async for event in super().stream_response(*args, **kwargs):
                started = True
                yield event
        except openai.APIConnectionError as exc:
            fallback = None if started else self._kvt_provider._fallback_model(self.model, exc)
            if fallback is None:
                raise
        finally:
            try:
                RUN_KEY.reset(token)
            except ValueError:  # resumed in another context: just clear it
                RUN_KEY.set(None)
        if fallback is not None:
            async for event in fallback.stream_response(*args, **kwargs):
                yield event


class _BoundProvider(ModelProvider):
    """``kv.bind(...)``: the provider's models, every request of them in one conversation."""

    def __init__(self, provider: KVTetherProvider, key: str) -> None:
        self.provider = provider
        self.key = key
        self._models: dict[str, _TetheredModel] = {}

    @property
    def session(self) -> AsyncSession:
        """This conversation's kvtether session: ``bound.session.report()``."""
        return self.provider.pool.get(self.key)

    def get_model(self, model_name: str | None) -> Model:
        name = model_name or self.provider._default_model
        model = self._models.get(name or "")
        if model is None:
            model = self._models[name or ""] = _TetheredModel(
                name, self.provider._client, self.provider, self.key
            )
        return model


class KVTetherProvider(ModelProvider):
    """``await kv.run(agent, input, session=...)`` with ``kv = KVTetherProvider(router_url)``.

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
        self._client = self._pool.wrap(openai_client, resolver=RUN_KEY.get)
        self._fallback_client = fallback_client
        self._models: dict[str, _TetheredModel] = {}
        self._fallbacks: dict[str, Model] = {}
        # The key of each run given the provider itself, by its trace (kept while it lives).
        self._trace_keys: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._warned_unreachable = False
        self._warned_unbound = False
        self.fallback_turns = 0  # model calls the router could not take (answered by fallback)

    @property
    def pool(self) -> AsyncSessionPool:
        """The sessions, one per conversation key: ``provider.pool.get(key).report()``."""
        return self._pool

    # --- runs -------------------------------------------------------------------------------
    async def run(self, starting_agent: Any, input: Any, **kwargs: Any) -> RunResult:
        """``Runner.run`` with ``Runner.run``'s arguments, tethered to the run's conversation:
        ``conversation_id``, else ``session``'s id, else ``run_config.group_id``, else its own.

        The run gets a copy of ``run_config`` (a ``RunConfig()`` if none is given) whose model
        provider is this one bound to that conversation (unless it already is a ``kv.bind()``
        of yours); ``hooks`` default to ``kv.hooks``, and hooks of your own are wrapped by them
        (``KVTetherHooks(kv, wrapped=yours)``).
        """
        return await Runner.run(starting_agent, input, **self._run_options(kwargs))

    def run_sync(self, starting_agent: Any, input: Any, **kwargs: Any) -> RunResult:
        """``Runner.run_sync``, tethered like ``run``."""
        return Runner.run_sync(starting_agent, input, **self._run_options(kwargs))

    def run_streamed(self, starting_agent: Any, input: Any, **kwargs: Any) -> RunResultStreaming:
        """``Runner.run_streamed``, tethered like ``run``."""
        return Runner.run_streamed(starting_agent, input, **self._run_options(kwargs))

    def bind(
        self,
        *,
        conversation_id: str | None = None,
        session: Any = None,
        group_id: str | None = None,
    ) -> ModelProvider:
        """This provider with every request in one conversation, for ``Runner`` itself:
        ``RunConfig(model_provider=kv.bind(session=sdk_session))``.

        The conversation is the first given of ``conversation_id``, an SDK ``Session`` (or its
        ``session_id``) and ``group_id``; with none, a new one, kept for as long as you keep
        passing the same bound provider. ``kv.run`` binds each run this way.
        """
        key = grouping_key(conversation_id=conversation_id, session=session, group_id=group_id)
        return _BoundProvider(self, key or new_run_key())

    def session_for(
        self,
        *,
        conversation_id: str | None = None,
        session: Any = None,
        group_id: str | None = None,
    ) -> AsyncSession:
        """The kvtether session of the runs grouped by ``conversation_id``, an SDK ``Session``
        (or its ``session_id``) or ``group_id`` — the first given, in the runner's own order —
        so ``kv.session_for(session=sdk_session).report()`` shows that conversation's turns."""
        key = grouping_key(conversation_id=conversation_id, session=session, group_id=group_id)
        if key is None:
            raise ValueError("session_for() needs conversation_id, session or group_id")
        return self._pool.get(key)

    @property
    def hooks(self) -> Any:
        """``RunHooks`` that heartbeat while function tools run: ``Runner.run(..., hooks=...)``."""
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

    # --- used by the runs and the models ---------------------------------------------------
    def _run_options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``Runner``'s keyword arguments, with the run bound to its conversation."""
        run_config = kwargs.get("run_config")
        if isinstance(run_config, Mapping):  # the SDKs that take a dict of RunConfig fields
            group_id, given = run_config.get("group_id"), run_config.get("model_provider")
        else:
            group_id = getattr(run_config, "group_id", None)
            given = getattr(run_config, "model_provider", None)
        if isinstance(given, _BoundProvider) and given.provider is self:
            bound = given  # a binding of yours: RunConfig(model_provider=kv.bind(...))
        else:
            bound = self.bind(
                conversation_id=kwargs.get("conversation_id"), session=kwargs.get("session"),
                group_id=group_id,
            )
        if run_config is None:
            run_config = RunConfig(model_provider=bound)
        elif isinstance(run_config, Mapping):
            run_config = {**run_config, "model_provider": bound}
        else:
            run_config = dataclasses.replace(run_config, model_provider=bound)
        hooks = kwargs.get("hooks")
        if hooks is None:
            hooks = self.hooks
        elif not isinstance(hooks, KVTetherHooks):
            hooks = KVTetherHooks(self, wrapped=hooks)
        return {**kwargs, "run_config": run_config, "hooks": hooks}

    def _unbound_key(self, conversation_id: Any) -> str | None:
        """The key of a model call of a run handed the provider itself: the runner's
        ``conversation_id``, else one per run (its trace; runs you wrap in one ``trace()`` of
        your own share it), else None outside any run (the pool's default session)."""
        key = grouping_key(conversation_id=conversation_id)
        if key is not None:
            return key
        trace = get_current_trace()
        if trace is None:
            return None
        key = self._trace_keys.get(trace)
        if key is None:
            key = self._trace_keys[trace] = new_run_key()
            if not self._warned_unbound:
                self._warned_unbound = True
                logger.warning(
                    "kvtether: a run without conversation_id was given the KVTetherProvider "
                    "itself; models never see an SDK Session or RunConfig.group_id, so each "
                    "such run is its own conversation. Start runs with kv.run(...) (Runner's "
                    "arguments) or RunConfig(model_provider=kv.bind(session=...)) to keep a "
                    "conversation's KV from one run to the next."
                )
        return key

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

    async def _close_stale_tool_calls(self, key: str | None) -> None:
        """A model call of a conversation means its tools are done: close any whose end hook
        never came (a tool error that ended the hooks, a cancelled run resumed)."""
        if not self._pool.open_tool_runs():
            return
        cid = self._pool.get(key).conversation_id if key is not None else None
        for run_id in self._pool.open_tool_runs(cid):
            await self._pool.aend_tool(run_id)
