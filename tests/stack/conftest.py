from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from kvtether.stack.settings import StackSettings

from .stack_fakes import free_port_block


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path


@pytest.fixture
def fake_settings(tmp_path: Path, model_dir: Path) -> StackSettings:
    return StackSettings(
        model=model_dir,
        state_dir=tmp_path / "state",
        port=free_port_block(1),
        base_port=free_port_block(8),
        side_channel_base_port=free_port_block(80),
        health_timeout_s=20,
        stop_timeout_s=3,
    )


@pytest.fixture
def no_leaks() -> Iterator[None]:
    """Fail if a test leaves any child/descendant process of this test process behind."""
    yield
    me = psutil.Process()
    left = [p for p in me.children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    for p in left:
        p.kill()
    assert not left, f"leaked processes: {[p.cmdline() for p in left]}"


@pytest.fixture(autouse=True)
def _no_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake servers answer /health only; the warm-up turns need a real P/D stack."""
    monkeypatch.setenv("KVTETHER_WARM_UP", "false")
