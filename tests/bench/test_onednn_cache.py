"""benchmarks/onednn_cache.py: it replays vLLM's oneDNN matmuls per capacity, in fresh processes."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import onednn_cache


def test_step_sizes_are_a_decode_instance_s_mix_within_one_step() -> None:
    sizes = onednn_cache.step_sizes(600)
    assert sizes == onednn_cache.step_sizes(600)  # the same replay for every capacity
    assert min(sizes) >= 1 and max(sizes) <= onednn_cache.MAX_TOKENS
    assert 0.5 < sum(s <= 16 for s in sizes) / len(sizes) < 0.8  # mostly decode-only steps


def test_each_capacity_runs_in_its_own_process_and_is_reported(tmp_path: Path) -> None:
    out = tmp_path / "cache.json"
    assert onednn_cache.main(["--capacities", "default", "0", "--steps", "6", "--layers", "1",
                              "--every", "3", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"default", "0"}
    for result in results.values():
        assert [n for n, _ in result["growth_mib"]] == [3, 6]
        assert result["wall_s"] > 0
