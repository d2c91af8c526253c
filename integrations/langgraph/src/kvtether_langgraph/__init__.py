"""kvtether for LangChain / LangGraph: each ``thread_id`` keeps its KV on disaggregated vLLM.

``create_agent`` (one line)::

    agent = create_agent(model, tools, middleware=[KVTetherMiddleware(pool)])

``create_react_agent``, ``ToolNode`` and hand-built graphs::

    model = tether(ChatOpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-"), pool)
    # optional, heartbeats while tools run:
    config = {"configurable": {"thread_id": t}, "callbacks": [KVTetherCallbackHandler(pool)]}

Chat Completions only. Importing this package checks the LangChain / LangGraph versions and
raises ``UnsupportedFrameworkVersionError`` (naming the supported range) outside them.
"""

from kvtether_langgraph._versions import (
    SUPPORTED,
    UnsupportedFrameworkVersion,
    UnsupportedFrameworkVersionError,
    check_versions,
)

check_versions()

from kvtether_langgraph._middleware import KVTetherMiddleware  # noqa: E402
from kvtether_langgraph._model import (  # noqa: E402
    ResponsesAPIUnsupported,
    ResponsesAPIUnsupportedError,
    is_tethered,
    tether,
)
from kvtether_langgraph._thread import current_thread_id, thread_id_of  # noqa: E402
from kvtether_langgraph._tools import KVTetherCallbackHandler  # noqa: E402

__all__ = [
    "KVTetherMiddleware",
    "KVTetherCallbackHandler",
    "tether",
    "is_tethered",
    "current_thread_id",
    "thread_id_of",
    "ResponsesAPIUnsupportedError",
    "UnsupportedFrameworkVersionError",
    "ResponsesAPIUnsupported",
    "UnsupportedFrameworkVersion",
    "SUPPORTED",
    "check_versions",
]
