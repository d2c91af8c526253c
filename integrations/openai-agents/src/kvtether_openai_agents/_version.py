"""The openai-agents versions this integration supports, checked once at import.

The integration uses the SDK's public API only (``Model``, ``ModelProvider``,
``OpenAIChatCompletionsModel``, ``Runner``, ``RunConfig``, ``RunHooks``, ``get_current_trace``),
so the range is what the compat check (``scripts/test-compat.sh``) runs the tests against: its
oldest release and the newest one published. 0.4 is the first SDK on ``openai>=2``; the upper
bound is the next minor after the newest tested, since the SDK is pre-1.0 and a minor may
change the public API. Keep ``SUPPORTED_AGENTS`` equal to ``pyproject.toml``'s requirement (a
test checks it); a version outside it fails at import with the range and the install line.
"""

from __future__ import annotations

import importlib.metadata
import re

from kvtether.errors import UnsupportedVersionError

__all__ = [
    "SUPPORTED_AGENTS",
    "SUPPORTED_RANGE",
    "UnsupportedAgentsVersionError",
    "check_agents_version",
]

# Lowest supported release, first unsupported release; keep in step with pyproject.toml.
SUPPORTED_AGENTS: tuple[tuple[int, ...], tuple[int, ...]] = ((0, 4), (0, 26))


def _dotted(release: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in release)


SUPPORTED_RANGE = f">={_dotted(SUPPORTED_AGENTS[0])},<{_dotted(SUPPORTED_AGENTS[1])}"


class UnsupportedAgentsVersionError(UnsupportedVersionError):
    """The installed openai-agents is outside the range kvtether-openai-agents supports."""


def _release(version: str) -> tuple[int, ...]:
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(p) for p in match.group(1).split(".")) if match else ()


def check_agents_version(version: str | None = None) -> str:
    """Return the installed openai-agents version, or raise if it is outside the range."""
    install = f"pip install 'openai-agents{SUPPORTED_RANGE}'"
    if version is None:
        try:
            version = importlib.metadata.version("openai-agents")
        except importlib.metadata.PackageNotFoundError:
            raise UnsupportedAgentsVersionError(
                f"kvtether-openai-agents needs openai-agents {SUPPORTED_RANGE}, which is not "
                f"installed: {install}"
            ) from None
    low, high = SUPPORTED_AGENTS
    release = _release(version)
    if not release or not (low <= release < high):
        raise UnsupportedAgentsVersionError(
            f"kvtether-openai-agents supports openai-agents {SUPPORTED_RANGE}, but "
            f"openai-agents {version} is installed: {install}, or install a "
            f"kvtether-openai-agents release that supports openai-agents {version}"
        )
    return version
