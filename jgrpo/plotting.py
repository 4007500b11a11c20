"""The main training curves of a run, drawn from its metrics.jsonl into one matplotlib figure.

    fig = plot_metrics("runs/demo")                      # a Figure; a notebook displays it
    plot_metrics("runs/demo", out="runs/demo/curves.png")  # and also written to a PNG

One panel per group of curves, drawn only when its metrics were logged: reward (mean +- std),
each reward function, eval, KL, loss, entropy, completion length, groups with zero reward std,
and the clipped-ratio fractions. matplotlib is the optional `[plot]` extra and is imported only
when a figure is drawn. `scripts/plot_metrics.py RUN_DIR` is the command line over this.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from jgrpo.metrics import METRICS_FILE, read_metrics

if TYPE_CHECKING:
    from matplotlib.figure import Figure

REWARD_SUMMARY_KEYS = ("reward/mean", "reward/std")
COLUMNS = 3

Records = Sequence[Mapping[str, Any]]


def reward_function_keys(records: Records) -> list[str]:
    """Per-function reward means: every "reward/<name>/mean" key."""
    keys = {key for record in records for key in record}
    return sorted(
        key
        for key in keys
        if key.startswith("reward/") and key.endswith("/mean") and key not in REWARD_SUMMARY_KEYS
    )


def panels(records: Records) -> list[tuple[str, list[str]]]:
    """(title, metric keys) for each panel, in display order; panels without data left out."""
    candidates = [
        ("reward", ["reward/mean"]),
        ("reward per function", reward_function_keys(records)),
        ("eval", ["eval/reward", "eval/accuracy"]),
        ("KL to reference", ["kl"]),
        ("loss", ["loss"]),
        ("entropy", ["entropy"]),
        ("completion length (mean)", ["completion_len/mean"]),
        ("groups with zero reward std (fraction)", ["frac_zero_std"]),
        ("clipped ratio (fraction)", ["clip_frac/low", "clip_frac/high", "clip_frac/dual"]),
    ]
    logged = {key for record in records for key in record}
    shown = [(title, [key for key in keys if key in logged]) for title, keys in candidates]
    return [(title, keys) for title, keys in shown if keys]


def series(records: Records, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the records that logged `key`; null (non-finite) values become NaN."""
    logged = [record for record in records if key in record]
    steps = np.array([record["step"] for record in logged])
    values = np.array([np.nan if record[key] is None else record[key] for record in logged])
    return steps, values.astype(float)


def _draw_std_band(ax, records: Records) -> None:
    """Shades reward/mean +- reward/std over the steps that logged both."""
    both = [
        record
        for record in records
        if record.get("reward/mean") is not None and record.get("reward/std") is not None
    ]
    if both:
        steps = np.array([record["step"] for record in both])
        mean = np.array([record["reward/mean"] for record in both])
        std = np.array([record["reward/std"] for record in both])
        ax.fill_between(steps, mean - std, mean + std, alpha=0.25, label="±reward/std")


def plot_metrics(
    run_dir_or_records: str | os.PathLike | Records, out: str | os.PathLike | None = None
) -> Figure:
    """Draws the panels of a run (its directory, or its metric records) into a new Figure.

    With `out`, the figure is also written there as a PNG (100 dpi). The figure is not
    registered with pyplot (no global state, no display needed); a notebook shows it when it
    is the value of a cell, or with `IPython.display.display(fig)`. Raises FileNotFoundError
    for a directory without metrics.jsonl and ValueError when nothing plottable was logged.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if isinstance(run_dir_or_records, str | os.PathLike):
        path = Path(run_dir_or_records) / METRICS_FILE
        if not path.exists():
            raise FileNotFoundError(f"no metrics file at {path}")
        records = read_metrics(run_dir_or_records)
        if not records:
            raise ValueError(f"{path} is empty: no steps logged yet")
    else:
        records = list(run_dir_or_records)
    chosen = panels(records)
    if not chosen:
        raise ValueError("none of the known metrics (reward/mean, kl, loss, ...) were logged")
    rows = math.ceil(len(chosen) / COLUMNS)
    fig = Figure(figsize=(5 * COLUMNS, 3.2 * rows))
    FigureCanvasAgg(fig)  # renders to PNG without a display
    axes = fig.subplots(rows, COLUMNS, squeeze=False)
    for ax, (title, keys) in zip(axes.flat, chosen, strict=False):
        for key in keys:
            steps, values = series(records, key)
            if len(steps) == 0:
                continue
            # Sparse curves (eval every N steps) get markers so single points still show.
            ax.plot(steps, values, label=key, marker="." if len(steps) < 50 else None)
        if "reward/mean" in keys:
            _draw_std_band(ax, records)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes.flat[len(chosen) :]:
        ax.set_visible(False)
    fig.tight_layout()
    if out is not None:
        fig.savefig(out, dpi=100)
    return fig
