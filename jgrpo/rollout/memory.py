"""What a rollout holds and reads: the KV cache one device keeps, the slots it decodes in, and
the phases of growing completion buffers that let attention skip slots not yet written."""

from __future__ import annotations

from jgrpo.models.config import ModelConfig
from jgrpo.models.group_decode import cache_bytes_per_slot, completion_cache_bytes
from jgrpo.sharding import traced_shard_count

# Completions at least this long decode in phases of growing attention windows, provided
# the completion caches one device holds (its rows' keys and values, every layer) take at
# least PHASED_DECODE_MIN_CACHE_BYTES: below that, attention is too small a share of a decode
# step to repay compiling a copy of the step per phase (docs/benchmarks.md: the compare workload's
# 94 MB cache sampled 6% faster in four phases; the tests' tiny model's 1 MB no faster, for
# 1.2-2.2 s more compile).
PHASED_DECODE_MIN_TOKENS = 64
PHASED_DECODE_MIN_CACHE_BYTES = 16 * 2**20
_PHASES = 4
_PHASE_MULTIPLE = 8  # phase ends are multiples of this many completion slots


def attention_phases(max_new_tokens: int, cache_bytes: int | None = None) -> list[int]:
    """Ends of the decode loop's phases, in completion slots; the last is `max_new_tokens`.

    A decode step attends to every slot of its completion buffers, written or not; with the
    loop in four phases whose buffers hold only the slots written by the phase's end, a
    rollout reads about 5/8 of the slots one phase would. Each phase compiles its own copy
    of the decode step, so short completions and small completion caches (`cache_bytes`,
    when given), where attention is a small part of a step, decode in one phase.
    """
    small_cache = cache_bytes is not None and cache_bytes < PHASED_DECODE_MIN_CACHE_BYTES
    if max_new_tokens < PHASED_DECODE_MIN_TOKENS or small_cache:
        return [max_new_tokens]
    size = -(-max_new_tokens // _PHASES)
    size = -(-size // _PHASE_MULTIPLE) * _PHASE_MULTIPLE
    return [*range(size, max_new_tokens, size), max_new_tokens]


def kv_cache_bytes(
    rows: int, slots: int, config: ModelConfig, dtype, *, completion: bool = False
) -> int:
    """Bytes of KV cache (`rows` rows of `slots` slots, every layer's keys and values) that
    one device holds; `completion`: completion caches, whose sliding layers keep their
    window's slots only (`completion_cache_bytes`), rather than prompt caches. Under a mesh
    and logical rules (`jgrpo.sharding.rules_context`) the caches split as
    `jgrpo.models.group_decode` places them: rows over the batch axes and kv heads over
    `tensor`, where those axes divide them. Used by the rollout (while tracing) and the
    memory plan."""
    if completion:
        total = rows * completion_cache_bytes(config, slots, dtype)
    else:
        total = rows * slots * cache_bytes_per_slot(config, dtype)
    return total // traced_shard_count((rows, config.num_kv_heads), ("batch", "kv_heads"))


def concurrent_rows(max_concurrent: int, rows: int) -> int | None:
    """The slots a rollout of `rows` sequences decodes in (`SamplingConfig.max_concurrent`):
    None when every row decodes at once (0, or at least `rows`)."""
    return max_concurrent if 0 < max_concurrent < rows else None
