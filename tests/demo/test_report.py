"""`kvtether demo`'s per-turn table: every outcome readable in an 80-column terminal."""

from __future__ import annotations

from types import SimpleNamespace

from rich.console import Console

from kvtether import protocol as p
from kvtether.demo import AgentRun, print_report


def _turn(n: int, outcome: str, tools: list[str]) -> SimpleNamespace:
    return SimpleNamespace(turn=n, prompt_tokens=100 * n, reused_tokens=90 * n, outcome=outcome,
                           reuse=p.parse_reuse_header(outcome), ttft_s=0.3, tools=tools)


def test_the_table_fits_80_columns_without_cutting_an_outcome() -> None:
    outcomes = ["miss:first_turn", "fired", "miss:decode_unavailable", "miss:prefix_break"]
    session = SimpleNamespace(
        conversation_id="kvt-" + "0" * 32,
        turns=[_turn(i + 1, o, ["read_file"]) for i, o in enumerate(outcomes)],
    )
    console = Console(width=80, record=True, color_system=None)
    print_report(AgentRun(session, ["plan", "model", "plan"], []), console)
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines())
    for outcome in outcomes:
        assert outcome in text
    assert "…" not in text
    assert "read_file" in text and "(plan)" in text  # may wrap, never cut
    assert ("reuse fired on 1/2 eligible turns (4 in all); 900/1000 prompt tokens were not "
            "recomputed.") in " ".join(text.split())
