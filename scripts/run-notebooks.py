"""Run every notebook in examples/ on one bundled `smol` stack and save it with its outputs.

    make notebooks          # or: .venv/bin/python scripts/run-notebooks.py [NAME.ipynb ...]

The notebooks are committed with the outputs of such a run, so that their charts show where
people browse them. One stack (cpu-smol, kvtether, 10 s leases) serves all of them; the script
stops it at the end, also on errors and Ctrl-C. `make test` runs the notebooks again against
its own test stack, without writing them.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from kvtether.stack import Stack, StackSettings

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
LEASE_S = 10.0  # short enough that the LangGraph notebook's slow tool outlasts it


def main(names: list[str]) -> int:
    paths = [EXAMPLES / n for n in names] if names else sorted(EXAMPLES.glob("*.ipynb"))
    settings = StackSettings(profile="cpu-smol", connector="kvtether", lease_ttl_s=LEASE_S)
    with Stack(settings) as stack:
        os.environ.update(
            KVTETHER_ROUTER_URL=stack.router_url,
            KVTETHER_SERVED_MODEL_NAME=stack.served_model_name,
            KVTETHER_LEASE_S=str(LEASE_S),
            MPLBACKEND="module://matplotlib_inline.backend_inline",
        )
        for path in paths:
            nb = nbformat.read(path, as_version=4)
            started = time.monotonic()
            NotebookClient(nb, timeout=900, kernel_name="python3",
                           resources={"metadata": {"path": str(EXAMPLES)}}).execute()
            nbformat.write(nb, path)
            print(f"{path.name}: {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
