"""The `reward_model` section: a learned reward model."""

from __future__ import annotations

import dataclasses

from jgrpo.config.fields import ConfigError, check_dtype, option


@dataclasses.dataclass(frozen=True)
class RewardModelSection:
    """A learned reward model (an HF sequence classifier) scored as one more reward function."""

    path: str | None = option(
        None, "HF *ForSequenceClassification checkpoint dir or hub name; None: no reward model"
    )
    name: str = option("reward_model", "its reward's name: metrics reward/<name>/mean")
    weight: float = option(1.0, "its weight in the total reward")
    dtype: str = option("bfloat16", "its parameter dtype: bfloat16 or float32")
    batch_size: int = option(16, "sequences scored per jitted call")
    max_length: int = option(2048, "longest prompt + completion in its tokens (longer: None)")
    normalize: str = option(
        "none", "none, or running: (score - mean) / std over every training score so far"
    )
    scale: float = option(
        1.0, "reward = scale * score + shift: a fixed affine map (after normalize)"
    )
    shift: float = option(0.0, "added after scale")

    def check(self):
        check_dtype("reward_model.dtype", self.dtype)
        if self.batch_size < 1 or self.max_length < 1:
            raise ConfigError(
                "reward_model.batch_size and reward_model.max_length must be >= 1; got "
                f"{self.batch_size}, {self.max_length}."
            )
        if not self.name:
            raise ConfigError("reward_model.name must be a non-empty string.")
        if self.normalize not in ("none", "running"):
            raise ConfigError(
                f"reward_model.normalize must be 'none' or 'running', got {self.normalize!r}."
            )
