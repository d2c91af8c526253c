"""What `kvtether bench` writes: results JSON, a markdown table, three PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["TARGETS", "render_markdown", "targets", "write_plots", "write_results"]

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
    one = summary.get("pd-oneway")
    if one and one["ttft_p50_s"] and k["ttft_p50_s"]:
        ratio = one["ttft_p50_s"] / k["ttft_p50_s"]
        add("turn 2+ TTFT p50, pd-oneway / kvtether", f"{ratio:.2f}x", ">= 3x", ratio >= 3)
    return rows


TARGETS = targets  # the name the docs use


def render_markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    meta = result["run"]
    lines = [
        f"# kvtether bench — {meta['scenario']['name']}",
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
    rows = targets(s)
    if rows:
        lines += ["", "Targets for kvtether in this run:", "",
                  "| target | measured | goal | met |", "|---|---|---|---|"]
        for r in rows:
            met = "-" if r["met"] is None else ("yes" if r["met"] else "**no**")
            lines.append(f"| {r['target']} | {r['measured']} | {r['goal']} | {met} |")
    lines += [
        "",
        "TTFT: streamed turns 2+ (time to the first token through the SDK). Eligible: turn 2+ "
        "whose prompt repeats at least `kv_recompute_threshold` tokens of what the previous "
        "turn built (prompt + answer); fired: it recomputed less than a block of those. "
        "Retained KV: `vllm:kv_cache_usage_perc` x capacity on the decode instances (the "
        "colocated instance: blocks of running requests only; its prefix cache is evictable), "
        "sampled every 0.5 s until the held KV was gone, x the compression factor.",
        "",
    ]
    return "\n".join(lines)


def write_results(result: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.md"]
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    paths[1].write_text(render_markdown(result))
    return paths


def _save(plt: Any, fig: Any, ax: Any, path: Path) -> Path:
    """Legend (if anything is labelled), write the PNG, free the figure."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def write_plots(result: dict[str, Any], out: Path) -> list[Path]:
    """reuse_by_turn.png, ttft_cdf.png, retained_kv.png; [] when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
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
