"""Measurements the benchmarks share: percentiles, vLLM's Prometheus histograms, process CPU,
NIXL transfers, a model's KV bytes per token."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psutil

if TYPE_CHECKING:
    from prometheus_client import Metric

__all__ = ["CPUMeter", "DescendantCPU", "NIXL_BYTES_METRIC", "NIXL_READ_METRIC", "NixlTotals",
           "histogram_quantile", "kv_bytes_per_token", "metric_families", "nixl_totals",
           "percentile", "scrape_gauge", "scrape_histogram"]

NIXL_READ_METRIC = "vllm:nixl_xfer_time_seconds"
NIXL_BYTES_METRIC = "vllm:nixl_bytes_transferred"


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), ``q`` in 0..100."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile``: ``buckets`` are (upper bound, cumulative count)."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return prev_bound
            width = count - prev_count
            frac = 0.0 if width <= 0 else (rank - prev_count) / width
            return prev_bound + (bound - prev_bound) * frac
        prev_bound, prev_count = bound, count
    return prev_bound


def metric_families(text: str, *names: str) -> Iterator[Metric]:
    """The families ``names`` of a Prometheus text page, parsed alone.

    Parsing a whole vLLM ``/metrics`` page takes tens of milliseconds of Python; a benchmark
    client that samples it every 0.5 s in the event loop that also reads the streams it times
    delays first tokens by as much (measured: up to 86 ms on a 2-core host). Only the lines of
    the named families are parsed here.
    """
    from prometheus_client.parser import text_string_to_metric_families

    heads = tuple(f"# {kind} {name}" for kind in ("HELP", "TYPE") for name in names)
    lines = [line for line in text.splitlines() if line.startswith(names + heads)]
    wanted = set(names)
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        if family.name in wanted:
            yield family


def scrape_histogram(
    client: httpx.Client, url: str, metric: str = NIXL_READ_METRIC
) -> dict[float, float]:
    """Cumulative bucket counts of a histogram on one vLLM ``/metrics``, summed over labels."""
    out: dict[float, float] = {}
    for family in metric_families(client.get(f"{url}/metrics").text, metric):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                out[bound] = out.get(bound, 0.0) + sample.value
    return out


def scrape_gauge(client: httpx.Client, url: str, metric: str) -> float | None:
    for family in metric_families(client.get(f"{url}/metrics").text, metric):
        if family.samples:
            return sum(s.value for s in family.samples)
    return None


class CPUMeter:
    """CPU seconds of a set of processes and all their children (threads included)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.procs: dict[str, list[psutil.Process]] = {}
        for name, pid in pids.items():
            try:
                root = psutil.Process(pid)
                self.procs[name] = [root, *root.children(recursive=True)]
            except psutil.Error:
                self.procs[name] = []

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, procs in self.procs.items():
            total = 0.0
            for proc in procs:
                try:
                    t = proc.cpu_times()
                    total += t.user + t.system
                except psutil.Error:
                    pass
            out[name] = total
        return out


class DescendantCPU:
    """CPU seconds (user + system, threads included) of every descendant of ``root`` (default:
    this process) since the first :meth:`poll`: the servers a benchmark started, not its own
    client.

    Each poll walks the process tree again: a process that appeared since the first poll counts
    from zero, one present at the first poll from what it had used by then. A process that has
    exited keeps the CPU of the last poll that saw it (what it used after that is not counted,
    so poll often: the replay polls with every KV sample). A process whose parent exited is
    re-parented out of the tree and no longer seen.
    """

    def __init__(self, root: psutil.Process | None = None) -> None:
        self.root = root or psutil.Process()
        self._first: dict[psutil.Process, float] = {}  # CPU at the first sight, or 0
        self._last: dict[psutil.Process, float] = {}
        self._polled = False
        self._lock = threading.Lock()  # polled from worker threads

    def poll(self) -> float:
        """Walk the tree; CPU seconds used since the first poll."""
        with self._lock:
            return self._poll()

    def _poll(self) -> float:
        try:
            procs = self.root.children(recursive=True)
        except psutil.Error:
            procs = []
        for proc in procs:  # psutil.Process compares by pid and creation time: no pid reuse
            try:
                t = proc.cpu_times()
            except psutil.Error:
                continue
            cpu_s = t.user + t.system
            if proc not in self._first:
                self._first[proc] = cpu_s if not self._polled else 0.0
            self._last[proc] = cpu_s
        self._polled = True
        return self.total_s

    @property
    def total_s(self) -> float:
        return sum((max(0.0, last - self._first[proc]) for proc, last in self._last.items()),
                   0.0)


