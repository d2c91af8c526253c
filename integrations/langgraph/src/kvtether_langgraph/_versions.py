"""The framework versions this integration supports, checked once at import.

The integration uses the frameworks' public API only: ``ChatOpenAI``'s client fields and
``use_responses_api``, ``create_agent``'s middleware hooks, LangChain callbacks and
``langgraph.config.get_config``. These hold across each 1.x line, and the compat check
(``scripts/test-compat.sh``) runs the tests against the oldest and the newest release of every
range; another major may move them, so it fails at import, naming the range. ``SUPPORTED``
equals ``pyproject.toml``'s requirements (a test checks it).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from importlib import metadata

from kvtether.errors import UnsupportedVersionError

__all__ = [
    "SUPPORTED",
    "UnsupportedFrameworkVersionError",
    "UnsupportedFrameworkVersion",
    "check_versions",
]

# distribution -> (lowest supported, first unsupported), as (major, minor)
SUPPORTED: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "langchain": ((1, 0), (2, 0)),
    "langchain-core": ((1, 0), (2, 0)),
    "langchain-openai": ((1, 0), (2, 0)),
    "langgraph": ((1, 0), (2, 0)),
}


class UnsupportedFrameworkVersionError(UnsupportedVersionError):
    """An installed LangChain / LangGraph version is outside the range this integration
    supports."""


UnsupportedFrameworkVersion = UnsupportedFrameworkVersionError  # its earlier name


def _major_minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)(?:\.(\d+))?", version)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2) or 0)


def _range(dist: str) -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED[dist]
    return f"{dist}>={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"


def check_versions(version: Callable[[str], str] = metadata.version) -> None:
    """Raise ``UnsupportedFrameworkVersionError`` unless every framework package is in range."""
    for dist, (low, high) in SUPPORTED.items():
        try:
            installed = version(dist)
        except metadata.PackageNotFoundError:
            raise UnsupportedFrameworkVersionError(
                f"kvtether-langgraph needs {_range(dist)}, which is not installed: "
                f"pip install '{_range(dist)}'"
            ) from None
        parsed = _major_minor(installed)
        if parsed is None or not (low <= parsed < high):
            supported = ", ".join(_range(d) for d in SUPPORTED)
            raise UnsupportedFrameworkVersionError(
                f"kvtether-langgraph supports {_range(dist)}, but {dist} {installed} is "
                f"installed. Supported: {supported}. Install a supported version "
                f"(pip install '{_range(dist)}'), or a kvtether-langgraph release that "
                f"supports {dist} {installed}."
            )
