"""Measurements the benchmarks share: percentiles, vLLM's Prometheus histograms, process CPU."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import psutil

if TYPE_CHECKING:
    from prometheus_client import Metric

__all__ = ["CPUMeter", "NIXL_READ_METRIC", "histogram_quantile", "metric_families", "percentile",
           "scrape_gauge", "scrape_histogram"]

NIXL_READ_METRIC = "vllm:nixl_xfer_time_seconds"


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
