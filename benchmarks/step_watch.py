"""Catch a vLLM engine step that does not end, while it still does not end.

Polls every kvtether instance on this host (its connector's control channel,
``GET /kvtether/v1/status``: ``step_running_s``, how long the engine's step in flight has
waited for its worker) and, when one passes ``--after-s``, takes py-spy dumps (Python and
native frames) of every vLLM process of every instance, the stalled instance's engine core and
worker first, then reads that instance's status again. The stall report inside the worker
speaks only after 60 s and the router only after ``--stall-after-s``; stalls seen on loaded
2-core hosts lasted 60-110 s, so a dump taken at 60 s often shows a worker that has just
resumed (docs/failures.md).

Instances are found from their command lines (``kvtether_control_port`` in
``--kv-transfer-config``), so it also watches a stack during its warm-up, before
``stack.json`` exists. Each instance's control secret is read from its environment
(``/proc/<pid>/environ``): run it as the user that runs the stack.

    python -m benchmarks.step_watch --out /tmp/step-dumps --after-s 15

Not part of ``make test``; Ctrl-C stops it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from benchmarks.soak import dump_stacks
from kvtether.protocol import CONTROL_SECRET_ENV


@dataclass(frozen=True)
class Instance:
    name: str
    pid: int  # the API server; its children are the engine core and the worker
    control_port: int
    secret: str | None


def instances() -> list[Instance]:
    """Every vLLM API server on this host that loads the kvtether connector."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "--kv-transfer-config" not in cmd or not any("api_server" in c for c in cmd):
            continue
        try:
            extra = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
            extra = extra.get("kv_connector_extra_config") or {}
            port = int(extra["kvtether_control_port"])
        except (ValueError, KeyError, IndexError, TypeError):
            continue
        found.append(Instance(f"{extra.get('kvtether_role', 'vllm')}-{port}", proc.pid, port,
                              _secret(proc.pid)))
    return found


def _secret(pid: int) -> str | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = CONTROL_SECRET_ENV.encode() + b"="
    return next((e[len(prefix):].decode() for e in environ if e.startswith(prefix)), None)


def step_running_s(client: httpx.Client, inst: Instance) -> float | None:
    headers = {"Authorization": f"Bearer {inst.secret}"} if inst.secret else {}
    try:
        r = client.get(f"http://127.0.0.1:{inst.control_port}/kvtether/v1/status",
                       headers=headers, timeout=5)
        return r.json().get("step_running_s") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def dump(all_instances: list[Instance], stalled: Instance, out: Path) -> list[str]:
    """py-spy dumps of every vLLM process (``benchmarks.soak.dump_stacks``), the stalled
    instance's first."""
    prefix = f"{stalled.name}-stalled-"
    return [path for inst in sorted(all_instances, key=lambda i: i != stalled)
            for path in dump_stacks(inst, out, prefix)]


def watching(before: list[Instance] | None, now: list[Instance]) -> str | None:
    """What to say when the set of instances watched changed (None: it did not)."""
    if before is not None and {i.name for i in before} == {i.name for i in now}:
        return None
    if not now:
        return "no vLLM instance with the kvtether connector found (yet)"
    return "watching " + ", ".join(sorted(i.name for i in now))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where the dumps go")
    parser.add_argument("--after-s", type=float, default=15.0,
                        help="dump once a step has waited this long for its worker")
    parser.add_argument("--every-s", type=float, default=2.0, help="poll interval")
    parser.add_argument("--quiet-s", type=float, default=120.0,
                        help="at most one dump of an instance's stall per this many seconds")
    args = parser.parse_args(argv)
    if not (shutil.which("py-spy") or Path(sys.executable).with_name("py-spy").is_file()):
        parser.error("py-spy is not installed (the dev extra has it)")
    args.out.mkdir(parents=True, exist_ok=True)
    last: dict[str, float] = {}
    before: list[Instance] | None = None
    with httpx.Client() as client:
        try:
            while True:
                found = instances()
                if (said := watching(before, found)) is not None:
                    print(f"{time.strftime('%H:%M:%S')} {said}", flush=True)
                before = found
                for inst in found:
                    running = step_running_s(client, inst)
                    if running is None or running < args.after_s:
                        continue
                    if time.monotonic() - last.get(inst.name, -args.quiet_s) < args.quiet_s:
                        continue
                    last[inst.name] = time.monotonic()
                    print(f"{time.strftime('%H:%M:%S')} {inst.name}: step waiting {running:.0f} s",
                          flush=True)
                    files = dump(found, inst, args.out)
                    print(f"{time.strftime('%H:%M:%S')} {len(files)} dumps in {args.out}; "
                          f"{inst.name} step_running_s now {step_running_s(client, inst)}",
                          flush=True)
                time.sleep(args.every_s)
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    sys.exit(main())
