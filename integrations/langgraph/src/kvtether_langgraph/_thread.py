"""Which LangGraph thread the code running now belongs to.

LangGraph runs every node with its ``RunnableConfig`` in a context variable (what
``langgraph.config.get_config()`` reads); the run's ``thread_id`` is in its ``configurable``
(and LangGraph copies it into ``metadata``). Context variables follow the code into the worker
threads and tasks LangGraph starts, so a model request or tool sees the thread of its own run,
whatever else runs concurrently.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from langchain_core.runnables.config import var_child_runnable_config

__all__ = ["current_thread_id", "thread_id_of"]


def thread_id_of(config: Mapping[str, Any] | None) -> str | None:
    """The ``thread_id`` of a run's config (``configurable``, else ``metadata``), or None."""
    if not config:
        return None
    for section in ("configurable", "metadata"):
        value = (config.get(section) or {}).get("thread_id")
        if value is not None:
            return str(value)  # a thread id may be a UUID or an int
    return None


def current_thread_id() -> str | None:
    """The LangGraph ``thread_id`` of the run the calling code belongs to, or None outside
    a run (or in a run started without one). A resolver for ``SessionPool.wrap``."""
    return thread_id_of(var_child_runnable_config.get())
