"""What `kvtether bench` writes: results JSON, markdown tables, four PNG plots; for a
concurrency sweep (``--concurrency``), sweep JSON, a markdown table and one two-panel plot."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtether.bench.metrics import same_turn_ratios

__all__ = ["TARGETS", "fmt", "fmt_ms", "kvtether_ratios", "pyplot", "render_markdown",
           "render_sweep_markdown", "save_plot", "targets", "write_files", "write_plots",
           "write_results", "write_sweep", "write_sweep_plot"]

COLORS = {"colocated": "#555555", "pd-oneway": "#ef6c00", "pd-upstream": "#1565c0",
          "kvtether": "#2e7d32"}


def fmt(v: Any, digits: int = 3) -> str:
    """A figure for a table: floats to ``digits`` places, ``-`` for one not measured."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def fmt_ms(v: float | None) -> str:
    """Seconds as milliseconds (TPOT and inter-token gaps read better so)."""
    return "-" if v is None else f"{1000 * v:.1f}"


def _size(n: float | None) -> str:
    """Bytes in binary units."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"


def _pair(m: dict[str, Any], a: str, b: str, show: Callable[[Any], str] = fmt) -> str:
    """Two fields of a summary row as ``a / b``; ``-`` where neither was measured."""
    va, vb = m.get(a), m.get(b)
    return "-" if va is None and vb is None else f"{show(va)} / {show(vb)}"


def targets(summary: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """kvtether's targets against this run's figures: measured, target, met (None: reported,
    no target)."""
    k = summary.get("kvtether")
    if not k:
        return []
    rows: list[dict[str, Any]] = []

    def add(name: str, measured: Any, target: str, met: bool | None) -> None:
        rows.append({"target": name, "measured": measured, "goal": target, "met": met})

    rate = k["reuse_rate"]
    add("reuse on eligible turns", f"{k['fired_turns']}/{k['eligible_turns']}"
        + ("" if rate is None else f" ({rate:.1%})"), ">= 99%",
        None if rate is None else rate >= 0.99)
    add("divergent outputs", k["divergent_outputs"], "0",
        None if k["divergent_outputs"] is None else k["divergent_outputs"] == 0)
    add("failed turns", k["failed_turns"], "0", k["failed_turns"] == 0)
    up = summary.get("pd-upstream")
    if up and up["retained_kv_token_s"] > 0:
        ratio = k["retained_kv_token_s"] / up["retained_kv_token_s"]
        add("retained KV token-s vs fixed TTL (pd-upstream)", f"{ratio:.2f}x", "<= 0.20x",
            ratio <= 0.2)
    one = summary.get("pd-oneway")
    if one and one["ttft_p50_s"] and k["ttft_p50_s"]:
        ratio = one["ttft_p50_s"] / k["ttft_p50_s"]
        add("turn 2+ TTFT p50, pd-oneway / kvtether", f"{ratio:.2f}x", ">= 1.6x", ratio >= 1.6)
    inst = summary.get("colocated-instance")
    if inst and inst["ttft_p50_s"] and k["ttft_p50_s"]:
        ratio = k["ttft_p50_s"] / inst["ttft_p50_s"]
        add("turn 2+ TTFT p50, kvtether / colocated-instance", f"{ratio:.2f}x", "<= 1.1x",
            ratio <= 1.1)
    if k["ttft_p50_s"] and k["ttft_p99_s"]:
        ratio = k["ttft_p99_s"] / k["ttft_p50_s"]
        add("turn 2+ TTFT p99 / p50 (kvtether)", f"{ratio:.2f}x", "<= 3x", ratio <= 3)
    # Against the deployments on the same hardware: reported whatever they are.
    for name in ("colocated", "colocated-dp"):
        other = summary.get(name)
        if other and other["ttft_p50_s"] and k["ttft_p50_s"]:
            add(f"turn 2+ TTFT p50, kvtether / {name}",
                f"{k['ttft_p50_s'] / other['ttft_p50_s']:.2f}x", "reported", None)
        if other and other["turns_per_s"] and k["turns_per_s"]:
            add(f"turns/s, kvtether / {name}",
                f"{k['turns_per_s'] / other['turns_per_s']:.2f}x", "reported", None)
    return rows


TARGETS = targets  # the name the docs use


def _run_lines(meta: dict[str, Any], title: str) -> list[str]:
    """Title, command, setup and scenario: how a results file's figures were made."""
    return [
        f"# {title} — {meta['scenario']['name']}",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Profile `{meta['profile']}`, time compression **{meta['compress']:g}x** (every "
        f"duration and TTL divided by it: fixed TTL {meta['fixed_ttl_s']:g} s workload = "
        f"{meta['fixed_ttl_s'] / meta['compress']:.1f} s wall), prefill prefix cache "
        f"{'on' if meta['prefill_prefix_caching'] else 'off'}, P/D baselines on the "
        f"{meta.get('baseline_connector', 'kvtether')} connector, {_local_prefill(meta)}, "
        f"{meta['host']}, {meta['date']}.",
        "",
        "Scenario: " + ", ".join(f"{k} {v}" for k, v in meta["scenario_summary"].items()) + ".",
        "",
    ]


def render_markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    meta = result["run"]
    lines = [
        *_run_lines(meta, "kvtether bench"),
        "| strategy | TTFT p50 / p99, turns 2+ (s) | TPOT p50 / p99 (ms) | reuse fired / eligible "
        "| divergent / compared | turns/s | core-s / turn |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, m in s.items():
        rate = "" if m["reuse_rate"] is None else f" ({m['reuse_rate']:.0%})"
        div = "ref" if name == meta.get("reference") else (
            f"{fmt(m['divergent_outputs'])} / {m['compared_outputs']}")
        lines.append(
            f"| {name} | {_pair(m, 'ttft_p50_s', 'ttft_p99_s')} | "
            f"{_pair(m, 'tpot_p50_s', 'tpot_p99_s', fmt_ms)} | "
            f"{m['fired_turns']}/{m['eligible_turns']}{rate} | {div} | "
            f"{fmt(m['turns_per_s'])} | {fmt(m.get('core_s_per_turn'), 2)} |"
        )
    lines += ["", "| strategy | TTFT p90 (s) | latency p50 (s) | inter-token gap p50 / p99 (ms) "
              "| prompt tokens computed: total / per turn 2+ | of which reusable "
              "| KV moved per turn: P->D / D->P | KV read p50 (s): P->D / D->P "
              "| retained KV token-s (workload) | failed | drain core-s |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in s.items():
        d2p = _size(m.get("kv_d2p_bytes_per_turn")) + (
            "*" if m.get("kv_d2p_source") == "tokens" else "")
        moved = ("-" if m.get("kv_p2d_bytes_per_turn") is None and m.get("kv_d2p_source") is None
                 else f"{_size(m.get('kv_p2d_bytes_per_turn'))} / {d2p}")
        lines.append(
            f"| {name} | {fmt(m['ttft_p90_s'])} | {fmt(m['latency_p50_s'])} | "
            f"{_pair(m, 'itl_p50_s', 'itl_p99_s', fmt_ms)} | {m['recomputed_tokens']} / "
            f"{fmt(m.get('recomputed_per_turn_tokens'), 0)} | "
            f"{m['recomputed_reusable_tokens']} | {moved} | "
            f"{_pair(m, 'kv_p2d_read_p50_s', 'kv_d2p_read_p50_s')} | "
            f"{m['retained_kv_token_s_workload']:.0f} | {m['failed_turns']} | "
            f"{fmt(m.get('drain_core_s'), 1)} |"
        )
    lines += _ratio_lines(result)
    lines += stage_table(s)
    rows = targets(s)
    if rows:
        lines += ["", "Targets for kvtether in this run:", "",
                  "| target | measured | goal | met |", "|---|---|---|---|"]
        for r in rows:
            met = "-" if r["met"] is None else ("yes" if r["met"] else "**no**")
            lines.append(f"| {r['target']} | {r['measured']} | {r['goal']} | {met} |")
    lines += _same_turn_lines(result)
    lines += [
        "",
        "TTFT: streamed turns 2+ (time to the first token through the SDK). TPOT: per streamed "
        "turn 2+, from its first token to its last over the tokens after the first; "
        "inter-token gap: between consecutive chunks that carried tokens, every gap of those "
        "turns. Core-s / turn: CPU seconds (user + system) of every process the strategy "
        "started, while the sessions ran, over the turns that completed (drain core-s: after "
        "the last turn, until the held KV was gone). Prompt tokens computed: prompt tokens "
        "not reused. KV moved: P->D, decode's NIXL reads of each turn's KV "
        "(`vllm:nixl_bytes_transferred` on the decode instances); D->P, prefill's reads of "
        "decode's retained KV (* the tokens read x the model's KV bytes per token), over "
        "completed turns; KV read: the connectors' read times, median over the turns that "
        "read. Eligible: turn 2+ "
        "whose prompt repeats at least `kv_recompute_threshold` tokens of what the previous "
        "turn built (prompt + answer, less the answer's last token, which has no KV); fired: it "
        "recomputed less than a block of those. "
        "Retained KV: `vllm:kv_cache_usage_perc` x capacity on the decode instances (the "
        "colocated instance: blocks of running requests only; its prefix cache is evictable), "
        "sampled every 0.5 s until the held KV was gone, x the compression factor.",
        "",
    ]
    return "\n".join(lines)


def kvtether_ratios(result: dict[str, Any]) -> list[dict[str, Any]]:
    """kvtether's turn 2+ TTFT p50 and TPOT p50 over each other strategy's (below 1: kvtether
    is faster), and the same for each turn over that strategy's same turn (session and turn:
    :func:`~kvtether.bench.metrics.same_turn_ratios`, p50). [] without kvtether."""
    s = result["summary"]
    k = s.get("kvtether")
    if not k:
        return []
    runs = result.get("strategies") or {}
    mine = runs.get("kvtether", {}).get("turns", [])

    def over(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    rows = []
    for name, m in s.items():
        if name == "kvtether":
            continue
        theirs = runs.get(name, {}).get("turns", [])
        rows.append({
            "strategy": name,
            "ttft_p50": over(k["ttft_p50_s"], m["ttft_p50_s"]),
            "ttft_same_turn": same_turn_ratios(mine, theirs),
            "tpot_p50": over(k.get("tpot_p50_s"), m.get("tpot_p50_s")),
            "tpot_same_turn": same_turn_ratios(mine, theirs, key="tpot_s"),
        })
    return rows


def _ratio_lines(result: dict[str, Any]) -> list[str]:
    rows = kvtether_ratios(result)
    if not rows:
        return []

    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    def same(r: dict[str, Any]) -> str:
        return "-" if r["p50"] is None else f"{r['p50']:.2f}x ({r['turns']})"

    lines = ["", "kvtether over each other strategy (below 1x: kvtether is faster):", "",
             "| kvtether / | TTFT p50, turns 2+ | same turn's TTFT, p50 (turns) | TPOT p50 "
             "| same turn's TPOT, p50 (turns) |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {x(r['ttft_p50'])} | {same(r['ttft_same_turn'])} | "
                     f"{x(r['tpot_p50'])} | {same(r['tpot_same_turn'])} |")
    return lines


def _spread(m: dict[str, Any]) -> str:
    """A summary row's TTFT p99 over its p50."""
    p50, p99 = m["ttft_p50_s"], m["ttft_p99_s"]
    return f"{p99 / p50:.2f}x" if p50 and p99 is not None else "-"


def _ratios(same: dict[str, Any] | None) -> str:
    """A :func:`~kvtether.bench.metrics.same_turn_ratios` cell: p50 / p99 (turns)."""
    if same is None or same["p50"] is None:
        return "-"
    return f"{same['p50']:.2f}x / {same['p99']:.2f}x ({same['turns']})"


def _same_turn_lines(result: dict[str, Any]) -> list[str]:
    """Each strategy's TTFT p99 over its p50, beside its TTFTs over the reference strategy's
    for the same turns: the spread of turn sizes apart from what a deployment adds."""
    reference = result["run"].get("reference")
    runs = result.get("strategies") or {}
    if reference not in runs or len(runs) < 2:
        return []
    lines = ["", f"| strategy | TTFT p99 / p50 | TTFT / {reference}'s same turn: p50 / p99 "
             "(turns) |", "|---|---|---|"]
    for name, m in result["summary"].items():
        same = None if name == reference else same_turn_ratios(
            runs.get(name, {}).get("turns", []), runs[reference].get("turns", []))
        lines.append(f"| {name} | {_spread(m)} | {_ratios(same)} |")
    lines += ["", f"TTFT p99 / p50 holds the spread of the scenario's turn sizes (with few "
              f"streamed turns the p99 is about the largest addition's TTFT, whatever serves "
              f"it); each turn's TTFT over {reference}'s for the same turn (session and turn) "
              "holds only what the deployment adds."]
    return lines


def write_files(result: dict[str, Any], out: Path, stem: str,
           render: Callable[[dict[str, Any]], str]) -> list[Path]:
    """``<stem>.json`` (everything) and ``<stem>.md`` (``render``'s tables)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    paths[1].write_text(render(result))
    return paths


def write_results(result: dict[str, Any], out: Path) -> list[Path]:
    return write_files(result, out, "results", render_markdown)


def save_plot(plt: Any, fig: Any, ax: Any, path: Path) -> Path:
    """Legend on each axes (``ax``: one or a list) where anything is labelled, write the PNG,
    free the figure."""
    for a in ax if isinstance(ax, list) else [ax]:
        if a.get_legend_handles_labels()[0]:
            a.legend()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_plots(result: dict[str, Any], out: Path) -> list[Path]:
    """reuse_by_turn.png, ttft_cdf.png, retained_kv.png, ttft_tpot.png; [] when matplotlib
    is missing."""
    plt = pyplot()
    if plt is None:
        return []
    out.mkdir(parents=True, exist_ok=True)
    compress = result["run"]["compress"]
    strategies = result["strategies"]
    paths: list[Path] = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, data in strategies.items():
        by_turn: dict[int, list[bool]] = {}
        for t in data["turns"]:
            if t["eligible"] and t["error"] is None:
                by_turn.setdefault(t["turn"], []).append(t["fired"])
        xs = sorted(by_turn)
        ax.plot(xs, [100 * sum(by_turn[x]) / len(by_turn[x]) for x in xs], marker="o",
                label=name, color=COLORS.get(name))
    ax.set(xlabel="turn index", ylabel="eligible turns that reused (%)", ylim=(-5, 105),
           title="Reuse per turn index")
    paths.append(save_plot(plt, fig, ax, out / "reuse_by_turn.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, data in strategies.items():
        values = sorted(t["ttft_s"] for t in data["turns"]
                        if t["ttft_s"] is not None and t["turn"] >= 2)
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                    label=name, color=COLORS.get(name))
    ax.set(xscale="log", xlabel="TTFT, turns 2+ (s, log)", ylabel="fraction of turns",
           title="TTFT CDF (streamed turns)")
    paths.append(save_plot(plt, fig, ax, out / "ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, data in strategies.items():
        kv = data["kv"]
        ax.plot([s[0] * compress / 60 for s in kv], [s[1] for s in kv], label=name,
                color=COLORS.get(name))
    ax.set(xlabel="workload time (min)", ylabel="KV tokens held on decode",
           title="Retained KV over time")
    paths.append(save_plot(plt, fig, ax, out / "retained_kv.png"))
    paths.append(_ttft_tpot_plot(plt, result["summary"], out / "ttft_tpot.png"))
    return paths


def _ttft_tpot_plot(plt: Any, summary: dict[str, dict[str, Any]], path: Path) -> Path:
    """Per strategy, TTFT (turns 2+) and TPOT: a bar at the p50, a tick at the p99."""
    names = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, scale, label in ((axes[0], "ttft", 1.0, "TTFT, streamed turns 2+ (s)"),
                                  (axes[1], "tpot", 1000.0, "TPOT, streamed turns 2+ (ms)")):
        for i, name in enumerate(names):
            p50, p99 = summary[name].get(f"{key}_p50_s"), summary[name].get(f"{key}_p99_s")
            color = COLORS.get(name, "#888888")
            if p50 is not None:
                ax.bar(i, p50 * scale, color=color, alpha=0.8,
                       label="p50 (bar), p99 (tick)" if i == 0 else None)
            if p99 is not None:
                ax.plot([i - 0.3, i + 0.3], [p99 * scale] * 2, color=color, linewidth=2)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set(ylabel=label, ylim=(0, None))
    axes[0].set_title("Time to first token")
    axes[1].set_title("Time per output token")
    fig.tight_layout()
    return save_plot(plt, fig, [axes[0]], path)


# --- concurrency sweep -----------------------------------------------------------------------
# The stages of protocol.TurnTimings, in the order a turn goes through them, then the two only
# the bench's client sees (replay._attach_timings).
STAGES = ("router_wait", "plan", "plan_tokenize", "plan_lease", "plan_prefix_cache", "prefill_leg",
          "prefill_queue", "prefill_read", "prefill_engine", "decode_first_token", "decode_queue",
          "decode_read", "client_to_router", "router_to_client")


def stage_table(summary: dict[str, dict[str, Any]], label: str = "") -> list[str]:
    """Where turn 2+ time went (median seconds per stage), one row per P/D strategy."""
    rows = {name: m["stage_p50_s"] for name, m in summary.items() if m.get("stage_p50_s")}
    if not rows:
        return []
    lines = ["", f"Where turn 2+ time went{label} (median seconds; the router's turn records, "
             "`TurnTimings`):", "", "| strategy | " + " | ".join(STAGES) + " |",
             "|---" * (len(STAGES) + 1) + "|"]
    for name, stages in rows.items():
        lines.append(f"| {name} | " + " | ".join(fmt(stages.get(k)) for k in STAGES) + " |")
    return lines


def render_sweep_markdown(result: dict[str, Any]) -> str:
    meta = result["run"]
    lines = [
        *_run_lines(meta, "kvtether bench concurrency sweep"),
        "Levels " + ", ".join(str(n) for n in meta["levels"]) + ": at level N at most N "
        "sessions run at a time, each starting as soon as a slot is free, in scenario order "
        "(arrival times ignored, tool and think gaps kept). Each strategy was started once and "
        "replayed the scenario at every level in this order, each level with its own "
        "conversation ids.",
        "",
        "| concurrency | strategy | TTFT p50 / p99 (s) | turns/s | reuse fired / eligible "
        "| failed | divergent / compared | TPOT p50 / p99 (ms) | core-s / turn |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        div = "ref" if row["strategy"] == meta.get("reference") else (
            f"{fmt(row['divergent_outputs'])} / {row['compared_outputs']}")
        lines.append(
            f"| {row['concurrency']} | {row['strategy']} | {fmt(row['ttft_p50_s'])} / "
            f"{fmt(row['ttft_p99_s'])} | {fmt(row['turns_per_s'])} | "
            f"{row['fired_turns']}/{row['eligible_turns']} | {row['failed_turns']} | {div} | "
            f"{_pair(row, 'tpot_p50_s', 'tpot_p99_s', fmt_ms)} | "
            f"{fmt(row.get('core_s_per_turn'), 2)} |"
        )
    for level in meta["levels"]:
        at_level = {r["strategy"]: r for r in result["rows"] if r["concurrency"] == level}
        lines += stage_table(at_level, f" at concurrency {level}")
    ratios = result.get("ttft_p50_ratios") or []
    if ratios:
        lines += ["", "| concurrency | TTFT p50, kvtether / colocated |", "|---|---|"]
        for r in ratios:
            ratio = r["kvtether_over_colocated_ttft_p50"]
            lines.append(f"| {r['concurrency']} | {'-' if ratio is None else f'{ratio:.2f}x'} |")
    lines += _spread_lines(result)
    lines += [
        "",
        "TTFT: streamed turns 2+ (time to the first token through the SDK); TPOT: per "
        "streamed turn 2+, first token to last over the tokens after the first. turns/s: turns "
        "that completed over the level's wall time, first session start to last session end. "
        "Core-s / turn: CPU seconds of the strategy's processes over those turns. "
        "Reuse fired / eligible as in the plain bench (docs/benchmark.md, \"Benchmark: four "
        "strategies\"); divergent: outputs that differ from colocated's at the same level.",
        "",
    ]
    return "\n".join(lines)


def _spread_lines(result: dict[str, Any]) -> list[str]:
    """Each row's TTFT p99 over its p50, beside its TTFTs over the same turns' at level 1."""
    vs_alone = {(r["concurrency"], r["strategy"]): r for r in result.get("ttft_vs_alone") or []}
    lines = ["", "| concurrency | strategy | TTFT p99 / p50 | TTFT / same turn at level 1: "
             "p50 / p99 (turns) |", "|---|---|---|---|"]
    for row in result["rows"]:
        alone = vs_alone.get((row["concurrency"], row["strategy"]))
        lines.append(f"| {row['concurrency']} | {row['strategy']} | {_spread(row)} | "
                     f"{_ratios(alone)} |")
    lines += ["", "The same turn at level 1: each streamed turn 2+'s TTFT divided by the same "
              "turn's (session, turn) at level 1 on the same strategy, when level 1 ran; the "
              "waiting a level adds, apart from the spread of turn sizes the scenario has alone "
              "(its TTFT p99 / p50 at level 1)."]
    return lines


def write_sweep(result: dict[str, Any], out: Path) -> list[Path]:
    """sweep.json (every row, every turn) and sweep.md (the table)."""
    return write_files(result, out, "sweep", render_sweep_markdown)


def write_sweep_plot(result: dict[str, Any], out: Path) -> list[Path]:
    """sweep.png: TTFT p50 and p99, and turns/s, against the level, one line per strategy;
    [] when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return []
    out.mkdir(parents=True, exist_ok=True)
    by_strategy: dict[str, list[dict[str, Any]]] = {}
    for row in result["rows"]:
        by_strategy.setdefault(row["strategy"], []).append(row)
    levels = sorted({row["concurrency"] for row in result["rows"]})

    def values(rows: list[dict[str, Any]], key: str) -> list[float]:
        return [math.nan if r[key] is None else r[key] for r in rows]

    fig, (ttft, rate) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in by_strategy.items():
        rows = sorted(rows, key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rows]
        color = COLORS.get(name)
        ttft.plot(xs, values(rows, "ttft_p50_s"), marker="o", color=color, label=f"{name} p50")
        ttft.plot(xs, values(rows, "ttft_p99_s"), marker="s", linestyle="--", color=color,
                  label=f"{name} p99")
        rate.plot(xs, values(rows, "turns_per_s"), marker="o", color=color, label=name)
    log = any(r["ttft_p99_s"] for r in result["rows"])  # log of nothing positive warns
    if log:
        ttft.set_yscale("log")
    ttft.set(ylabel=f"TTFT, streamed turns 2+ (s{', log' if log else ''})",
             title="TTFT vs concurrency")
    rate.set(ylabel="turns/s", ylim=(0, None), title="Throughput vs concurrency")
    for ax in (ttft, rate):
        if len(levels) > 1 and levels[-1] / levels[0] >= 4:
            ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_xlabel("concurrency (sessions at a time)")
    fig.tight_layout()
    return [save_plot(plt, fig, [ttft, rate], out / "sweep.png")]


def _local_prefill(meta: dict[str, Any]) -> str:
    n = meta.get("local_prefill_max_tokens")
    if n is None:
        return "kvtether's local prefill not recorded"
    if n == 0:
        return "every kvtether turn through prefill"
    return f"kvtether turns adding at most {n:,} tokens computed on decode (local prefill)"