@dataclass
class NixlTotals:
    """NIXL reads done by a set of vLLM instances (the reader records them: a decode
    instance's reads are P->D, a prefill instance's D->P), from their ``/metrics``."""

    bytes: float = 0.0
    transfers: float = 0.0
    time_buckets: dict[float, float] = field(default_factory=dict)  # le -> cumulative count

    def add(self, text: str) -> None:
        """Add one ``/metrics`` page's figures (summed over engines)."""
        for family in metric_families(text, NIXL_BYTES_METRIC, NIXL_READ_METRIC):
            for sample in family.samples:
                if family.name == NIXL_BYTES_METRIC and sample.name.endswith("_sum"):
                    self.bytes += sample.value
                elif family.name == NIXL_BYTES_METRIC and sample.name.endswith("_count"):
                    self.transfers += sample.value
                elif family.name == NIXL_READ_METRIC and sample.name.endswith("_bucket"):
                    bound = float(sample.labels["le"])
                    self.time_buckets[bound] = self.time_buckets.get(bound, 0.0) + sample.value

    def since(self, before: NixlTotals) -> NixlTotals:
        """What was read after ``before`` was scraped."""
        return NixlTotals(
            bytes=self.bytes - before.bytes, transfers=self.transfers - before.transfers,
            time_buckets={b: c - before.time_buckets.get(b, 0.0)
                          for b, c in self.time_buckets.items()})

    def summary(self) -> dict[str, Any]:
        """``bytes``, ``transfers`` and the transfer time's p50 / p99 (seconds, from the
        histogram's buckets: an interpolation, as Prometheus' ``histogram_quantile``)."""
        buckets = list(self.time_buckets.items())
        p50, p99 = histogram_quantile(0.5, buckets), histogram_quantile(0.99, buckets)
        return {"bytes": int(self.bytes), "transfers": int(self.transfers),
                "xfer_p50_s": None if p50 is None else round(p50, 4),
                "xfer_p99_s": None if p99 is None else round(p99, 4)}


async def nixl_totals(client: httpx.AsyncClient, urls: list[str]) -> NixlTotals:
    """:class:`NixlTotals` of ``urls`` now; an instance that does not answer adds nothing."""
    out = NixlTotals()
    for url in urls:
        try:
            out.add((await client.get(f"{url}/metrics")).text)
        except httpx.HTTPError:
            continue
    return out


_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
                "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


def kv_bytes_per_token(config: dict[str, Any] | Path, dtype: str | None = None) -> int | None:
    """KV cache bytes of one token: layers x 2 (K and V) x KV heads x head size x dtype bytes,
    from a Hugging Face ``config.json`` (a dict, or the model directory / file); ``dtype``
    overrides the config's ``torch_dtype`` (vLLM's ``--dtype`` or ``--kv-cache-dtype``, unless
    ``auto``). None when the config lacks a figure (other attention layouts: MLA, sliding
    windows of other sizes are not modelled)."""
    if isinstance(config, Path):
        path = config / "config.json" if config.is_dir() else config
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
    assert isinstance(config, dict)
    text = config.get("text_config")
    if isinstance(text, dict):  # multimodal configs keep the language model's figures here
        config = {**config, **text}
    layers, heads = config.get("num_hidden_layers"), config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (
        config["hidden_size"] // heads if heads and config.get("hidden_size") else None)
    if dtype in (None, "auto"):
        dtype = config.get("torch_dtype") or config.get("dtype") or "float16"
    size = _DTYPE_BYTES.get(str(dtype).removeprefix("torch."))
    if not (layers and kv_heads and head_dim and size):
        return None
    return int(layers) * 2 * int(kv_heads) * int(head_dim) * size
