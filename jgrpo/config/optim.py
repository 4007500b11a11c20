"""The `optim` section: AdamW and the learning-rate schedule."""

from __future__ import annotations

import dataclasses

from jgrpo.config.fields import ConfigError, option


@dataclasses.dataclass(frozen=True)
class OptimSection:
    """AdamW after global-norm clipping, with linear warmup then a constant or cosine lr."""

    lr: float = option(1e-6, "peak learning rate (AdamW)")
    warmup_steps: int = option(0, "linear warmup from 0, in optimizer steps")
    schedule: str = option("constant", "after warmup: constant or cosine")
    weight_decay: float = option(0.0, "AdamW decoupled weight decay")
    max_grad_norm: float | None = option(1.0, "global-norm gradient clipping; None = off")
    b1: float = option(0.9, "Adam beta1")
    b2: float = option(0.99, "Adam beta2")
    eps: float = option(1e-8, "Adam epsilon: added to sqrt(v) in the update's denominator")

    def check(self):
        if self.lr <= 0:
            raise ConfigError(f"optim.lr must be > 0, got {self.lr}.")
        if self.eps <= 0:
            raise ConfigError(f"optim.eps must be > 0, got {self.eps}.")
        if self.schedule not in ("constant", "cosine"):
            raise ConfigError(
                f"optim.schedule must be 'constant' or 'cosine', got {self.schedule!r}."
            )
        if self.warmup_steps < 0 or self.weight_decay < 0:
            raise ConfigError("optim.warmup_steps and optim.weight_decay must be >= 0.")
