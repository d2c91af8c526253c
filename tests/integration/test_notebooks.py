"""Every example notebook runs top to bottom against the test session's real P/D stack."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, pd_stack, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("KVTETHER_ROUTER_URL", pd_stack.base_url)
    monkeypatch.setenv("KVTETHER_SERVED_MODEL_NAME", pd_stack.model)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(EXAMPLES)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors
