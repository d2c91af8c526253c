"""The framework versions this integration supports, checked once at import.

langchain-openai's client fields and create_agent's middleware hooks are what the integration
builds on; a major version may move them, so another major fails at import, naming the range.
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
                f"installed. Supported: {supported}. Install a supported version, or a "
                f"kvtether-langgraph release made for {dist} {installed}."
            )
