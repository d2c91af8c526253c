"""kvtether for the OpenAI Agents SDK: each run's KV stays tethered to its conversation.

    from agents import RunConfig, Runner
    from kvtether_openai_agents import KVTetherProvider

    kv = KVTetherProvider("http://127.0.0.1:8000")          # the kvtether router
    result = await Runner.run(agent, "hi", session=sdk_session,
                              run_config=RunConfig(model_provider=kv), hooks=kv.hooks)

The conversation id comes from the runner's grouping: ``conversation_id``, else the SDK
``Session``'s id, else ``RunConfig.group_id``, else one conversation per run.
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
