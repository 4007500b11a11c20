"""Reward functions and how they are called: the TRL signature, None, failures, weights.

A reward function is `fn(prompts, completions, **example_fields) -> list[float | None]`,
the signature of TRL's GRPOTrainer, so functions written for TRL port unchanged.
"""

from jgrpo.rewards.scoring import (
    RewardError,
    RewardFn,
    Scores,
    completion_text,
    score_completions,
)

__all__ = ["RewardError", "RewardFn", "Scores", "completion_text", "score_completions"]
