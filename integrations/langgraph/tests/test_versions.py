"""An unsupported framework version fails at import, naming the supported range."""

from __future__ import annotations

from importlib import metadata

import pytest

import kvtether_langgraph
from kvtether.errors import KVTetherError, UnsupportedVersionError
from kvtether_langgraph import (
    UnsupportedFrameworkVersion,
    UnsupportedFrameworkVersionError,
    check_versions,
)


def test_installed_versions_are_supported() -> None:
    check_versions()


def test_a_new_major_is_refused_naming_the_range() -> None:
    fake = {"langgraph": "2.0.1"}
    with pytest.raises(UnsupportedFrameworkVersionError, match=r"langgraph>=1\.0,<2\.0.*langgraph 2\.0\.1") as info:
        check_versions(lambda dist: fake.get(dist, "1.5.0"))
    assert "pip install 'langgraph>=1.0,<2.0'" in str(info.value)


@pytest.mark.parametrize("dist", ["langchain", "langchain-core", "langchain-openai", "langgraph"])
@pytest.mark.parametrize("version", ["0.3.30", "2.0.0", "garbage"])
def test_each_framework_outside_its_range_is_refused(dist: str, version: str) -> None:
    with pytest.raises(UnsupportedFrameworkVersionError, match=f"{dist}>=1\\.0,<2\\.0"):
        check_versions(lambda d: version if d == dist else "1.0.0")


@pytest.mark.parametrize("version", ["1.0.0", "1.5.2", "1.99.0"])
def test_every_release_in_the_range_is_accepted(version: str) -> None:
    check_versions(lambda dist: version)


def test_a_missing_framework_is_refused_with_the_install_line() -> None:
    def version(dist: str) -> str:
        if dist == "langchain-openai":
            raise metadata.PackageNotFoundError(dist)
        return "1.0.0"

    with pytest.raises(ImportError, match=r"pip install 'langchain-openai>=1\.0,<2\.0'"):
        check_versions(version)


def test_exported_names_are_pinned() -> None:
    assert sorted(kvtether_langgraph.__all__) == sorted(
        [
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
    )


def test_its_errors_sit_in_kvtether_s_one_tree_under_their_earlier_names_too() -> None:
    assert issubclass(UnsupportedFrameworkVersionError, UnsupportedVersionError)
    assert issubclass(UnsupportedFrameworkVersionError, ImportError)
    assert UnsupportedFrameworkVersion is UnsupportedFrameworkVersionError
    assert issubclass(kvtether_langgraph.ResponsesAPIUnsupportedError, KVTetherError)
    lg = kvtether_langgraph
    assert lg.ResponsesAPIUnsupported is lg.ResponsesAPIUnsupportedError
