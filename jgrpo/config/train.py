"""The `train` section: the loop's length, seed, checkpoints and metrics."""

from __future__ import annotations

import dataclasses

from jgrpo.config.fields import ConfigError, option


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """The loop: how long, the seed, where checkpoints and metrics go, and how often."""

    steps: int = option(100, "training steps (one rollout batch each)")
    seed: int = option(0, "seeds data order, initialisation and sampling")
    run_dir: str = option("runs/demo", "checkpoints and metrics; rerun with it to resume")
    eval_every: int = option(20, "evaluate on held-out prompts every N steps (0 = never)")
    save_every: int = option(50, "checkpoint every N steps")
    keep_checkpoints: int = option(3, "how many recent checkpoints to keep")
    export: bool = option(True, "write the final policy in HF format to run_dir/hf")
    log_samples: int = option(2, "sample completions printed at each evaluation")
    tensorboard: bool = option(True, "also write TensorBoard event files")
    progress: bool = option(True, "show a progress bar")
    compilation_cache: str | None = option(
        "~/.cache/jgrpo/jax",
        "persistent XLA compilation cache, so a rerun starts without compiling (None = off; "
        "not used on several CPU devices, docs/troubleshooting.md)",
    )
    profile_steps: int = option(
        0, "trace this many steps with the JAX profiler into run_dir/profile (0 = off)"
    )
    profile_start: int = option(
        2, "the first step traced, counted from 1 as in the metrics (step 1 compiles)"
    )

    def check(self):
        for name in ("steps", "save_every", "keep_checkpoints", "profile_start"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}.")
        if self.eval_every < 0:
            raise ConfigError(f"train.eval_every must be >= 0, got {self.eval_every}.")
        if self.profile_steps < 0:
            raise ConfigError(f"train.profile_steps must be >= 0, got {self.profile_steps}.")
        if self.profile_steps and self.profile_start > self.steps:
            raise ConfigError(
                f"train.profile_start={self.profile_start} is after the last step "
                f"(train.steps={self.steps}), so nothing would be traced; lower it."
            )
