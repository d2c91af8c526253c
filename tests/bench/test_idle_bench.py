"""`kvtether bench idle`: the arithmetic behind its table, and one short real run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvtether.bench._measure import histogram_quantile, metric_families, percentile
from kvtether.bench.idle import Turn, VariantResult, main


def test_histogram_quantile_matches_prometheus() -> None:
    # 10 reads: 6 under 5 ms, 3 more under 10 ms, 1 more under 100 ms.
    buckets = [(0.001, 0), (0.005, 6), (0.01, 9), (0.1, 10), (math.inf, 10)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.001 + 0.004 * 5 / 6)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.01 + 0.09 * 0.9)
    assert histogram_quantile(0.5, [(0.005, 0), (math.inf, 0)]) is None
    assert histogram_quantile(0.5, []) is None


def test_only_the_named_metric_families_are_parsed() -> None:
    from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    Gauge("vllm:kv_cache_usage_perc", "used", ["engine"], registry=registry).labels("0").set(0.25)
    Gauge("vllm:kv_cache_usage_perc_peak", "a longer name", registry=registry).set(0.9)
    Histogram("vllm:ttft_seconds", "ttft", registry=registry).observe(0.1)
    text = generate_latest(registry).decode()
    [usage] = metric_families(text, "vllm:kv_cache_usage_perc")
    assert [(s.labels, s.value) for s in usage.samples] == [({"engine": "0"}, 0.25)]
    [ttft] = metric_families(text, "vllm:ttft_seconds")
    assert ttft.type == "histogram" and any(s.name.endswith("_bucket") for s in ttft.samples)
    assert list(metric_families(text, "vllm:absent")) == []


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0], 100) == 2.0
    assert math.isnan(percentile([], 50))


def _turn(i: int, outcome: str, seconds: float, ttft: float | None) -> Turn:
    return Turn(index=i, seconds=seconds, ttft_s=ttft, outcome=outcome, prompt_tokens=10 * i,
                reused_tokens=0, gap_s=0.0, text="x")


def test_eligible_turns_exclude_prefix_breaks_and_fired_is_compared_on_ttft() -> None:
    v = VariantResult("kvtether", turns=[
        _turn(1, "miss:first_turn", 1.0, 0.30),
        _turn(2, "miss:prefix_break", 1.0, 0.40),
        _turn(3, "fired", 2.0, 0.10),
        _turn(4, "fired", 0.5, 0.35),  # faster turn, slower first token
        _turn(5, "miss:lease_expired", 1.0, 0.50),
        _turn(6, "miss:below_threshold", 1.0, 0.50),
    ])
    assert (v.fired, v.eligible, v.prefix_breaks) == (2, 3, 1)
    assert v.fired_faster_than_first() == 1
    s = v.summary()
    assert s["first_turn_ttft_s"] == 0.3 and s["turn_p50_s"] == 1.0


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--turns", "1"])
    assert exc.value.code == 2
    assert "--turns must be at least 2" in capsys.readouterr().err


@pytest.mark.vllm
def test_a_short_real_run_measures_kvtether(tmp_path: Path) -> None:
    out = tmp_path / "idle.json"
    code = main(["--variants", "kvtether", "--turns", "4", "--max-gap-s", "0.5",
                 "--idle-s", "3", "--port", "8700", "--state-dir", str(tmp_path / "state"),
                 "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    s = data["summary"]["kvtether"]
    assert s["retained_during_idle"] is True  # the idle window really held KV
    assert s["eligible"] >= 1 and s["fired"] >= 1
    assert s["nixl_reads"] >= 4  # P->D every turn, D->P on reuse
    assert s["ttft_p50_s"] is not None
    assert not list((tmp_path / "state").glob("*/stack.json"))  # stack stopped, state removed
