"""`Task` (a dataset of examples with the rewards that score them) and `take`, the seeded
order in which a run draws its examples; the task modules build on these."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jgrpo.rewards import RewardFn


@dataclasses.dataclass
class Task:
    """What to train on and how it is scored; `jgrpo.train.train(config, task=...)` takes one.

    Examples (in `train` and `eval`) are dicts with a "prompt" (text, or chat messages) and
    any fields the reward functions read (e.g. "answer"). A reward function has TRL's
    signature, `fn(prompts, completions, **fields) -> list[float | None]`; a completion's
    reward is the sum of its scores times their `reward_weights` (1.0 when not given).
    """

    name: str
    train: Sequence[Mapping[str, Any]]
    eval: Sequence[Mapping[str, Any]]  # held-out examples for greedy evaluation
    reward_fns: dict[str, RewardFn]
    reward_weights: dict[str, float]
    correctness: str  # the reward that is 1.0 exactly when the answer is right (accuracy)
    tokenizer: Any = None  # a task that brings its own (the demo); else the model's is used
    # Multi-turn episodes (rollout.max_turns > 1): tools the model may call (typed, documented
    # functions; `jgrpo.tools`), or an environment factory, called once per episode.
    tools: Sequence[Callable] = ()
    environment: Callable[[], Any] | None = None

    def __post_init__(self):
        if not self.train:
            raise ValueError(f"task {self.name!r} has no training examples.")
        if self.correctness not in self.reward_fns:
            raise ValueError(
                f"task {self.name!r}: correctness reward {self.correctness!r} is not one of "
                f"its reward functions {sorted(self.reward_fns)}."
            )
        for row, example in enumerate(self.train):
            if "prompt" not in example:
                raise ValueError(f"task {self.name!r}: training example {row} has no 'prompt'.")

    @property
    def max_reward(self) -> float:
        """The best weighted reward: every positive-weight function at 1.0, penalties at 0."""
        weights = (self.reward_weights.get(name, 1.0) for name in self.reward_fns)
        return float(sum(max(weight, 0.0) for weight in weights))


def take(
    examples: Sequence[Mapping[str, Any]], count: int, *, position: int, seed: int
) -> list[Mapping[str, Any]]:
    """Examples position, position + 1, ... of the endless stream of seeded epoch shuffles."""
    size = len(examples)
    taken = []
    for index in range(position, position + count):
        epoch, offset = divmod(index, size)
        order = np.random.default_rng([seed, epoch]).permutation(size)
        taken.append(examples[int(order[offset])])
    return taken
