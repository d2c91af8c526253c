"""The openai-agents versions this integration is built and tested against, checked at import.

The integration reads the conversation key from the runner's prompt-cache grouping, a private
hook of ``OpenAIChatCompletionsModel``; another SDK version may move it, so an unknown version
fails at once with a message instead of silently sending every run to a fresh conversation.
"""

from __future__ import annotations

import importlib.metadata
import re

from kvtether.errors import UnsupportedVersionError

__all__ = ["SUPPORTED_AGENTS", "UnsupportedAgentsVersionError", "check_agents_version"]

# Inclusive lower bound, exclusive upper bound; keep in step with pyproject.toml.
SUPPORTED_AGENTS = ((0, 24), (0, 25))
SUPPORTED_RANGE = ">=0.24,<0.25"


class UnsupportedAgentsVersionError(UnsupportedVersionError):
    """The installed openai-agents is outside the range kvtether-openai-agents supports."""


def _release(version: str) -> tuple[int, ...]:
    match = re.match(r"(\d+(?:\.\d+)*)", version)
    return tuple(int(p) for p in match.group(1).split(".")) if match else ()


def check_agents_version(version: str | None = None) -> str:
    """Return the installed openai-agents version, or raise if it is outside the range."""
    if version is None:
        try:
            version = importlib.metadata.version("openai-agents")
        except importlib.metadata.PackageNotFoundError:
            raise UnsupportedAgentsVersionError(
                f"kvtether-openai-agents needs openai-agents {SUPPORTED_RANGE}, which is not "
                f"installed: pip install 'openai-agents{SUPPORTED_RANGE}'"
            ) from None
    low, high = SUPPORTED_AGENTS
    release = _release(version)
    if not release or not (low <= release < high):
        raise UnsupportedAgentsVersionError(
            f"kvtether-openai-agents supports openai-agents {SUPPORTED_RANGE}, found {version}: "
            f"pip install 'openai-agents{SUPPORTED_RANGE}' (or a kvtether-openai-agents release "
            f"made for {version})"
        )
    return version
