"""The rollout engine: G completions of each prompt, decoded on device from one typed state.

- `engine`: the `DecodeState`, `prepare` (each prompt prefilled once for its G rows, the decode
  layout of the weights, every row's first token) and the one `step` every driver runs;
- `drivers`: single-turn rollouts as one compiled program, every row at once (in phases of
  growing attention buffers) or in refilled slots (`rollout`);
- `turns`: multi-turn episodes, their turns decoded in slots and answered by the host;
- `sampler`: the token draw and its log-probs; `memory`: caches, slots and phases.
"""

from jgrpo.rollout.drivers import Rollout, decode_all_rows, decode_in_slots, rollout
from jgrpo.rollout.engine import DecodeLayout, DecodeState, prepare, step, take_slots
from jgrpo.rollout.memory import attention_phases, concurrent_rows, kv_cache_bytes
from jgrpo.rollout.sampler import (
    SamplingConfig,
    categorical,
    filter_logits,
    inverse_cdf_sample,
    sample_tokens,
)

__all__ = [
    "DecodeLayout",
    "DecodeState",
    "Rollout",
    "SamplingConfig",
    "attention_phases",
    "categorical",
    "concurrent_rows",
    "decode_all_rows",
    "decode_in_slots",
    "filter_logits",
    "inverse_cdf_sample",
    "kv_cache_bytes",
    "prepare",
    "rollout",
    "sample_tokens",
    "step",
    "take_slots",
]
