"""jgrpo: JAX-native GRPO. The pure objective (advantages, loss, log-probs) is importable alone."""

from jgrpo.advantages import GroupStats, group_advantages, group_statistics
from jgrpo.logprobs import chunked_token_logprobs, token_logprobs
from jgrpo.losses import grpo_loss, sequence_kl, token_kl

__all__ = [
    "GroupStats",
    "chunked_token_logprobs",
    "group_advantages",
    "group_statistics",
    "grpo_loss",
    "sequence_kl",
    "token_kl",
    "token_logprobs",
]
__version__ = "0.1.0"
