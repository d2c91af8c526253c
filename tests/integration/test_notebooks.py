"""Every example notebook runs top to bottom against the test session's real P/D stack.

The notebooks run against the ``short_lease`` router (10 s leases), so the LangGraph notebook's
slow tool outlasts the decode lease and the KV survives only if heartbeats renew it. Each
notebook ends with a chart of reused vs. recomputed prompt tokens and leaves its turns in
``turns`` (a list, or a dict of lists per conversation); the test appends one cell of its own
that prints each turn's outcome as ``KVTETHER_OUTCOMES {json}``, so the notebooks carry no
test-only lines.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
MARK = "KVTETHER_OUTCOMES "
REPORT_CELL = f"""import json as _json
_turns = turns if isinstance(turns, dict) else {{"conversation": turns}}
print({MARK.strip()!r}, _json.dumps({{k: [t.outcome for t in v] for k, v in _turns.items()}}))
"""


def _outputs(nb, kind: str) -> list[dict]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == kind]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, short_lease, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("KVTETHER_ROUTER_URL", short_lease.base_url)
    monkeypatch.setenv("KVTETHER_SERVED_MODEL_NAME", short_lease.model)
    monkeypatch.setenv("KVTETHER_LEASE_S", str(short_lease.lease_ttl_s))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    # The kernel runs in examples/: import this checkout's package and integrations.
    paths = [ROOT / "src", ROOT / "integrations/langgraph/src",
             ROOT / "integrations/openai-agents/src"]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [*map(str, paths), *filter(None, [os.environ.get("PYTHONPATH", "")])]))
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(REPORT_CELL))
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(EXAMPLES)}})
    started = time.monotonic()
    client.execute()
    print(f"{path.name}: {time.monotonic() - started:.1f} s")
    errors = _outputs(nb, "error")
    assert not errors, errors

    chart = nb.cells[-2]  # the notebook's own last cell
    assert chart.cell_type == "code"
    assert any("image/png" in o.get("data", {}) for o in chart.get("outputs", [])), chart.outputs

    lines = [line for o in _outputs(nb, "stream") for line in o.get("text", "").splitlines()
             if line.startswith(MARK)]
    assert len(lines) == 1, lines
    outcomes: dict[str, list[str]] = json.loads(lines[0][len(MARK):])
    assert outcomes, outcomes
    for conversation, turns in outcomes.items():
        assert len(turns) >= 2, (conversation, turns)
        assert all(o == "fired" for o in turns[1:]), (conversation, turns)
