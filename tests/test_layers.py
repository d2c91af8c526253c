"""The package's layers hold (import-linter contracts in pyproject.toml, `[tool.importlinter]`)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(
    importlib.util.find_spec("kvtether_langgraph") is None
    or importlib.util.find_spec("kvtether_openai_agents") is None,
    reason="the contracts cover the integrations, installed on Python >= 3.11 (make setup)",
)
def test_the_import_contracts_are_kept() -> None:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe is not None, "import-linter is part of the dev extra: pip install -e '.[dev]'"
    done = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
