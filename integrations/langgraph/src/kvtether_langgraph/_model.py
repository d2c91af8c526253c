"""``tether(ChatOpenAI(...))``: the same chat model, each request tagged with its thread.

The copy's OpenAI clients (``root_client`` / ``root_async_client``, and ``client`` /
``async_client`` derived from them) are ``SessionPool.wrap`` copies of the originals, whose
resolver is the LangGraph ``thread_id`` of the run sending the request. Everything else --
messages, tool calls, usage metadata, streaming chunks, errors -- is ``ChatOpenAI``'s own.

Chat Completions only: kvtether follows ``/chat/completions`` turns, so the copy has
``use_responses_api=False`` and never switches to the Responses API on its own (built-in tools
or Responses-only arguments would otherwise switch a plain ``ChatOpenAI`` per request).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from kvtether import SessionPool
from kvtether.errors import ConfigError
from langchain_openai import ChatOpenAI

from kvtether_langgraph._thread import current_thread_id, thread_scope

__all__ = [
    "ResponsesAPIUnsupportedError", "ResponsesAPIUnsupported", "tether", "is_tethered",
]


class ResponsesAPIUnsupportedError(ConfigError):
    """A model asked to use OpenAI's Responses API, which kvtether does not tether."""


ResponsesAPIUnsupported = ResponsesAPIUnsupportedError  # its earlier name


def is_tethered(model: Any) -> bool:
    """Whether ``model`` came from ``tether()`` (or is a copy of one, e.g. ``model_copy``):
    its requests already go through kvtether."""
    return isinstance(model, _ThreadFromConfig)


# ChatOpenAI fields that make it use the Responses API when ``use_responses_api`` is unset.
# langchain-openai sets ``use_responses_api=True`` itself for them at construction in later
# 1.x releases; earlier 1.x releases (1.0) decide it per request, so they are read here.
_RESPONSES_FIELDS = ("include", "reasoning", "truncation", "context_management")


def _uses_responses_api(model: ChatOpenAI) -> bool:
    """Whether ``model`` sends (or would infer) Responses API requests, from public fields."""
    if model.use_responses_api is not None:
        return bool(model.use_responses_api)
    return (
        getattr(model, "output_version", None) == "responses/v1"
        or bool(getattr(model, "use_previous_response_id", False))
        or any(getattr(model, field, None) is not None for field in _RESPONSES_FIELDS)
    )


def tether(model: ChatOpenAI, pool: SessionPool) -> ChatOpenAI:
    """A copy of ``model`` whose requests belong to the session of their LangGraph thread.

    ``pool``: the ``SessionPool`` keeping one session per thread (its ``base_url`` is the
    kvtether router; without one it is taken from the model's ``base_url``).
    Raises ``ResponsesAPIUnsupportedError`` if the model uses (or would infer) the Responses API.
    """
    if not isinstance(model, ChatOpenAI):
        raise ConfigError(
            f"tether() expects a langchain_openai.ChatOpenAI, got "
            f"{type(model).__module__}.{type(model).__qualname__}"
        )
    if is_tethered(model):
        return model
    if _uses_responses_api(model):
        raise ResponsesAPIUnsupportedError(
            "kvtether tethers Chat Completions (/v1/chat/completions) only, but this ChatOpenAI "
            "uses the Responses API (use_responses_api=True, set by you or inferred from "
            "reasoning=, include=, truncation=, output_version='responses/v1' or "
            "use_previous_response_id=). Build it with use_responses_api=False (vLLM serves "
            "reasoning through Chat Completions too)."
        )
    if model.root_client is None or model.root_async_client is None:
        raise ConfigError(
            "this ChatOpenAI has no OpenAI client yet (no api_key): pass api_key= (any "
            "string for a local router) before tethering it"
        )
    root = pool.wrap(model.root_client, current_thread_id)
    aroot = pool.wrap(model.root_async_client, current_thread_id)
    tethered = model.model_copy(
        update={
            "root_client": root,
            "client": root.chat.completions,
            "root_async_client": aroot,
            "async_client": aroot.chat.completions,
            "use_responses_api": False,
        }
    )
    tethered.__class__ = _tethered_class(type(model))
    return tethered


_CLASSES: dict[type, type] = {}


def _tethered_class(cls: type) -> type:
    """``cls`` with its entry points reading the thread from the call's own ``config``."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (_ThreadFromConfig, cls), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return _CLASSES[cls]


class _ThreadFromConfig:
    """``model.invoke(msgs, config={"configurable": {"thread_id": t}})`` belongs to thread
    ``t``: a chat model's own call starts no child runnable, so no LangGraph context says so.
    (``batch`` / ``abatch`` call these once per input, with each input's config.)"""

    def invoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any:
        with thread_scope(config):
            return super().invoke(input, config, **kwargs)  # type: ignore[misc]

    async def ainvoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any:
        with thread_scope(config):
            return await super().ainvoke(input, config, **kwargs)  # type: ignore[misc]

    def stream(self, input: Any, config: Any = None, **kwargs: Any) -> Iterator[Any]:
        with thread_scope(config):
            yield from super().stream(input, config, **kwargs)  # type: ignore[misc]

    async def astream(self, input: Any, config: Any = None, **kwargs: Any) -> AsyncIterator[Any]:
        with thread_scope(config):
            async for chunk in super().astream(input, config, **kwargs):  # type: ignore[misc]
                yield chunk
