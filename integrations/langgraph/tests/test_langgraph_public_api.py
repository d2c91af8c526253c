"""The integration stands on the frameworks' public API only, and declares the ranges it checks.

These fail loudly, naming what moved, when a LangChain / LangGraph release changes what the
integration builds on.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

import langgraph.config
import pytest
from kvtether.session import SessionPool
from langchain.agents.middleware import AgentMiddleware, ModelRequest
from langchain_openai import ChatOpenAI
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from tests.support.public_api import private_names_used_but_not_defined

import kvtether_langgraph
from kvtether_langgraph import SUPPORTED, is_tethered, tether
from kvtether_langgraph._middleware import ToolCallRequest

from lg_support import chat_model

PACKAGE = Path(kvtether_langgraph.__file__).parent
PYPROJECT = PACKAGE.parents[1] / "pyproject.toml"


def test_no_private_name_of_another_package_is_used() -> None:
    assert private_names_used_but_not_defined(PACKAGE, "kvtether_langgraph") == []


def test_the_checker_catches_a_private_use(tmp_path: Path) -> None:
    # What is_tethered() read before: openai's private `_client`, and kvtether's own marker.
    (tmp_path / "m.py").write_text(
        "from langgraph._internal import x\n"
        "def f(model):\n    return model.root_client._client._kvtether_inner\n"
    )
    assert len(private_names_used_but_not_defined(tmp_path, "kvtether_langgraph")) == 3


def test_the_declared_ranges_are_the_ones_checked_at_import() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    declared = {r.name: r.specifier for r in map(Requirement, project["dependencies"])}
    for dist, (low, high) in SUPPORTED.items():
        checked = SpecifierSet(f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}")
        assert declared.get(dist) == checked, f"{dist}: pyproject {declared.get(dist)}"
    framework = {d for d in declared if d.startswith(("langchain", "langgraph"))}
    assert framework == set(SUPPORTED)


def test_what_the_integration_builds_on_is_still_there() -> None:
    fields = ChatOpenAI.model_fields
    assert {"root_client", "root_async_client", "client", "async_client",
            "use_responses_api"} <= set(fields)
    for hook in ("wrap_model_call", "awrap_model_call", "wrap_tool_call", "awrap_tool_call"):
        assert callable(getattr(AgentMiddleware, hook, None)), f"AgentMiddleware.{hook}"
    assert callable(ModelRequest.override)
    assert {"tool_call", "runtime"} <= {f.name for f in dataclasses.fields(ToolCallRequest)}
    with pytest.raises(RuntimeError):  # outside a runnable: what current_thread_id() expects
        langgraph.config.get_config()


def test_a_copy_of_a_tethered_model_is_tethered_too(router: Any, pool: SessionPool) -> None:
    tethered = tether(chat_model(router), pool)
    copy = tethered.model_copy(update={"temperature": 0.5})
    assert is_tethered(copy) and tether(copy, pool) is copy
    copy.invoke("hi", {"configurable": {"thread_id": "t-copy"}})
    assert pool.get("t-copy").turns


def test_an_explicit_chat_completions_choice_is_kept(
    router: Any, pool: SessionPool
) -> None:
    # reasoning= alone infers the Responses API (refused); use_responses_api=False says no.
    model = tether(chat_model(router, reasoning={"effort": "low"}, use_responses_api=False), pool)
    assert is_tethered(model) and model.use_responses_api is False
