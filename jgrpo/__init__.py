"""jgrpo: JAX-native GRPO. The pure objective (advantages, loss, log-probs) is importable alone.

Sampling, generation and the update step build on `jgrpo.models` (Flax; the repository's
`models/` folder, installed under jgrpo's name); they are imported on first use, so
`import jgrpo` alone stays free of Flax for codebases that only want the objective.
"""

import importlib

from jgrpo.advantages import GroupStats, group_advantages, group_statistics, zero_signal_groups
from jgrpo.logprobs import chunked_token_logprobs, token_logprobs
from jgrpo.losses import (
    grpo_loss,
    high_entropy_mask,
    off_policy_mask,
    sampler_weights,
    sequence_kl,
    token_kl,
)

_LAZY = {
    "generate": "jgrpo.generation",
    "Generations": "jgrpo.generation",
    "Rollout": "jgrpo.rollout",
    "SamplingConfig": "jgrpo.rollout",
    "Batch": "jgrpo.update",
    "TrainState": "jgrpo.update",
    "UpdateConfig": "jgrpo.update",
    "init_state": "jgrpo.update",
    "make_optimizer": "jgrpo.update",
    "train_step": "jgrpo.update",
}

__all__ = [
    "Batch",
    "Generations",
    "GroupStats",
    "Rollout",
    "SamplingConfig",
    "TrainState",
    "UpdateConfig",
    "chunked_token_logprobs",
    "generate",
    "group_advantages",
    "group_statistics",
    "grpo_loss",
    "high_entropy_mask",
    "init_state",
    "make_optimizer",
    "off_policy_mask",
    "sampler_weights",
    "sequence_kl",
    "token_kl",
    "token_logprobs",
    "train_step",
    "zero_signal_groups",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jgrpo' has no attribute {name!r}")
