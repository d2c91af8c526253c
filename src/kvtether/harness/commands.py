"""``kvtether hook ...``: the CLI's models for this package (``kvtether.cli`` mounts
:class:`HookGroup`). Only the CLI imports this module; the hook itself starts without it."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field
from pydantic_settings import CliApp, CliSubCommand

__all__ = ["HookGroup"]


class HookClaudeCode(BaseModel):
    """Handle one Claude Code hook event from stdin (the handler `hook install` registers)."""

    def cli_cmd(self) -> None:
        from kvtether.harness.claude_code import main

        main()  # always 0: a hook never fails the harness


class HookInstallClaudeCode(BaseModel):
    """Add kvtether's hooks to a Claude Code settings file (run again: no change)."""

    settings: Path | None = Field(
        default=None, description="settings file (default: ~/.claude/settings.json)")

    def cli_cmd(self) -> None:
        from kvtether.harness.install import install_claude_code

        print(f"kvtether hooks for Claude Code: {install_claude_code(self.settings)}")


class HookInstallOpenCode(BaseModel):
    """Copy kvtether's OpenCode plugin into a plugin folder (run again: no change)."""

    dir: Path | None = Field(
        default=None, description="plugin folder (default: ~/.config/opencode/plugins)")

    def cli_cmd(self) -> None:
        from kvtether.harness.install import install_opencode

        print(f"kvtether plugin for OpenCode: {install_opencode(self.dir)}")


class HookInstall(BaseModel):
    """Register kvtether's hooks with a coding-agent harness."""

    claude_code: CliSubCommand[HookInstallClaudeCode]
    opencode: CliSubCommand[HookInstallOpenCode]

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


class HookGroup(BaseModel):
    """Coding-agent hooks: heartbeat a conversation's KV while tools run, release it at the end."""

    claude_code: CliSubCommand[HookClaudeCode]
    install: CliSubCommand[HookInstall]

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)
