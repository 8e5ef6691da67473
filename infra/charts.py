"""PNG charts (data funnel, training curves): the only matplotlib user. Rendered off-screen (Agg).

A chart is a pure function of its data, so each one is rendered once and kept under
`$GRISTMILL_HOME/cache/charts/<digest>.png`: a fully reused run copies its charts from there and
never imports matplotlib (about two seconds of a reused run). The cache is safe to delete.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from gristmill.infra import env


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


# pyplot's figures are process-wide state, and reused stages are recorded on threads
# (flows/pipeline.py): this process renders one chart at a time.
_ONE_AT_A_TIME = threading.Lock()


def _cached(render: Callable[..., Path]) -> Callable[..., Path]:
    """Serve `render(data, path, title, ...)` from the chart cache, keyed by all its arguments."""

    @functools.wraps(render)
    def chart(data, path: Path, title: str, **options) -> Path:
        digest = hashlib.sha256(json.dumps([render.__name__, data, title, options], sort_keys=True,
                                           default=str).encode()).hexdigest()[:24]
        kept = env.gristmill_home() / "cache" / "charts" / f"{digest}.png"
        with _ONE_AT_A_TIME:
            if not kept.exists():
                kept.parent.mkdir(parents=True, exist_ok=True)
                partial = kept.with_name(f"{digest}.{os.getpid()}.partial.png")
                render(data, partial, title, **options)
                partial.replace(kept)  # whole files only: another run may read it at once
        shutil.copyfile(kept, path)
        return Path(path)

    return chart


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)  # pyplot keeps every open figure alive otherwise
    return path


@_cached
def funnel_chart(steps: Sequence[Mapping[str, float]], path: Path, title: str) -> Path:
    """Horizontal bars, first step on top: documents (left panel) and MB (right) after each step."""
    plt = _pyplot()
    names = [s["step"] for s in steps][::-1]
    fig, (docs_ax, mb_ax) = plt.subplots(1, 2, figsize=(11, 0.45 * len(steps) + 1.5), sharey=True)
    for ax, values, label in ((docs_ax, [s["docs"] for s in steps], "documents"),
                              (mb_ax, [s["bytes"] / 1e6 for s in steps], "MB")):
        values = values[::-1]
        bars = ax.barh(names, values, color="#4c72b0")
        ax.bar_label(bars, labels=[f"{v:,.0f}" if label == "documents" else f"{v:,.2f}"
                                   for v in values], padding=3, fontsize=8)
        ax.set_xlabel(label)
        ax.margins(x=0.25)
    fig.suptitle(title)
    return _save(plt, fig, path)


@_cached
def histogram_chart(counts: Mapping[str, int], path: Path, title: str, top: int = 20) -> Path:
    """Bars of the `top` largest counts (the rest summed as 'other'), largest first."""
    plt = _pyplot()
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    shown = ranked[:top] + ([("other", sum(v for _, v in ranked[top:]))] if len(ranked) > top else [])
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * len(shown) + 2), 3.5))
    bars = ax.bar([k for k, _ in shown], [v for _, v in shown], color="#55a868")
    ax.bar_label(bars, fontsize=8)
    ax.set_ylabel("documents")
    ax.set_title(title)
    return _save(plt, fig, path)


@_cached
def curves_chart(series: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]], path: Path,
                 title: str) -> Path:
    """One panel per training stage, one line per metric against the step."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(series), figsize=(4.5 * len(series), 3.4), squeeze=False)
    for ax, (stage, metrics) in zip(axes[0], series.items()):
        for name, points in metrics.items():
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o" if len(points) < 12 else None, ms=3, label=name)
        ax.set_title(stage)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(plt, fig, path)
