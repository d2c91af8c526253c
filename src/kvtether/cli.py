"""The ``kvtether`` command line.

Every flag comes from a settings model (pydantic-settings ``CliApp``): ``stack up`` from
:class:`~kvtether.stack.settings.StackSettings`, ``router`` from
:class:`~kvtether.router.settings.RouterSettings`. ``bench`` and ``demo`` hand their arguments
to their own entry points. User errors print one line and exit non-zero; this module is also the
only place that configures logging.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from importlib import import_module
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError
from pydantic_settings import (
    BaseSettings,
    CliApp,
    CliPositionalArg,
    CliSubCommand,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from kvtether.errors import KVTetherError
from kvtether._validation import first_field_error
from kvtether.harness.commands import HookGroup
from kvtether.router.front import FrontSettings
from kvtether.router.settings import RouterSettings
from kvtether.stack.models import ModelName
from kvtether.stack.settings import StackSettings, stack_settings_subset

__all__ = ["main"]

PASSTHROUGH = {"bench": "kvtether.bench.cli", "demo": "kvtether.demo"}


class _Exit(Exception):
    """Carries an exit code out of a ``cli_cmd`` (CliApp discards return values)."""

    def __init__(self, code: int) -> None:
        self.code = code


# --- kvtether model ---------------------------------------------------------------------------
class ModelPrepare(BaseModel):
    """Write an offline model (tiny, agents: seeded random Llamas; smol: SmolLM2-135M) and print
    its path."""

    name: CliPositionalArg[ModelName] = Field(description="which model")
    out: Path | None = Field(default=None, description="directory (default: the model cache)")
    force: bool = Field(default=False, description="rebuild even if already prepared")

    def cli_cmd(self) -> None:
        from kvtether.stack.models import prepare_model

        print(prepare_model(self.name, self.out, force=self.force))


class ModelGroup(BaseModel):
    """Prepare the offline models the stack serves."""

    prepare: CliSubCommand[ModelPrepare]

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


# --- kvtether stack ---------------------------------------------------------------------------
class StackUp(StackSettings):
    """Start N prefill + M decode vLLM instances and the router; Ctrl-C stops them."""

    def cli_cmd(self) -> None:
        from kvtether.stack.cli import run_up

        raise _Exit(run_up(self))


_StackTarget = stack_settings_subset(
    "StackTarget", ("config", "state_dir"), "Which stack: the one recorded in --state-dir."
)
_StackStopTarget = stack_settings_subset(
    "StackStopTarget", ("config", "state_dir", "stop_timeout_s"), "Which stack to stop."
)


class StackStatus(_StackTarget):  # type: ignore[misc, valid-type]
    """Show role, URL, pid, liveness and health of each process of the running stack."""

    def cli_cmd(self) -> None:
        from kvtether.stack.cli import run_status

        raise _Exit(run_status(self.state_dir))


class StackDown(_StackStopTarget):  # type: ignore[misc, valid-type]
    """Stop every process of the running stack (from any shell)."""

    def cli_cmd(self) -> None:
        from kvtether.stack.cli import run_down

        raise _Exit(run_down(self.state_dir, self.stop_timeout_s))


class StackGroup(BaseModel):
    """Run a disaggregated vLLM stack behind the kvtether router."""

    up: CliSubCommand[StackUp]
    status: CliSubCommand[StackStatus]
    down: CliSubCommand[StackDown]

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


# --- kvtether router --------------------------------------------------------------------------
class RouterCommand(RouterSettings):
    """Run the kvtether router (OpenAI-compatible, conversation-affine) in the foreground."""

    model_config = SettingsConfigDict(cli_kebab_case=True, cli_implicit_flags=True)

    def cli_cmd(self) -> None:
        try:
            serve = import_module("kvtether.router").serve
        except (ImportError, AttributeError):
            raise KVTetherError(
                "the kvtether router is not available (kvtether.router.serve)"
            ) from None
        serve(RouterSettings.model_validate(self.model_dump()))


class FrontCommand(FrontSettings):
    """Run a round-robin front for router replicas sharing a --store (`stack up --routers N`)."""

    model_config = SettingsConfigDict(cli_kebab_case=True, cli_implicit_flags=True)

    def cli_cmd(self) -> None:
        from kvtether.router.front import serve_front

        serve_front(FrontSettings.model_validate(self.model_dump()))


# --- pass-through commands (listed here for --help; main() dispatches them) -------------------
class BenchCommand(BaseModel):
    """Replay multi-turn agent sessions and compare strategies (see `kvtether bench --help`)."""


class DemoCommand(BaseModel):
    """Run the end-to-end demo on a local stack (see `kvtether demo --help`)."""


class KVTetherCli(BaseSettings):
    """kvtether: keep an agent's KV cache tethered to its conversation on P/D vLLM."""

    model_config = SettingsConfigDict(
        cli_prog_name="kvtether",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_exit_on_error=True,
        cli_use_class_docs_for_groups=True,
    )

    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="log level of kvtether's own messages"
    )
    model: CliSubCommand[ModelGroup]
    stack: CliSubCommand[StackGroup]
    router: CliSubCommand[RouterCommand]
    front: CliSubCommand[FrontCommand]
    hook: CliSubCommand[HookGroup]
    bench: CliSubCommand[BenchCommand]
    demo: CliSubCommand[DemoCommand]

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Only flags: an env var named like a subcommand (MODEL=...) must not leak in.
        return (init_settings,)

    def cli_cmd(self) -> None:
        configure_logging(self.log_level)
        CliApp.run_subcommand(self)


def configure_logging(level: str = "info") -> None:
    from rich.console import Console
    from rich.logging import RichHandler

    handler = RichHandler(console=Console(stderr=True), show_path=False, show_time=False)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("kvtether").setLevel(level.upper())


def _passthrough(command: str, argv: list[str], log_level: str) -> int:
    module_name = PASSTHROUGH[command]
    try:
        entry = import_module(module_name).main
    except (ImportError, AttributeError) as exc:  # e.g. an optional dependency is missing
        print(f"error: `kvtether {command}` cannot start: {exc}", file=sys.stderr)
        return 2
    configure_logging(log_level)
    return int(entry(argv) or 0)


def _first_validation_error(exc: ValidationError) -> str:
    err = first_field_error(exc)
    if isinstance(err.cause, KVTetherError):  # e.g. a ConfigError raised while reading --config
        return str(err.cause)
    loc = [p for p in err.path if not p.startswith(("function-", "json-"))]
    flag = "--" + loc[-1].replace("_", "-") if loc else "value"
    return f"invalid {flag}: {err.msg}"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    # `bench` and `demo` parse their own flags; only the root's --log-level may come first.
    at = 2 if args[:1] == ["--log-level"] else 0
    if len(args) > at and args[at] in PASSTHROUGH:
        return _passthrough(args[at], args[at + 1 :], args[1] if at else "info")
    try:
        CliApp.run(KVTetherCli, cli_args=args)
    except _Exit as exit_:
        return exit_.code
    except ValidationError as exc:
        print(f"error: {_first_validation_error(exc)}", file=sys.stderr)
        return 2
    except (KVTetherError, SettingsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
