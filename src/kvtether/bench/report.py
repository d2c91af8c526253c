"""What `kvtether bench` writes: results JSON, a markdown table, three PNG plots; for a
concurrency sweep (``--concurrency``), sweep JSON, a markdown table and one two-panel plot."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtether.bench.metrics import same_turn_ratios

__all__ = ["TARGETS", "render_markdown", "render_sweep_markdown", "targets", "write_plots",
           "write_results", "write_sweep", "write_sweep_plot"]

COLORS = {"colocated": "#555555", "pd-oneway": "#ef6c00", "pd-upstream": "#1565c0",
          "kvtether": "#2e7d32"}


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def targets(summary: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """kvtether's targets (issue 11) against this run's figures: measured, target, met."""
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
    col = summary.get("colocated")
    if col and col["ttft_p50_s"] and k["ttft_p50_s"]:
        ratio = k["ttft_p50_s"] / col["ttft_p50_s"]
        add("turn 2+ TTFT p50, kvtether / colocated", f"{ratio:.2f}x", "<= 1.0x", ratio <= 1.0)
    if k["ttft_p50_s"] and k["ttft_p99_s"]:
        ratio = k["ttft_p99_s"] / k["ttft_p50_s"]
        add("turn 2+ TTFT p99 / p50 (kvtether)", f"{ratio:.2f}x", "<= 3x", ratio <= 3)
    if col and col["turns_per_s"] and k["turns_per_s"]:
        ratio = k["turns_per_s"] / col["turns_per_s"]
        add("turns/s, kvtether / colocated", f"{ratio:.2f}x", ">= 1.0x", ratio >= 1.0)
    one = summary.get("pd-oneway")
    if one and one["ttft_p50_s"] and k["ttft_p50_s"]:
        ratio = one["ttft_p50_s"] / k["ttft_p50_s"]
        add("turn 2+ TTFT p50, pd-oneway / kvtether", f"{ratio:.2f}x", ">= 3x", ratio >= 3)
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
        f"{meta.get('baseline_connector', 'kvtether')} connector, {meta['host']}, "
        f"{meta['date']}.",
        "",
        "Scenario: " + ", ".join(f"{k} {v}" for k, v in meta["scenario_summary"].items()) + ".",
        "",
    ]


def render_markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    meta = result["run"]
    lines = [
        *_run_lines(meta, "kvtether bench"),
        "| strategy | reuse fired / eligible | TTFT p50 / p90 / p99 (s) | latency p50 (s) "
        "| prompt tokens recomputed | of which reusable | retained KV token-s (workload) "
        "| divergent / compared | failed | turns/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in s.items():
        rate = "" if m["reuse_rate"] is None else f" ({m['reuse_rate']:.0%})"
        div = "ref" if name == meta.get("reference") else (
            f"{_fmt(m['divergent_outputs'])} / {m['compared_outputs']}")
        lines.append(
            f"| {name} | {m['fired_turns']}/{m['eligible_turns']}{rate} | "
            f"{_fmt(m['ttft_p50_s'])} / {_fmt(m['ttft_p90_s'])} / {_fmt(m['ttft_p99_s'])} | "
            f"{_fmt(m['latency_p50_s'])} | {m['recomputed_tokens']} | "
            f"{m['recomputed_reusable_tokens']} | {m['retained_kv_token_s_workload']:.0f} | "
            f"{div} | {m['failed_turns']} | {_fmt(m['turns_per_s'])} |"
        )
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
        "TTFT: streamed turns 2+ (time to the first token through the SDK). Eligible: turn 2+ "
        "whose prompt repeats at least `kv_recompute_threshold` tokens of what the previous "
        "turn built (prompt + answer, less the answer's last token, which has no KV); fired: it "
        "recomputed less than a block of those. "
        "Retained KV: `vllm:kv_cache_usage_perc` x capacity on the decode instances (the "
        "colocated instance: blocks of running requests only; its prefix cache is evictable), "
        "sampled every 0.5 s until the held KV was gone, x the compression factor.",
        "",
    ]
    return "\n".join(lines)


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


def _write(result: dict[str, Any], out: Path, stem: str,
           render: Callable[[dict[str, Any]], str]) -> list[Path]:
    """``<stem>.json`` (everything) and ``<stem>.md`` (``render``'s tables)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    paths[1].write_text(render(result))
    return paths


def write_results(result: dict[str, Any], out: Path) -> list[Path]:
    return _write(result, out, "results", render_markdown)


def _save(plt: Any, fig: Any, ax: Any, path: Path) -> Path:
    """Legend on each axes (``ax``: one or a list) where anything is labelled, write the PNG,
    free the figure."""
    for a in ax if isinstance(ax, list) else [ax]:
        if a.get_legend_handles_labels()[0]:
            a.legend()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_plots(result: dict[str, Any], out: Path) -> list[Path]:
    """reuse_by_turn.png, ttft_cdf.png, retained_kv.png; [] when matplotlib is missing."""
    plt = _pyplot()
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
    paths.append(_save(plt, fig, ax, out / "reuse_by_turn.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, data in strategies.items():
        values = sorted(t["ttft_s"] for t in data["turns"]
                        if t["ttft_s"] is not None and t["turn"] >= 2)
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                    label=name, color=COLORS.get(name))
    ax.set(xscale="log", xlabel="TTFT, turns 2+ (s, log)", ylabel="fraction of turns",
           title="TTFT CDF (streamed turns)")
    paths.append(_save(plt, fig, ax, out / "ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, data in strategies.items():
        kv = data["kv"]
        ax.plot([s[0] * compress / 60 for s in kv], [s[1] for s in kv], label=name,
                color=COLORS.get(name))
    ax.set(xlabel="workload time (min)", ylabel="KV tokens held on decode",
           title="Retained KV over time")
    paths.append(_save(plt, fig, ax, out / "retained_kv.png"))
    return paths


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
        lines.append(f"| {name} | " + " | ".join(_fmt(stages.get(k)) for k in STAGES) + " |")
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
        "| failed | divergent / compared |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        div = "ref" if row["strategy"] == meta.get("reference") else (
            f"{_fmt(row['divergent_outputs'])} / {row['compared_outputs']}")
        lines.append(
            f"| {row['concurrency']} | {row['strategy']} | {_fmt(row['ttft_p50_s'])} / "
            f"{_fmt(row['ttft_p99_s'])} | {_fmt(row['turns_per_s'])} | "
            f"{row['fired_turns']}/{row['eligible_turns']} | {row['failed_turns']} | {div} |"
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
        "TTFT: streamed turns 2+ (time to the first token through the SDK). turns/s: turns "
        "that completed over the level's wall time, first session start to last session end. "
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
    return _write(result, out, "sweep", render_sweep_markdown)


def write_sweep_plot(result: dict[str, Any], out: Path) -> list[Path]:
    """sweep.png: TTFT p50 and p99, and turns/s, against the level, one line per strategy;
    [] when matplotlib is missing."""
    plt = _pyplot()
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
    return [_save(plt, fig, [ttft, rate], out / "sweep.png")]
