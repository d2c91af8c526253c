"""Process mechanics: spawn in a fresh process group, stop the whole group, leave no orphans.

Every process the stack starts leads its own process group, so a terminal's Ctrl-C reaches only
``kvtether`` itself, which then stops the children in order, and stopping one instance signals
its whole group (vLLM's API server plus its EngineCore child).

It stays in the launcher's session, not a session of its own (``setpgid``, not ``setsid``):
Linux's scheduler autogroups (``kernel.sched_autogroup_enabled``, on by default in most
distributions) give each session one share of CPU per core, split across cores by where its load
is. With an instance per session, a vLLM worker pinned to a core it shares with another
instance's worker got no CPU at all for 10-47 s at a time while that worker computed, although
the other core had idle time: the 2P+2D "freeze" (docs/failures.md). In one session every thread
competes on its own, as it does with autogroups off.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

logger = logging.getLogger(__name__)

__all__ = [
    "spawn",
    "stop_group",
    "terminate",
    "is_alive",
    "create_time",
    "port_in_use",
    "free_port",
    "tail",
    "signals_deferred",
]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _own_group_dying_with_parent() -> None:  # Python 3.10: no ``process_group`` argument
    os.setpgid(0, 0)
    _die_with_parent()


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    log_path: Path,
    *,
    die_with_parent: bool = False,
    append: bool = False,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as the leader of a new process group in this session (module doc), stdout
    and stderr into ``log_path``.

    ``die_with_parent`` asks Linux to SIGTERM the child if this process dies without stopping
    it (e.g. SIGKILL of a foreground ``stack up``); detached stacks must not use it.
    ``append`` keeps what the log holds (a restarted instance's log keeps its crash).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    group: dict[str, Any] = {"preexec_fn": _die_with_parent if die_with_parent else None}
    if sys.version_info >= (3, 11):
        group["process_group"] = 0
    else:  # pragma: no cover - the 3.10 floor
        group["preexec_fn"] = (_own_group_dying_with_parent if die_with_parent
                               else lambda: os.setpgid(0, 0))
    with open(log_path, "ab" if append else "wb") as log:
        return subprocess.Popen(
            list(argv),
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            **group,
        )


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# Below this a recorded start time counts from boot (this module's); above, it is a Unix time
# (psutil's create_time, as earlier kvtether versions recorded it in stack.json).
_UNIX_TIME_FLOOR = 1e9


def _start_s(proc: psutil.Process) -> float:
    """When ``proc`` started, in seconds since boot.

    psutil's ``create_time`` adds the boot time to that, and Linux moves the boot time with
    every step of the wall clock (NTP, a resumed VM): a 17 s step made a running stack's
    processes look like strangers with reused pids, so ``stack down`` would have left them
    running. The kernel's start tick does not move.
    """
    try:
        with open(f"/proc/{proc.pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19]) / _CLK_TCK
    except FileNotFoundError:
        raise psutil.NoSuchProcess(proc.pid) from None
    except (OSError, ValueError, IndexError):  # no procfs: not Linux
        return float(proc.create_time())


def _is(proc: psutil.Process, started: float | None) -> bool:
    """True unless ``started`` says ``proc``'s pid named another process then."""
    if started is None:
        return True
    if started >= _UNIX_TIME_FLOOR:
        return abs(proc.create_time() - started) <= 1.0
    return abs(_start_s(proc) - started) <= 0.01


def create_time(pid: int) -> float | None:
    """When ``pid`` started (seconds since boot, immune to wall-clock steps); None if gone.
    Give it back to :func:`is_alive` / :func:`stop_group` to tell the process from a pid
    reused later."""
    try:
        return _start_s(psutil.Process(pid))
    except psutil.Error:
        return None


