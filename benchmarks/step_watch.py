"""Catch a vLLM engine step that does not end, while it still does not end.

Polls every kvtether instance on this host (its connector's control channel,
``GET /kvtether/v1/status``: ``step_running_s``, how long the engine's step in flight has
waited for its worker) and, when one passes ``--after-s``, takes py-spy dumps (Python and
native frames) of every vLLM process of every instance, the stalled instance's engine core and
worker first, then reads that instance's status again. The stall report inside the worker
speaks only after 60 s and the router only after ``--stall-after-s``; stalls seen on loaded
2-core hosts lasted 60-110 s, so a dump taken at 60 s often shows a worker that has just
resumed (docs/failures.md).

Before the dumps (py-spy stops each process while it reads it, which lengthens the stall it
records) it reads the scheduler's own account of the stall from /proc for ``--sched-window-s``:
for every thread of every vLLM process, the CPU time it got and the time it waited runnable on a
run queue (``/proc/<pid>/task/<tid>/schedstat``), and the host's CPU split, steal included
(``/proc/stat``). A worker that is runnable but not running is starved; one that sleeps while
nothing else runs is waiting on something.

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
import os
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


@dataclass(frozen=True)
class ThreadSample:
    process: str  # "<instance> <process name>", e.g. "decode-9002 VLLM::Worker"
    pid: int
    tid: int
    comm: str
    state: str  # R running or runnable, S sleeping, D in uninterruptible wait, ...
    run_ns: int  # CPU time so far
    wait_ns: int  # time spent runnable on a run queue, not running; Linux adds a wait when the
    # thread next runs, so one that stays runnable and never runs shows no wait (and no CPU) yet
    allowed: str = ""  # the cores it may run on (Cpus_allowed_list)
    doing: str = ""  # "user", a system call's name (or number), "" when unknown


# x86-64 numbers of the system calls a vLLM thread waits or spins in.
SYSCALLS = {"0": "read", "7": "poll", "23": "select", "24": "sched_yield", "35": "nanosleep",
            "202": "futex", "232": "epoll_wait", "270": "pselect6", "271": "ppoll",
            "281": "epoll_pwait", "230": "clock_nanosleep"}


def _doing(task: Path) -> str:
    try:
        first = (task / "syscall").read_text().split(maxsplit=1)[0]
    except (OSError, IndexError):
        return ""
    return "user" if first == "running" else SYSCALLS.get(first, f"syscall {first}")


def _allowed(task: Path) -> str:
    try:
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _processes(inst: Instance) -> list[tuple[str, int]]:
    try:
        root = psutil.Process(inst.pid)
        return [(f"{inst.name} {p.name()}", p.pid) for p in [root, *root.children(True)]]
    except psutil.Error:
        return []


def sample_threads(processes: list[tuple[str, int]],
                   proc: Path = Path("/proc")) -> dict[int, ThreadSample]:
    """Every thread of ``processes`` ((label, pid) pairs) as the scheduler sees it now, with
    its cores and, when runnable, the system call it is in."""
    out = {}
    for label, pid in processes:
        try:
            tids = [int(t) for t in os.listdir(proc / str(pid) / "task")]
        except OSError:
            continue
        for tid in tids:
            task = proc / str(pid) / "task" / str(tid)
            try:
                stat = (task / "stat").read_text()
                run_ns, wait_ns = (int(v) for v in (task / "schedstat").read_text().split()[:2])
            except (OSError, ValueError):
                continue  # the thread ended
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            state = stat[stat.rindex(")") + 2:].split()[0]
            out[tid] = ThreadSample(label, pid, tid, comm, state, run_ns, wait_ns,
                                    _allowed(task), _doing(task) if state == "R" else "")
    return out


def host_cpu(proc: Path = Path("/proc")) -> dict[str, int]:
    """The host's CPU time by kind (clock ticks), from /proc/stat's first line."""
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    try:
        first = (proc / "stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return {}
    return {n: int(v) for n, v in zip(names, first[1:], strict=False)}


def _seen(tid: int, middle: list[dict[int, ThreadSample]]) -> str:
    """What a thread was doing in the samples taken inside the window: "sched_yield 9/10"."""
    counts: dict[str, int] = {}
    for sample in middle:
        s = sample.get(tid)
        if s is not None and s.state == "R":
            counts[s.doing or "?"] = counts.get(s.doing or "?", 0) + 1
    return ", ".join(f"{k} {v}/{len(middle)}" for k, v in
                     sorted(counts.items(), key=lambda kv: -kv[1])) or "-"


def sched_report(stalled: str, window_s: float, before: dict[int, ThreadSample],
                 after: dict[int, ThreadSample], cpu_before: dict[str, int],
                 cpu_after: dict[str, int], middle: list[dict[int, ThreadSample]] | None = None,
                 ) -> tuple[str, str]:
    """(one summary line, the whole table) for one window between two samples; ``middle``:
    samples taken inside it (what each runnable thread was doing)."""
    middle = middle or []
    rows = []
    for tid, b in after.items():
        a = before.get(tid)
        if a is None:
            continue
        rows.append((b, (b.run_ns - a.run_ns) / 1e6, (b.wait_ns - a.wait_ns) / 1e6))
    rows.sort(key=lambda r: -(r[1] + r[2]))
    ticks = {k: cpu_after.get(k, 0) - cpu_before.get(k, 0) for k in cpu_after}
    total = sum(ticks.values()) or 1
    host = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in ticks.items() if v)
    cpu_ms = sum(r[1] for r in rows)
    wait_ms = sum(r[2] for r in rows)
    runnable = sum(1 for r in rows if r[0].state == "R")

    def main_thread(kind: str) -> tuple[ThreadSample, float, float] | None:
        return next((r for r in rows if r[0].process.startswith(f"{stalled} {kind}")
                     and r[0].tid == r[0].pid), None)

    def said(kind: str) -> str:
        r = main_thread(kind)
        if r is None:
            return f"{kind} not found"
        never = " (runnable and never run in the window)" if r[0].state == "R" and not r[1] else ""
        return f"{kind} {r[0].state}, ran {r[1]:.0f} ms, waited runnable {r[2]:.0f} ms{never}"

    summary = (f"{stalled} over {window_s:.1f} s: {said('VLLM::Worker')}; "
               f"{said('VLLM::EngineCore')}; all vLLM threads ran "
               f"{cpu_ms / 1000 / window_s:.2f} cores and waited runnable "
               f"{wait_ms / 1000 / window_s:.2f}, {runnable} runnable at the end; host: {host}")
    worker = main_thread("VLLM::Worker")
    if worker is not None and worker[0].allowed:
        # who had the stalled worker's core(s): the busiest other thread pinned there
        mates = [r for r in rows if r[0].allowed == worker[0].allowed and r[0] is not worker[0]]
        if mates:
            top = max(mates, key=lambda r: r[1])
            summary += (f"; on core {worker[0].allowed} {top[0].process} ({top[0].tid}) ran "
                        f"{top[1]:.0f} ms, seen {_seen(top[0].tid, middle)}")
    table = [summary, "", f"{'process':40} {'tid':>7} {'thread':16} st {'ran ms':>8} "
             f"{'waited ms':>9} {'cores':>6}  seen running"]
    table += [f"{s.process:40} {s.tid:>7} {s.comm:16} {s.state:2} {ran:8.0f} {waited:9.0f} "
              f"{s.allowed:>6}  {_seen(s.tid, middle)}"
              for s, ran, waited in rows if ran or waited or s.state == "R"]
    return summary, "\n".join(table) + "\n"


def sched_window(all_instances: list[Instance], stalled: Instance, window_s: float,
                 out: Path, samples: int = 10) -> str:
    """Reads the scheduler's account of ``window_s`` seconds of the stall (and, ``samples``
    times inside it, what each runnable thread is doing); writes the table to ``out`` and
    returns its summary line."""
    processes = [p for inst in all_instances for p in _processes(inst)]
    before, cpu_before, t0 = sample_threads(processes), host_cpu(), time.monotonic()
    middle = []
    for _ in range(samples):
        time.sleep(window_s / samples)
        middle.append(sample_threads(processes))
    after, cpu_after = middle[-1] if middle else sample_threads(processes), host_cpu()
    # on a loaded host reading /proc takes a while: the window is what the clock says
    summary, table = sched_report(stalled.name, time.monotonic() - t0, before, after,
                                  cpu_before, cpu_after, middle)
    (out / f"{stalled.name}-sched-{time.strftime('%H%M%S')}.txt").write_text(table)
    return summary


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
    parser.add_argument("--sched-window-s", type=float, default=3.0,
                        help="how long to read the scheduler's account before the dumps")
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
                    said = sched_window(found, inst, args.sched_window_s, args.out)
                    print(f"{time.strftime('%H:%M:%S')} {said}", flush=True)
                    files = dump(found, inst, args.out)
                    print(f"{time.strftime('%H:%M:%S')} {len(files)} dumps in {args.out}; "
                          f"{inst.name} step_running_s now {step_running_s(client, inst)}",
                          flush=True)
                time.sleep(args.every_s)
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    sys.exit(main())
