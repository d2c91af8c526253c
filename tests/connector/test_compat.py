"""The one vLLM version the connector targets, and where it is checked."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtether.connector import TARGET_VLLM_VERSION, VLLMVersionError, check_vllm_version
from kvtether.connector import _compat
from kvtether.errors import KVTetherError


def test_version_guard_names_both_versions() -> None:
    assert check_vllm_version(TARGET_VLLM_VERSION) == TARGET_VLLM_VERSION
    assert check_vllm_version(TARGET_VLLM_VERSION + "+cpu") == TARGET_VLLM_VERSION + "+cpu"
    with pytest.raises(VLLMVersionError) as err:
        check_vllm_version("0.33.1")
    assert "0.33.1" in str(err.value) and TARGET_VLLM_VERSION in str(err.value)
    assert isinstance(err.value, KVTetherError)


def test_the_package_imports_without_vllm() -> None:
    # The stack and the router read TARGET_VLLM_VERSION; only the connector needs vLLM.
    code = ("import sys, kvtether.connector, kvtether.connector._compat; "
            "assert 'vllm' not in sys.modules, 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_importing_vllm_s_internals_checks_the_version_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    vllm = pytest.importorskip("vllm")
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.delattr(_compat, "VLLM_VERSION", raising=False)
    monkeypatch.delitem(sys.modules, "kvtether.connector._compat.upstream", raising=False)
    with pytest.raises(VLLMVersionError, match="0.99.0"):
        import kvtether.connector._compat.upstream  # noqa: F401


def test_upstream_s_read_marker() -> None:
    params: dict[str, object] = {"do_remote_decode": True}
    assert not _compat.remote_read_done(params)
    _compat.mark_remote_read_done(params)
    assert _compat.remote_read_done(params)
    assert set(params) == {"do_remote_decode", "_remote_blocks_processed"}  # upstream's key
