"""What oneDNN's primitive cache costs a CPU vLLM worker: RSS and step time, per capacity.

vLLM's CPU linear layers run oneDNN matmuls (``ops.create_onednn_mm`` / ``ops.onednn_mm``). A
matmul primitive is built for each weight shape and batch size (the step's token count), and
two caches keep them: vLLM's own, 32 batch sizes per weight shape, and oneDNN's process-wide
primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, 1,024 by default). Each run below replays
the linear layers of SmolLM2-135M (the CPU profiles' model, fp32, one core) over a decode
instance's mix of step sizes in a fresh process, with the capacity given, and reports how the
process's memory grew and how long a step of a few decode tokens took.

    python -m benchmarks.onednn_cache [--capacities default 0] [--steps 1500] [--layers 30]

The CPU stack profiles set ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0`` from what this measured
(docs/cpu-hosts.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

# SmolLM2-135M: qkv, o, gate_up and down projections (N, K).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
MAX_TOKENS = 256  # the CPU profiles' max_num_batched_tokens


def step_sizes(steps: int, seed: int = 0) -> list[int]:
    """A decode instance's steps: 1-16 running requests, and in one step of three a prompt chunk."""
    rng = random.Random(seed)
    sizes = []
    for _ in range(steps):
        chunk = rng.randint(1, 240) if rng.random() < 1 / 3 else 0
        sizes.append(min(MAX_TOKENS, rng.randint(1, 16) + chunk))
    return sizes


def replay(steps: int, layers: int, every: int) -> dict[str, object]:
    """In this process: build the layers, replay the steps, return RSS growth and step times."""
    import psutil
    import torch
    from vllm import _custom_ops as ops

    torch.set_num_threads(1)
    proc = psutil.Process()

    def uss_mib() -> float:
        return proc.memory_full_info().uss / 2**20

    weights = {shape: torch.randn(*shape) for shape in SHAPES}
    handlers = [(ops.create_onednn_mm(weights[s].t(), 32), s[1])
                for _ in range(layers) for s in SHAPES]
    inputs = {k: torch.randn(MAX_TOKENS, k) for k in {s[1] for s in SHAPES}}

    def step(m: int) -> float:
        start = time.perf_counter()
        for handler, k in handlers:
            ops.onednn_mm(handler, inputs[k][:m], None)
        return time.perf_counter() - start

    step(1)
    base = uss_mib()
    growth: list[tuple[int, float]] = []
    small: list[float] = []
    started = time.perf_counter()
    for i, m in enumerate(step_sizes(steps), 1):
        took = step(m)
        if m <= 16 and i > steps // 3:
            small.append(took)
        if i % every == 0 or i == steps:
            growth.append((i, round(uss_mib() - base, 1)))
    return {"growth_mib": growth, "wall_s": round(time.perf_counter() - started, 2),
            "decode_step_median_ms": round(1000 * statistics.median(small), 3) if small else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacities", nargs="+", default=["default", "0"],
                        help="ONEDNN_PRIMITIVE_CACHE_CAPACITY values ('default': unset)")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--every", type=int, default=300, help="report RSS every this many steps")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(replay(args.steps, args.layers, args.every)))
        return 0
    results = {}
    for capacity in args.capacities:
        env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
        if capacity != "default":
            env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = capacity
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.onednn_cache", "--child", "--steps", str(args.steps),
             "--layers", str(args.layers), "--every", str(args.every)],
            env=env, check=True, capture_output=True, text=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        results[capacity] = result
        growth = ", ".join(f"{n}: +{mib:.0f}" for n, mib in result["growth_mib"])
        print(f"capacity {capacity:>7}: RSS MiB after steps {growth}; "
              f"decode step median {result['decode_step_median_ms']} ms; wall {result['wall_s']} s",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "layers": args.layers, "shapes": SHAPES,
                       "ld_preload": os.environ.get("LD_PRELOAD", ""), "results": results},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
