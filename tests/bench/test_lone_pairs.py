"""benchmarks/lone_pairs.py: how it pairs the two deployments' turns (no vLLM)."""

from __future__ import annotations

from benchmarks import lone_pairs
from kvtether.bench.metrics import TurnResult


def _turn(session: str, turn: int, ttft: float | None, *, fired: bool = True,
          stream: bool = True, new: int = 100) -> TurnResult:
    return TurnResult(session=session, turn=turn, stream=stream, started_s=0.0, ttft_s=ttft,
                      fired=fired,
                      prompt_tokens=1000 + new, reused_tokens=1000)


def test_fired_streamed_turns_are_paired_with_colocated_s_same_turn() -> None:
    colocated = [_turn("s1", 2, 0.50), _turn("s1", 3, 1.00), _turn("s2", 2, 0.40),
                 _turn("s2", 3, None)]
    kvtether = [
        _turn("s1", 2, 0.54, new=120),  # +40 ms: within
        _turn("s1", 3, 1.20, new=500),  # +200 ms: over
        _turn("s2", 2, 0.30, new=80),  # faster
        _turn("s2", 3, 0.30),  # colocated has no TTFT for it
        _turn("s1", 4, 0.30),  # colocated never ran it
        _turn("s3", 2, 0.30, fired=False),
        _turn("s3", 3, 0.30, stream=False),
    ]
    rows = lone_pairs.pair(colocated, kvtether, 0.05)
    assert [(r["session"], r["turn"], r["new_tokens"], r["within"]) for r in rows] == [
        ("s2", 2, 80, True), ("s1", 2, 120, True), ("s1", 3, 500, False)]
    assert rows[2]["diff_s"] == 0.2
    assert lone_pairs.summary(rows, 0.05) == (
        "2 of 3 fired streamed turns within +50 ms of colocated; difference median +0.040 s, "
        "largest +0.200 s")
    assert lone_pairs.summary([], 0.05) == "no fired streamed turn to compare"
