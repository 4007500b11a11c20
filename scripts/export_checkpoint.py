"""Exports a training checkpoint as a Hugging Face checkpoint (config, safetensors, tokenizer).

    python scripts/export_checkpoint.py RUN_DIR OUT_DIR [--step N]

The run's config is read from the checkpoint itself, so this works on any run directory
written by `python -m jgrpo.train`, mid-run or after it; the default step is the newest
intact one (a damaged step is skipped with a warning).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from jgrpo.checkpoint import CheckpointDamaged
from jgrpo.train import export_checkpoint


def main(argv: list[str] | None = None) -> pathlib.Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=pathlib.Path)
    parser.add_argument("out_dir", type=pathlib.Path)
    parser.add_argument("--step", type=int, default=None, help="default: the latest")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.run_dir, args.out_dir, step=args.step)
    except (FileNotFoundError, CheckpointDamaged) as error:
        sys.exit(f"error: {error}")
    print(f"exported {args.run_dir} to {out}")
    return out


if __name__ == "__main__":
    main()
