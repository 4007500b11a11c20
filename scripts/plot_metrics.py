"""Plots the main training curves of a run from its metrics.jsonl into one PNG.

Run: python scripts/plot_metrics.py RUN_DIR [--out PNG]   (default PNG: RUN_DIR/metrics.png)

One panel per group of curves, drawn only when its metrics were logged: reward (mean +- std),
each reward function, eval, KL, loss, entropy, completion length, groups with zero reward std,
and the clipped-ratio fractions.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from jgrpo.metrics import METRICS_FILE, read_metrics

REWARD_SUMMARY_KEYS = ("reward/mean", "reward/std")
COLUMNS = 3


def reward_function_keys(records: list[dict]) -> list[str]:
    """Per-function reward keys: every "reward/..." key except the mean and std."""
    keys = {key for record in records for key in record}
    return sorted(
        key for key in keys if key.startswith("reward/") and key not in REWARD_SUMMARY_KEYS
    )


def panels(records: list[dict]) -> list[tuple[str, list[str]]]:
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
        ("clipped ratio (fraction)", ["clip_frac/low", "clip_frac/high"]),
    ]
    logged = {key for record in records for key in record}
    return [(title, keys) for title, keys in candidates if logged.intersection(keys)]


def series(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the records that logged `key`; null (non-finite) values become NaN."""
    logged = [record for record in records if key in record]
    steps = np.array([record["step"] for record in logged])
    values = np.array([np.nan if record[key] is None else record[key] for record in logged])
    return steps, values.astype(float)


def draw_std_band(ax, records: list[dict]) -> None:
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


def plot(records: list[dict], out: Path) -> None:
    """Draws the panels of `records` into a PNG at `out`."""
    chosen = panels(records)
    if not chosen:
        raise SystemExit("none of the known metrics (reward/mean, kl, loss, ...) were logged")
    rows = math.ceil(len(chosen) / COLUMNS)
    # The Agg canvas renders straight to a file: no display and no global pyplot state.
    fig = Figure(figsize=(5 * COLUMNS, 3.2 * rows))
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, COLUMNS, squeeze=False)
    for ax, (title, keys) in zip(axes.flat, chosen, strict=False):
        for key in keys:
            steps, values = series(records, key)
            if len(steps) == 0:
                continue
            # Sparse curves (eval every N steps) get markers so single points still show.
            ax.plot(steps, values, label=key, marker="." if len(steps) < 50 else None)
        if "reward/mean" in keys:
            draw_std_band(ax, records)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes.flat[len(chosen) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main(argv: list[str] | None = None) -> Path:
    """Parses the command line, plots the run and returns the PNG's path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="directory holding metrics.jsonl")
    parser.add_argument("--out", type=Path, help="PNG to write (default: RUN_DIR/metrics.png)")
    args = parser.parse_args(argv)

    metrics_path = args.run_dir / METRICS_FILE
    if not metrics_path.exists():
        raise SystemExit(f"no metrics file at {metrics_path}")
    records = read_metrics(args.run_dir)
    if not records:
        raise SystemExit(f"{metrics_path} is empty: no steps logged yet")

    out = args.out or args.run_dir / "metrics.png"
    plot(records, out)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
