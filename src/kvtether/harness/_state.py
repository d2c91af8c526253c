"""Which tools are running, as marker files a hook writes and a beater watches.

``<state_dir>/<conversation>/<tool call>.run`` exists while the tool runs (the tool's start
hook wrote it); ``.done`` says the tool ended (its end hook wrote it). The harness may run the
two hooks out of order (Claude Code's ``async`` hooks start in the background), so a start
that finds ``.done`` already there starts nothing, and a beater beats only while ``.run``
exists and ``.done`` does not. Removing a conversation's folder stops all of its beaters.

Names on disk are percent-encoded (a conversation id may hold ``:``, a tool call id anything).
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from pathlib import Path
from urllib.parse import quote, unquote

from kvtether.harness._settings import HookSettings

__all__ = ["ToolMarker", "conversation_dir", "ended", "forget", "session_conversations", "started"]

RUN = ".run"
DONE = ".done"
_MAX_NAME = 200  # bytes of one encoded name; most file systems allow 255


class ToolMarker:
    """The marker pair of one tool call."""

    def __init__(self, run: Path) -> None:
        self.run = run
        self.done = run.with_suffix(DONE)

    def running(self) -> bool:
        return self.run.exists() and not self.done.exists()

    def clear(self) -> None:
        for path in (self.run, self.done):
            path.unlink(missing_ok=True)


def _name(value: str) -> str:
    name = quote(value, safe="")
    if not name or len(name) > _MAX_NAME:
        raise ValueError(f"cannot name a marker after {value[:40]!r}")
    return name


def _private_dir(path: Path) -> Path:
    """``path``, created if needed, refused unless this user owns it and nobody else may
    write it (the default folder is under the shared /tmp when there is no XDG_RUNTIME_DIR)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or (hasattr(os, "getuid") and st.st_uid != os.getuid()) \
            or st.st_mode & 0o022:
        raise PermissionError(f"{path} is not a private folder of this user")
    return path


def conversation_dir(settings: HookSettings, conversation_id: str) -> Path:
    return settings.state_dir / _name(conversation_id)


def started(settings: HookSettings, conversation_id: str, tool_use_id: str) -> ToolMarker | None:
    """Mark the tool call running; ``None`` if it already ended (its end hook came first)."""
    _private_dir(settings.state_dir)
    folder = _private_dir(conversation_dir(settings, conversation_id))
    _prune(folder, settings.max_lease_s)
    marker = ToolMarker(folder / (_name(tool_use_id) + RUN))
    if marker.done.exists():
        marker.done.unlink(missing_ok=True)
        return None
    marker.run.touch()
    return marker


def ended(settings: HookSettings, conversation_id: str, tool_use_id: str) -> None:
    """Mark the tool call ended: its beater stops within ``poll_s``."""
    _private_dir(settings.state_dir)
    folder = _private_dir(conversation_dir(settings, conversation_id))
    marker = ToolMarker(folder / (_name(tool_use_id) + RUN))
    marker.done.touch()
    marker.run.unlink(missing_ok=True)


def forget(settings: HookSettings, conversation_id: str) -> None:
    """Stop every beater of the conversation and drop its markers."""
    shutil.rmtree(conversation_dir(settings, conversation_id), ignore_errors=True)


def session_conversations(settings: HookSettings, session_id: str) -> list[str]:
    """Conversations with markers that belong to ``session_id``: itself and its subagents
    (``<session>:agent:<id>``)."""
    try:
        names = [unquote(p.name) for p in settings.state_dir.iterdir() if p.is_dir()]
    except OSError:
        return []
    return sorted(n for n in names if n == session_id or n.startswith(f"{session_id}:agent:"))


def _prune(folder: Path, max_age_s: float) -> None:
    """Markers older than any beater lives: a crashed harness's, or an end with no start."""
    cutoff = time.time() - max_age_s - 60.0
    for path in folder.iterdir():
        try:
            if path.stat().st_mtime < cutoff:
                path.unlink()
        except OSError:
            pass

