"""kvtether for the OpenAI Agents SDK: each run's KV stays tethered to its conversation.

    from kvtether_openai_agents import KVTetherProvider

    kv = KVTetherProvider("http://127.0.0.1:8000")          # the kvtether router
    result = await kv.run(agent, "hi", session=sdk_session)  # Runner.run's arguments

The conversation is the run's grouping, in the runner's order: ``conversation_id``, else the
SDK ``Session``'s id, else ``RunConfig.group_id``, else one conversation per run. With
``Runner`` itself: ``RunConfig(model_provider=kv.bind(session=sdk_session))``, and
``hooks=kv.hooks`` for heartbeats while tools run. Public SDK API only; importing the package
checks the openai-agents version (``SUPPORTED_RANGE``).
"""

from kvtether_openai_agents._version import (
    SUPPORTED_RANGE,
    UnsupportedAgentsVersionError,
    check_agents_version,
)

check_agents_version()

from kvtether_openai_agents._hooks import KVTetherHooks  # noqa: E402
from kvtether_openai_agents._provider import KVTetherProvider  # noqa: E402

__all__ = [
    "KVTetherProvider",
    "KVTetherHooks",
    "UnsupportedAgentsVersionError",
    "SUPPORTED_RANGE",
]
