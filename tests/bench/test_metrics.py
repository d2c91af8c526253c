"""The bench's figures beside TTFT: TPOT and inter-token gaps, prompt tokens computed, KV moved
and its read times, core-seconds per turn; and how the report shows them (no vLLM)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from kvtether.bench import compare, report
from kvtether.bench._measure import DescendantCPU, NixlTotals, kv_bytes_per_token, nixl_totals
from kvtether.bench.metrics import TurnResult, summarize
from kvtether.bench.replay import token_times
from kvtether.bench.strategies import Endpoints, Strategy, StrategyOptions
from tests.support.fake_vllm import Cluster, FakeVLLM
from tests.support.replays import COMPRESS, endpoints, serving


# --- per turn ----------------------------------------------------------------------------------
def test_tpot_spans_first_to_last_token_and_gaps_are_per_chunk() -> None:
    # Four tokens in three chunks: the last chunk carried two after a 0.2 s stall.
    tpot, gaps = token_times([(10.0, 1), (10.1, 1), (10.3, 2)])
    assert tpot == pytest.approx(0.3 / 3)
    assert gaps == pytest.approx([0.1, 0.2])  # one gap per chunk, the stall not divided
    assert token_times([(5.0, 1)]) == (None, [])  # one token: no TPOT
    assert token_times([(5.0, 3)])[0] == 0.0  # three tokens at once


def _turn(turn: int, **kw: Any) -> TurnResult:
    return TurnResult(session="s", turn=turn, stream=True, started_s=0.0, **kw)


def test_summary_has_tpot_gaps_computed_tokens_kv_moved_and_core_seconds() -> None:
    turns = [
        # Turn 1: its TPOT and gaps are not in the turn 2+ figures; decode read its KV.
        _turn(1, prompt_tokens=100, tpot_s=0.5, itl_s=[0.5, 0.5],
              timings={"decode_read": 0.2}),
        # Reused 96 tokens that prefill read from decode.
        _turn(2, prompt_tokens=150, reused_tokens=96, tpot_s=0.02, itl_s=[0.01, 0.03],
              timings={"prefill_read": 0.04, "decode_read": 0.1}),
        # Reused 64 on decode itself (no prefill leg): nothing read D->P.
        _turn(3, prompt_tokens=200, reused_tokens=64, tpot_s=0.04, itl_s=[0.02],
              timings={"decode_read": 0.3}),
        _turn(4, error="APIError: boom"),
    ]
    nixl = {"decode": {"bytes": 3000, "transfers": 3, "xfer_p50_s": 0.07, "xfer_p99_s": 0.1}}
    m = summarize("kvtether", turns, [], wall_s=10.0, drain_s=1.0, compress=16.0, not_run=0,
                  core_s=6.0, drain_core_s=0.5, nixl=nixl, kv_bytes_per_token=10)
    assert (m.tpot_turns, m.tpot_p50_s, m.itl_p50_s) == (2, 0.03, 0.02)
    assert m.tpot_p99_s == pytest.approx(0.0398) and m.itl_p99_s == pytest.approx(0.0298)
    assert m.recomputed_tokens == 100 + 54 + 136
    assert m.recomputed_per_turn_tokens == (54 + 136) / 2
    # Per completed turn (3): core-seconds, bytes moved each way.
    assert (m.core_s, m.core_s_per_turn, m.drain_core_s) == (6.0, 2.0, 0.5)
    assert (m.kv_p2d_bytes, m.kv_p2d_bytes_per_turn, m.kv_xfer_p50_s) == (3000, 1000.0, 0.07)
    assert (m.kv_d2p_bytes, m.kv_d2p_bytes_per_turn, m.kv_d2p_source) == (960, 320.0, "tokens")
    assert (m.kv_p2d_read_p50_s, m.kv_d2p_read_p50_s) == (0.2, 0.04)
    # The prefill instances' own figures win over the token estimate.
    nixl["prefill"] = {"bytes": 4096, "transfers": 1, "xfer_p50_s": 0.03, "xfer_p99_s": 0.03}
    m = summarize("kvtether", turns, [], wall_s=10.0, drain_s=1.0, compress=16.0, not_run=0,
                  nixl=nixl, kv_bytes_per_token=10)
    assert (m.kv_d2p_bytes, m.kv_d2p_source, m.core_s_per_turn) == (4096, "nixl", None)
    # Without a router or NIXL (colocated) nothing moved between instances.
    colocated = summarize("colocated", [_turn(2, prompt_tokens=10)], [], wall_s=1.0,
                          drain_s=0.0, compress=1.0, not_run=0, kv_bytes_per_token=10)
    assert (colocated.kv_p2d_bytes, colocated.kv_d2p_bytes, colocated.kv_d2p_source) == (
        None, None, None)
    # The results file keeps each turn's longest gap, not every gap.
    record = turns[1].as_dict()
    assert "itl_s" not in record and record["itl_max_s"] == 0.03 and record["tpot_s"] == 0.02


# --- measurements ------------------------------------------------------------------------------
def test_core_seconds_count_children_that_come_and_go() -> None:
    burn = [sys.executable, "-c", "import time\nt = time.process_time()\n"
            "while time.process_time() - t < 0.3: pass"]
    cpu = DescendantCPU()
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    idle_root = psutil.Process(idle.pid)
    try:
        time.sleep(0.2)
        assert cpu.poll() == 0.0  # what ran before the first poll is not counted
        busy = subprocess.Popen(burn)
        # Poll while it runs, as the replay does; after it exited its last poll stays.
        while busy.poll() is None:
            cpu.poll()
            time.sleep(0.02)
        seen = cpu.poll()
        assert 0.1 < seen < 2.0
        assert cpu.poll() == seen
    finally:
        idle.kill()
        idle.wait()
    assert DescendantCPU(idle_root).poll() == 0.0  # a root that has exited: nothing


METRICS = """\
# HELP vllm:nixl_bytes_transferred Histogram of bytes transferred per NIXL KV Cache transfers.
# TYPE vllm:nixl_bytes_transferred histogram
vllm:nixl_bytes_transferred_bucket{engine="0",le="2048.0"} 0.0
vllm:nixl_bytes_transferred_bucket{engine="0",le="+Inf"} {n}
vllm:nixl_bytes_transferred_count{engine="0"} {n}
vllm:nixl_bytes_transferred_sum{engine="0"} {bytes}
# HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration for NIXL KV Cache transfers.
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.1"} {fast}
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="1.0"} {n}
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="+Inf"} {n}
vllm:nixl_xfer_time_seconds_count{engine="0"} {n}
vllm:nixl_xfer_time_seconds_sum{engine="0"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0"} 0.5
"""


def _page(n: int, nbytes: int, fast: int) -> str:
    return (METRICS.replace("{n}", str(n)).replace("{bytes}", str(nbytes))
            .replace("{fast}", str(fast)))


async def test_nixl_reads_are_counted_between_two_scrapes() -> None:
    pages = {"http://d0": _page(2, 1000, 2), "http://d1": _page(1, 500, 1)}

    def answer(request: httpx.Request) -> httpx.Response:
        url = f"http://{request.url.host}"
        if url not in pages:
            return httpx.Response(404, text="not found")
        return httpx.Response(200, text=pages[url])

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        before = await nixl_totals(client, ["http://d0", "http://d1", "http://gone"])
        pages["http://d0"] = _page(6, 9000, 4)  # 4 more reads, 8000 bytes, 2 of them slow
        after = await nixl_totals(client, ["http://d0", "http://d1", "http://gone"])
    assert (before.bytes, before.transfers) == (1500, 3)
    moved = after.since(before).summary()
    assert (moved["bytes"], moved["transfers"]) == (8000, 4)
    assert moved["xfer_p50_s"] == pytest.approx(0.1)  # two of four under 0.1 s
    assert 0.1 < moved["xfer_p99_s"] <= 1.0
    assert NixlTotals().summary() == {"bytes": 0, "transfers": 0, "xfer_p50_s": None,
                                      "xfer_p99_s": None}


def test_kv_bytes_per_token_from_a_model_config(tmp_path: Path) -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads of 576 / 9 = 64, served in float32 on CPU.
    smol = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
            "hidden_size": 576, "torch_dtype": "float32"}
    assert kv_bytes_per_token(smol) == 30 * 2 * 3 * 64 * 4
    assert kv_bytes_per_token(smol, "bfloat16") == 30 * 2 * 3 * 64 * 2
    (tmp_path / "config.json").write_text(json.dumps({**smol, "head_dim": 128}))
    assert kv_bytes_per_token(tmp_path) == 30 * 2 * 3 * 128 * 4
    assert kv_bytes_per_token(tmp_path / "missing") is None
    assert kv_bytes_per_token({"num_hidden_layers": 2}) is None


# --- the bench, end to end ---------------------------------------------------------------------
def test_the_bench_reports_tpot_beside_ttft(tmp_path: Path) -> None:
    class Slow(FakeVLLM):
        """Streams each token a few milliseconds after the one before."""

        async def completions(self, request: Any) -> Any:
            response = await super().completions(request)
            if hasattr(response, "body_iterator"):
                inner = response.body_iterator

                async def paced() -> Any:
                    import asyncio

                    async for part in inner:
                        await asyncio.sleep(0.003)
                        yield part

                response.body_iterator = paced()
            return response

    with serving(lambda port: Slow(Cluster(), "fake", "127.0.0.1", port)) as fake:

        @contextlib.contextmanager
        def start(strategy: Strategy, opts: StrategyOptions) -> Iterator[Endpoints]:
            yield endpoints(fake)

        out = tmp_path / "out"
        assert compare.main([
            "--strategies", "colocated", "pd-upstream", "--sessions", "2", "--turns", "3", "3",
            "--long-tools", "0", "--compress", str(COMPRESS), "--context-tokens", "700",
            "--system-tokens", "200", "--max-output-tokens", "16", "--stream-fraction", "1",
            "--arrival-s", "1", "--out", str(out), "--state-dir", str(tmp_path / "state"),
        ], start=start) == 0
    data = json.loads((out / "results.json").read_text())
    for name, m in data["summary"].items():
        assert m["tpot_turns"] == 4 and m["tpot_p50_s"] >= 0.002, name
        assert m["itl_p50_s"] is not None and m["itl_p99_s"] >= m["itl_p50_s"], name
        assert m["core_s"] is not None and m["core_s_per_turn"] is not None, name  # no children
        streamed = [t for t in data["strategies"][name]["turns"] if t["turn"] >= 2]
        assert all(t["tpot_s"] and t["itl_max_s"] for t in streamed), name
    md = (out / "results.md").read_text()
    assert "TPOT p50 / p99 (ms)" in md and "core-s / turn" in md
    assert (out / "ttft_tpot.png").read_bytes().startswith(b"\x89PNG")


def test_the_report_shows_kv_moved_and_the_ratios_to_kvtether(tmp_path: Path) -> None:
    base = summarize("x", [], [], wall_s=1, drain_s=0, compress=16, not_run=0).as_dict()
    summary = {
        "colocated": {**base, "ttft_p50_s": 0.5, "ttft_p99_s": 1.0, "tpot_p50_s": 0.05,
                      "tpot_p99_s": 0.08, "core_s_per_turn": 1.5},
        "kvtether": {**base, "ttft_p50_s": 0.4, "ttft_p99_s": 0.9, "tpot_p50_s": 0.06,
                     "tpot_p99_s": 0.1, "core_s_per_turn": 2.25, "itl_p50_s": 0.055,
                     "itl_p99_s": 0.2, "recomputed_tokens": 900,
                     "recomputed_per_turn_tokens": 120.0, "kv_p2d_bytes_per_turn": 3 * 2**20,
                     "kv_d2p_bytes_per_turn": 1536.0, "kv_d2p_source": "tokens",
                     "kv_p2d_read_p50_s": 0.115, "kv_d2p_read_p50_s": 0.02},
    }

    def turn(n: int, ttft: float, tpot: float) -> dict[str, Any]:
        return {"session": "s", "turn": n, "stream": True, "ttft_s": ttft, "tpot_s": tpot,
                "eligible": False, "fired": False, "error": None}

    result: dict[str, Any] = {
        "run": {"command": "kvtether bench", "scenario": {"name": "x"}, "profile": "cpu-tiny",
                "compress": 16.0, "fixed_ttl_s": 480.0, "prefill_prefix_caching": False,
                "host": "h", "date": "d", "scenario_summary": {"sessions": 1},
                "reference": "colocated"},
        "summary": summary,
        "strategies": {"colocated": {"turns": [turn(2, 0.5, 0.05), turn(3, 1.0, 0.05)],
                                     "kv": []},
                       "kvtether": {"turns": [turn(2, 0.4, 0.06), turn(3, 0.9, 0.04)],
                                    "kv": []}},
    }
    md = report.render_markdown(result)
    assert "| kvtether | 0.400 / 0.900 | 60.0 / 100.0 | 0/0 | - / 0 | 0.000 | 2.25 |" in md
    assert "| 55.0 / 200.0 | 900 / 120 | 0 | 3.0 MiB / 1.5 KiB* | 0.115 / 0.020 |" in md
    assert "| colocated | 0.800x | " not in md  # the ratio is kvtether over the other
    assert "| colocated | 0.80x | 0.85x (2) | 1.20x | 1.00x (2) |" in md
    assert report.kvtether_ratios({**result, "summary": {"colocated": summary["colocated"]}}) \
        == []
    paths = report.write_plots(result, tmp_path)
    assert "ttft_tpot.png" in {p.name for p in paths}


def test_no_d2p_estimate_without_the_connectors_timings() -> None:
    # vLLM's own NixlConnector (--baseline-connector nixl) reports no engine timings: which
    # turns prefill read on is unknown, so no bytes are made up.
    turns = [_turn(2, prompt_tokens=150, reused_tokens=96,
                   timings={"plan": 0.01, "decode_first_token": 0.2})]
    m = summarize("pd-upstream", turns, [], wall_s=1.0, drain_s=0.0, compress=1.0, not_run=0,
                  nixl={"decode": {"bytes": 512, "transfers": 1, "xfer_p50_s": 0.01}},
                  kv_bytes_per_token=10)
    assert (m.kv_p2d_bytes, m.kv_d2p_bytes, m.kv_d2p_source) == (512, None, None)
