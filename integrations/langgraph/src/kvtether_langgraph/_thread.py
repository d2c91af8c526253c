"""Which LangGraph thread the code running now belongs to.

LangGraph runs every node with its ``RunnableConfig`` in a context variable (what
``langgraph.config.get_config()`` reads); the run's ``thread_id`` is in its ``configurable``
(and LangGraph copies it into ``metadata``). Context variables follow the code into the worker
threads and tasks LangGraph starts, so a model request or tool sees the thread of its own run,
whatever else runs concurrently.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from typing import Any

from langgraph.config import get_config

__all__ = ["current_thread_id", "thread_id_of", "thread_scope"]

# The thread of a tethered model's own call (``model.invoke(msgs, config={"configurable":
# {"thread_id": ...}})``), which no runnable context carries: the model runs no child runnable.
_CALL_THREAD: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvtether_langgraph_call_thread", default=None
)


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
    given = _CALL_THREAD.get()
    if given is not None:
        return given
    try:
        config = get_config()
    except RuntimeError:  # outside any runnable
        return None
    return thread_id_of(config)


@contextlib.contextmanager
def thread_scope(config: Mapping[str, Any] | None) -> Iterator[None]:
    """While it lasts, ``current_thread_id()`` is ``config``'s thread, when it names one."""
    thread_id = thread_id_of(config)
    if thread_id is None:
        yield
        return
    token = _CALL_THREAD.set(thread_id)
    try:
        yield
    finally:
        try:
            _CALL_THREAD.reset(token)
        except ValueError:  # a generator finished in another context: clear it there
            _CALL_THREAD.set(None)
