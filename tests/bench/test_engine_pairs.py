"""benchmarks/engine_pairs.py: the medians table (no vLLM)."""

from __future__ import annotations

from typing import Any

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


def test_each_addition_is_computed_first_second_and_third_by_every_way() -> None:
    # Three additions a round once gave the same order to every round's same addition.
    for additions in (1, 2, 3, 4):
        for i in range(additions):
            orders = [engine_pairs.order(rnd, i) for rnd in range(3)]
            assert all(sorted(o) == sorted(engine_pairs.WAYS) for o in orders)
            for position in range(len(engine_pairs.WAYS)):
                assert {o[position] for o in orders} == set(engine_pairs.WAYS)


def test_the_engine_clock_sums_each_series_over_its_labels() -> None:
    import httpx

    text = "\n".join([
        "# HELP vllm:request_queue_time_seconds queue",
        "# TYPE vllm:request_queue_time_seconds histogram",
        'vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 1.5',
        'vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 3.0',
        "# TYPE vllm:request_prefill_time_seconds histogram",
        'vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 2.25',
        "# TYPE vllm:time_to_first_token_seconds histogram",
        'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 2.5',
        "# TYPE vllm:iteration_tokens_total histogram",
        'vllm:iteration_tokens_total_count{engine="0",model_name="m"} 40.0',
        'vllm:iteration_tokens_total_count{engine="1",model_name="m"} 2.0',
        'vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 900.0',
    ])
    transport = httpx.MockTransport(
        lambda request: httpx.Response(200, text=text) if request.url.path == "/metrics"
        else httpx.Response(404))
    with httpx.Client(transport=transport) as client:
        got = engine_pairs.engine_clock(client, "http://decode:8100")
    assert got == {"vllm_ttft": 2.5, "queue": 1.5, "prefill": 2.25, "steps": 42.0}


def test_the_engine_table_has_each_way_s_medians_per_size() -> None:
    def engine(ttft: float, prefill: float) -> dict[str, float]:
        return {"ttft": ttft, "vllm_ttft": ttft - 0.01, "outside": 0.01, "queue": 0.0,
                "prefill": prefill, "steps": 24.0}

    rows = [{"new_words": 80, "engine": {w: engine(0.3 + d, 0.25 + d) for w, d in
                                         (("colocated", 0.0), ("decode", 0.01),
                                          ("kvtether", 0.02))}},
            {"new_words": 80, "engine": {"colocated": engine(0.5, 0.45)}}]
    lines = engine_pairs.engine_table(rows)
    assert lines[0].split()[:4] == ["new", "words", "way", "ttft"]
    assert lines[1].split() == ["80", "colocated", "0.400", "0.390", "0.010", "0.000", "0.350",
                                "24.000"]
    assert lines[3].split()[:3] == ["80", "kvtether", "0.320"]


def test_the_after_table_splits_by_whether_colocated_ran_just_before() -> None:
    def row(n: int, decode: float, kvtether: float, before: dict[str, str]) -> dict[str, Any]:
        return {"new_words": n, "colocated": 1.0, "decode": decode, "kvtether": kvtether,
                "engine": {w: {"after": before[w]} for w in ("decode", "kvtether")}}

    rows = [row(360, 1.04, 1.00, {"decode": "colocated", "kvtether": "decode"}),
            row(360, 1.00, 1.03, {"decode": "kvtether", "kvtether": "colocated"}),
            row(360, 1.02, 1.01, {"decode": "colocated", "kvtether": "decode"})]
    lines = engine_pairs.after_table(rows)
    assert lines[1].split() == ["360", "decode", "+0.030", "(2)", "+0.000", "(1)"]
    assert lines[2].split() == ["360", "kvtether", "+0.030", "(1)", "+0.005", "(2)"]
