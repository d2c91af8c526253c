"""What ``kvtether stack up|status|down`` do, with terminal output. The CLI root calls these."""

from __future__ import annotations

import signal
from pathlib import Path
from types import FrameType
from typing import Any

from kvtether.stack._commands import CommandBuilder
from kvtether.errors import InstanceFailedError, RestartsExhaustedError
from kvtether.stack._procs import tail
from kvtether.stack._state import state_path
from kvtether.stack.launcher import Stack, stack_down, stack_status
from kvtether.stack.settings import StackSettings

__all__ = ["run_up", "run_status", "run_down"]


def _console() -> Any:
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_up(settings: StackSettings, commands: CommandBuilder | None = None) -> int:
    """Start the stack; in the foreground, keep it up until Ctrl-C, SIGTERM or a crash."""
    console = _console()
    # `stack down` from another shell and service managers send SIGTERM, a closed terminal
    # SIGHUP: both take the Ctrl-C path (unless SIGHUP is ignored, as under nohup).
    signal.signal(signal.SIGTERM, _raise_interrupt)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _raise_interrupt)
    stack = Stack(
        settings,
        commands=commands,
        progress=True,
        console=console,
        die_with_parent=not settings.detach,
        owner_stops_on_sigterm=True,
    )
    try:
        stack.up()
        _print_ready(console, stack, settings)
        if settings.detach:
            return 0
        if settings.restart:
            stack.supervise(say=lambda line: console.print(f"[yellow]{line}[/]", markup=True))
        exited = stack.wait()
    except InstanceFailedError as exc:
        _print_failure(console, exc)
        return 1
    except RestartsExhaustedError as exc:
        console.print(f"[red]error:[/] {exc}", markup=True)
        console.print(exc.log_tail, markup=False, style="dim")
        stack.down()
        console.print("stopped the stack")
        return 1
    except KeyboardInterrupt:
        if stack.state is None:  # up() has already stopped what it had started
            console.print("[yellow]interrupted while starting; stopped everything[/]")
            return 130
        console.print("stopping the stack…")
        stack.down()
        console.print("stopped")
        return 0
    console.print(f"[red]{exited.name} exited unexpectedly[/]; stopping the stack")
    console.print(tail(exited.log_path), markup=False, style="dim")
    console.print(f"log: {exited.log_path}")
    stack.down()
    return 1


def _print_ready(console: Any, stack: Stack, settings: StackSettings) -> None:
    url = stack.router_url if settings.start_router else ", ".join(stack.prefill_urls)
    console.print(f"[green]stack is up[/]: {url}  model [bold]{stack.served_model_name}[/]")
    if len(stack.router_replica_urls) > 1:
        console.print(f"round-robin front over {len(stack.router_replica_urls)} router "
                      f"replicas: {', '.join(stack.router_replica_urls)}")
    console.print(f"state: {state_path(settings.state_dir)}")
    if settings.detach:
        console.print("stop it with: kvtether stack down" + _state_dir_hint(settings.state_dir))
    else:
        console.print("press Ctrl-C to stop")


def _state_dir_hint(state_dir: Path) -> str:
    default = StackSettings.model_fields["state_dir"].get_default(call_default_factory=True)
    return "" if Path(state_dir) == default else f" --state-dir {state_dir}"


def _print_failure(console: Any, exc: InstanceFailedError) -> None:
    console.print(f"[red]error:[/] {exc}", markup=True)
    if exc.log_tail:
        console.print(f"--- last lines of {exc.log_path} ---", markup=False)
        console.print(exc.log_tail, markup=False, style="dim")
    console.print("stopped everything that had started")


def run_status(state_dir: Path) -> int:
    """Print a table of the recorded stack; exit 0 if every process is alive and healthy."""
    from rich.console import Console
    from rich.table import Table

    rows = stack_status(state_dir)
    table = Table("role", "name", "url", "pid", "alive", "health")
    for r in rows:
        table.add_row(
            r.role,
            r.name,
            r.url,
            str(r.pid),
            "[green]yes[/]" if r.alive else "[red]no[/]",
            "[green]ok[/]" if r.healthy else "[red]down[/]",
        )
    console = Console(highlight=False)
    console.print(table)
    console.print(f"logs: {rows[0].log_path.parent}" if rows else "no processes recorded")
    return 0 if all(r.alive and r.healthy for r in rows) else 1


def run_down(state_dir: Path, stop_timeout_s: float) -> int:
    console = _console()
    records = stack_down(state_dir, stop_timeout_s)
    console.print(f"stopped {len(records)} process(es): " + ", ".join(r.name for r in records))
    return 0
