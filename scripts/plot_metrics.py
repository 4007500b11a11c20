"""Plots the main training curves of a run from its metrics.jsonl into one PNG.

Run: python scripts/plot_metrics.py RUN_DIR [--out PNG]   (default PNG: RUN_DIR/metrics.png)

A command line over `jgrpo.plotting.plot_metrics`, which draws one panel per group of curves
that was logged (reward, each reward function, eval, KL, loss, entropy, completion length,
groups with zero reward std, clipped-ratio fractions). Needs matplotlib (the `[plot]` extra).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jgrpo.plotting import plot_metrics


def main(argv: list[str] | None = None) -> Path:
    """Parses the command line, plots the run and returns the PNG's path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="directory holding metrics.jsonl")
    parser.add_argument("--out", type=Path, help="PNG to write (default: RUN_DIR/metrics.png)")
    args = parser.parse_args(argv)

    out = args.out or args.run_dir / "metrics.png"
    try:
        plot_metrics(args.run_dir, out=out)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(str(error)) from None
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
