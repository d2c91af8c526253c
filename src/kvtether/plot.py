"""One chart for the example notebooks: per-turn prompt tokens, reused vs. recomputed.

matplotlib is imported only when a chart is drawn (it is in the ``dev`` extra, not a runtime
dependency of kvtether).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["plot_turns"]

REUSED = "#2e7d32"
RECOMPUTED = "#ef6c00"


def plot_turns(turns: Sequence[Any] | Mapping[str, Sequence[Any]], ax: Any = None,
               title: str | None = None) -> Any:
    """Stacked bars per turn (reused / recomputed prompt tokens), labelled with the outcome.

    ``turns``: a session's ``turns`` (anything with ``turn``, ``prompt_tokens``,
    ``reused_tokens`` and ``outcome``), or a mapping ``{label: turns}`` for several
    conversations (one panel each, side by side). Returns the figure.
    """
    import matplotlib.pyplot as plt

    if isinstance(turns, Mapping):
        groups = list(turns.items())
        if ax is None:
            fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.6),
                                     sharey=True, squeeze=False)
            axes = list(axes[0])
        else:
            axes = list(ax) if isinstance(ax, Sequence) else [ax] * len(groups)
            fig = axes[0].figure
        for a, (label, group) in zip(axes, groups, strict=False):
            _draw(a, group, label)
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        return fig
    if ax is None:
        fig, ax = plt.subplots(figsize=(6, 3.6))
    _draw(ax, turns, title)
    ax.figure.tight_layout()
    return ax.figure


def _draw(ax: Any, turns: Sequence[Any], title: str | None) -> None:
    xs = list(range(len(turns)))
    reused = [t.reused_tokens for t in turns]
    recomputed = [max(t.prompt_tokens - t.reused_tokens, 0) for t in turns]
    ax.bar(xs, reused, color=REUSED, label="reused (cached KV: decode-held or prefill cache)")
    ax.bar(xs, recomputed, bottom=reused, color=RECOMPUTED, label="recomputed (prefill)")
    ax.set_xticks(xs, [f"{t.turn}\n{t.outcome}" for t in turns], fontsize=8)
    ax.set_xlabel("turn / outcome")
    ax.set_ylabel("prompt tokens")
    ax.set_ylim(0, max([t.prompt_tokens for t in turns] + [1]) * 1.35)  # room for the legend
    if title:
        ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left")
