"""The integration stands on the SDK's public API only, and declares the range it checks.

These fail loudly, naming what moved, when an SDK release changes what the provider builds on.
"""

from __future__ import annotations

import dataclasses
import inspect
import tomllib
from pathlib import Path

import agents
import pytest
from agents import (
    Model,
    ModelProvider,
    OpenAIChatCompletionsModel,
    RunConfig,
    RunHooks,
    Runner,
)
from agents.tool_context import ToolContext  # what on_tool_start gets for a function tool
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from tests.support.public_api import private_names_used_but_not_defined

import kvtether_openai_agents
from kvtether_openai_agents import SUPPORTED_RANGE

PACKAGE = Path(kvtether_openai_agents.__file__).parent
PYPROJECT = PACKAGE.parents[1] / "pyproject.toml"

# Model.get_response / stream_response: the positional parameters, in order, that the tethered
# model takes by name (everything keyword-only is passed on as it came).
MODEL_POSITIONAL = [
    "system_instructions", "input", "model_settings", "tools", "output_schema", "handoffs",
    "tracing",
]


def test_no_private_name_of_another_package_is_used() -> None:
    assert private_names_used_but_not_defined(PACKAGE, "kvtether_openai_agents") == []


def test_the_checker_catches_a_private_use(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        "from agents.run_internal.x import _key\nimport agents._config\n"
        "def f(model):\n    return model._client\n"
    )
    assert len(private_names_used_but_not_defined(tmp_path, "kvtether_openai_agents")) == 3


@pytest.mark.parametrize("method", ["get_response", "stream_response"])
def test_the_model_interface_keeps_its_parameters(method: str) -> None:
    for cls in (Model, OpenAIChatCompletionsModel):
        params = list(inspect.signature(getattr(cls, method)).parameters.values())[1:]
        assert [p.name for p in params[:7]] == MODEL_POSITIONAL, f"{cls.__name__}.{method}"
        assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params[:7])
        rest = {p.name: p.kind for p in params[7:]}
        assert "conversation_id" in rest, f"{cls.__name__}.{method} lost conversation_id"
        if cls is Model:  # the interface passes everything after `tracing` by keyword
            assert set(rest.values()) == {inspect.Parameter.KEYWORD_ONLY}


@pytest.mark.parametrize("entry", ["run", "run_sync", "run_streamed"])
def test_the_runner_keeps_the_arguments_kv_run_reads(entry: str) -> None:
    params = inspect.signature(getattr(Runner, entry)).parameters
    assert {"conversation_id", "session", "run_config", "hooks"} <= set(params)


def test_run_config_hooks_and_tracing_keep_what_the_provider_uses() -> None:
    assert dataclasses.is_dataclass(RunConfig)
    assert {"model_provider", "group_id"} <= {f.name for f in dataclasses.fields(RunConfig)}
    assert {"on_tool_start", "on_tool_end"} <= set(dir(RunHooks))
    assert "tool_call_id" in {f.name for f in dataclasses.fields(ToolContext)}
    assert callable(agents.tracing.get_current_trace)
    assert "get_model" in ModelProvider.__abstractmethods__


def test_the_declared_range_is_the_one_checked_at_import() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    (agents_req,) = [
        r for r in map(Requirement, project["dependencies"]) if r.name == "openai-agents"
    ]
    assert agents_req.specifier == SpecifierSet(SUPPORTED_RANGE)
    assert SUPPORTED_RANGE in PYPROJECT.parent.joinpath("README.md").read_text()
