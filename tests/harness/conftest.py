"""Hook fixtures: the environment a harness gives its hooks, pointed at the fake router of
tests.support, with a state folder of the test's own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtether.harness import HookSettings
from tests.support.fake_router import (  # noqa: F401
    Conversation, FakeRouter, _server, dead_url, router,
)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def hook_env(router: FakeRouter, state_dir: Path,
             monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """Settings as a hook reads them (``os.environ``), for the fake router."""
    env = {"KVTETHER_URL": router.url, "KVTETHER_HOOK_STATE_DIR": str(state_dir)}
    for name in ("KVTETHER_API_KEY", "KVTETHER_HOOK_MAX_LEASE_S", "CLAUDE_PID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    yield env


@pytest.fixture
def settings(hook_env: dict[str, str]) -> HookSettings:
    return HookSettings.from_env()


def hold(router: FakeRouter, *conversation_ids: str) -> None:
    """The router holds KV for these conversations (a turn of each was answered)."""
    for cid in conversation_ids:
        router.conversations[cid] = Conversation(turns=1, held_tokens=100)
