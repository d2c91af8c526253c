"""benchmarks/engine_pairs.py: the medians table (no vLLM)."""

from __future__ import annotations

from benchmarks import engine_pairs


def _row(n: int, colocated: float, decode: float, kvtether: float) -> dict[str, float]:
    got = {"colocated": colocated, "decode": decode, "kvtether": kvtether}
    return {"new_words": n, **got,
            **{f"{a}_minus_{b}": round(got[a] - got[b], 4) for a, b in engine_pairs.DIFFS}}


def test_the_table_has_each_size_s_medians_then_all() -> None:
    rows = [_row(50, 0.50, 0.52, 0.53), _row(50, 0.60, 0.58, 0.62), _row(50, 0.70, 0.70, 0.75),
            _row(200, 1.00, 0.98, 1.02)]
    lines = engine_pairs.table(rows)
    assert lines[0].split()[:4] == ["new", "words", "colocated", "decode"]
    assert lines[1].split() == ["50", "0.600", "0.580", "0.620", "+0.000", "+0.040", "+0.030"]
    assert lines[2].split() == ["200", "1.000", "0.980", "1.020", "-0.020", "+0.040", "+0.020"]
    # The medians of each column over every row, not of the sizes' medians.
    assert lines[3].split() == ["all", "0.650", "0.640", "0.685", "-0.010", "+0.040", "+0.025"]