def is_alive(pid: int, started: float | None = None) -> bool:
    """True if ``pid`` runs (not a zombie) and, when given, was created at ``started``."""
    try:
        proc = psutil.Process(pid)
        if not _is(proc, started):
            return False  # the pid was reused by an unrelated process
        return bool(proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _group_members(pgid: int, not_before: float | None) -> list[psutil.Process]:
    """Processes in group ``pgid``; with ``not_before``, only those created since then."""
    members = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) != pgid:
                continue
            if not_before is None or _not_before(proc, not_before):
                members.append(proc)
    return members


def _killpg(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError as exc:  # a reused pgid we do not own
        logger.warning("cannot signal process group %d: %s", pgid, exc)


def stop_group(pid: int, started: float | None, timeout_s: float) -> list[int]:
    """Stop the process ``pid`` leads and every descendant; return pids that survived.

    SIGTERM to the group, wait up to ``timeout_s``, then SIGKILL the group and any descendant
    that left it (psutil tracks them even if they called setsid). Works when the leader has
    already died and left its children behind.
    """
    if _pid_reused(pid, started):
        # Linux never reuses a pid that still names a process group: ours is gone entirely.
        return []
    procs: dict[int, psutil.Process] = {}
    if is_alive(pid, started):
        with contextlib.suppress(psutil.Error):
            leader = psutil.Process(pid)
            procs = {p.pid: p for p in [leader, *leader.children(recursive=True)]}
    for proc in _group_members(pid, started):
        procs.setdefault(proc.pid, proc)
    live = [p for p in procs.values() if _running(p)]
    if live:
        _killpg(pid, signal.SIGTERM)
        live = _wait_gone(live, timeout_s)
    if live:
        logger.warning("%d process(es) of group %d ignored SIGTERM; killing", len(live), pid)
        _killpg(pid, signal.SIGKILL)
        for proc in live:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        live = _wait_gone(live, 5.0)
    _reap(pid)
    return [p.pid for p in live]


def terminate(pid: int, started: float | None, timeout_s: float) -> bool:
    """SIGTERM one process (not its group) and wait for it; SIGKILL after ``timeout_s``."""
    if not is_alive(pid, started):
        return True
    proc = psutil.Process(pid)
    with contextlib.suppress(psutil.Error):
        proc.terminate()
    if _wait_gone([proc], timeout_s):
        with contextlib.suppress(psutil.Error):
            proc.kill()
        return not _wait_gone([proc], 5.0)
    return True


def _reap(pid: int) -> None:
    """Collect ``pid``'s exit status if it is our own child (else nothing to do)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until every process has exited (zombies count as exited); return the rest."""
    deadline = time.monotonic() + timeout_s
    while True:
        for proc in procs:
            _reap(proc.pid)
        procs = [p for p in procs if _running(p)]
        if not procs or time.monotonic() >= deadline:
            return procs
        time.sleep(0.05)


def _not_before(proc: psutil.Process, started: float) -> bool:
    """``proc`` started at ``started`` or later (a group member of the leader started then)."""
    if started >= _UNIX_TIME_FLOOR:
        return bool(proc.create_time() >= started - 1.0)
    return _start_s(proc) >= started - 0.01


def _pid_reused(pid: int, started: float | None) -> bool:
    try:
        return not _is(psutil.Process(pid), started)
    except psutil.Error:
        return False


def _running(proc: psutil.Process) -> bool:
    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def port_in_use(host: str, port: int) -> bool:
    """True if something listens on (or otherwise holds) ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR lets us bind over TIME_WAIT leftovers of a stack we just stopped, but
        # still fails against a live listener.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            raise
    return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file ('' if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            data = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM until the block ends, so a second Ctrl-C cannot abort a shutdown.

    Only in the main thread (where Python runs signal handlers); elsewhere a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # Masking alone is not enough: a signal that arrived just before the block may already be
    # tripped in the interpreter, which then runs its handler inside the block. So the
    # handlers only note signals while the block runs; the original ones see them afterwards.
    noted: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, _frame: noted.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(sig) is not None}  # None: set outside Python
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if noted:
            handler = handlers[signal.Signals(noted[0])]
            if callable(handler):
                handler(noted[0], None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), noted[0])
