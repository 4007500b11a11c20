"""Training metrics on disk and on screen: a JSONL log, TensorBoard scalars and a progress bar.

`MetricsWriter` appends one JSON object per step to `run_dir/metrics.jsonl` and mirrors every
scalar to TensorBoard under `run_dir/tensorboard`. The JSONL file is the record of a run: each
line is flushed as soon as it is written, so a killed run keeps every step it logged, and it
needs nothing but `json` to read (`read_metrics`, `scripts/plot_metrics.py`).

Resuming from a checkpoint re-does the steps after it, so a resumed writer first drops the lines
logged after the checkpoint step, and tells TensorBoard to purge its later events too. The file
then ends with exactly one line per step.

`ProgressBar` is a thin `tqdm` bar (which supplies the rate and ETA) showing reward, KL and eval
accuracy.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import tqdm

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _json_value(value: Any) -> Any:
    """A Python scalar for JSON: numpy / jax scalars unwrapped, NaN and +-Inf as None."""
    if value is None or isinstance(value, str):
        return value
    array = np.asarray(value)
    if array.ndim != 0:
        raise ValueError(f"metrics must be scalars, got an array of shape {array.shape}")
    scalar = array.item()
    if isinstance(scalar, float) and not math.isfinite(scalar):
        return None
    return scalar


def _read_lines(path: Path) -> list[dict]:
    """The parsed lines of a JSONL file; a torn last line (a run killed mid-write) is skipped."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for index, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if index != len(lines) - 1:
                raise
    return records


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The logged steps of a run: one dict per line of `run_dir/metrics.jsonl`."""
    return _read_lines(Path(run_dir) / METRICS_FILE)


class MetricsWriter:
    """Logs one dict of scalar metrics per step to `run_dir/metrics.jsonl` and TensorBoard.

    resume_step: the step of the checkpoint a run resumes from. Lines logged after it are
        dropped (those steps run again). None starts a new run: an existing file is emptied.
    tensorboard: also write TensorBoard event files under `run_dir/tensorboard`.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        resume_step: int | None = None,
        tensorboard: bool = True,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE

        kept = []
        if resume_step is not None and self.path.exists():
            kept = [line for line in _read_lines(self.path) if line["step"] <= resume_step]
        # Rewrite through a temporary file so a crash here cannot lose the kept lines.
        temporary = self.path.with_suffix(".jsonl.tmp")
        temporary.write_text("".join(json.dumps(line) + "\n" for line in kept))
        os.replace(temporary, self.path)
        self._file = self.path.open("a")

        self._tensorboard = None
        if tensorboard:
            # Imported here: tensorboardX imports torch when it is installed (seconds).
            from tensorboardX import SummaryWriter

            self._tensorboard = SummaryWriter(
                str(self.run_dir / TENSORBOARD_DIR),
                # TensorBoard discards earlier events at steps >= purge_step: all of them for a
                # new run, the re-done steps for a resumed one.
                purge_step=0 if resume_step is None else resume_step + 1,
                flush_secs=10,
                # tensorboardX names event files by the second and truncates an existing one;
                # nanoseconds keep a quick restart from overwriting the previous file.
                filename_suffix=f".{time.time_ns()}",
            )

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Logs `metrics` (name -> scalar) for `step`; the JSONL line is flushed at once."""
        if "step" in metrics:
            raise ValueError("'step' is reserved for the step number; rename that metric")
        values = {name: _json_value(value) for name, value in metrics.items()}
        self._file.write(json.dumps({"step": int(step), **values}, allow_nan=False) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            for name, value in values.items():
                if isinstance(value, int | float):  # None (non-finite) and strings are skipped
                    self._tensorboard.add_scalar(name, value, int(step))

    def close(self) -> None:
        """Closes the JSONL file and flushes TensorBoard."""
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# Postfix label -> metric key, in display order.
PROGRESS_METRICS = {"reward": "reward/mean", "kl": "kl", "eval_acc": "eval/accuracy"}


class ProgressBar:
    """A tqdm bar over training steps, with reward, KL and eval accuracy in its postfix.

    initial_step: steps already done (a resumed run), so the bar and ETA start there.
    enabled: False shows nothing (e.g. on every process but the first).
    """

    def __init__(self, total_steps: int, *, initial_step: int = 0, enabled: bool = True):
        self._bar = tqdm.tqdm(
            total=total_steps,
            initial=initial_step,
            disable=not enabled,
            unit="step",
            dynamic_ncols=True,
        )

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Moves the bar to `step` steps done and shows the metrics to 3 significant digits."""
        postfix = {
            label: f"{float(metrics[key]):.3g}"
            for label, key in PROGRESS_METRICS.items()
            if metrics.get(key) is not None
        }
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(step - self._bar.n)

    def close(self) -> None:
        """Draws the final state and releases the terminal line."""
        self._bar.close()
