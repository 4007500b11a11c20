"""Group-relative advantages: each completion's reward against its own group.

GRPO replaces a learned critic with the group baseline. For a completion i in group g,

    A_i = (r_i - mean_g) / (std_g + eps)

Group statistics come from segment sums over integer group ids, so groups may be ragged
(any size, any order in the batch) and members can be masked out without a reshape or a
recompile. Pure `jax.numpy`: works under `jax.jit`, `jax.grad` and `jax.vmap`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jgrpo._checks import check_choice, check_shape

SCALES = ("group", "batch", "none")
STD_DDOFS = (0, 1)


class GroupStats(NamedTuple):
    """Per-group statistics over valid members; every field is [num_groups]."""

    count: jax.Array  # int32: valid members in the group
    mean: jax.Array  # f32
    std: jax.Array  # f32, with the requested ddof; 0 for degenerate groups
    degenerate: jax.Array  # bool: no signal, as `zero_signal_groups` decides


def _safe_sqrt(x: jax.Array) -> jax.Array:
    """sqrt with a finite gradient at 0 (the gradient there is taken as 0)."""
    positive = x > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, x, 1.0)), 0.0)


def _masked_std(deviation: jax.Array, count: jax.Array, ddof: int) -> jax.Array:
    """Std from deviations already zeroed for invalid members; count may be per group."""
    denominator = jnp.maximum(count - ddof, 1).astype(jnp.float32)
    return _safe_sqrt(jnp.square(deviation).sum(axis=-1) / denominator)


def group_statistics(
    rewards: jax.Array,  # f32[B]
    group_ids: jax.Array,  # int[B] in [0, num_groups)
    num_groups: int,
    *,
    valid: jax.Array | None = None,  # bool[B]
    std_ddof: int = 0,
) -> GroupStats:
    """Count, mean, std and the no-signal flag of every group, from segment sums.

    Only valid members enter the statistics. A group is `degenerate` when it has fewer than
    two valid members or all its valid rewards are equal (`zero_signal_groups`); its
    advantages are exactly 0.
    """
    rewards, group_ids, valid = _check_inputs(rewards, group_ids, num_groups, valid)
    check_choice("std_ddof", std_ddof, STD_DDOFS)
    return _statistics(rewards, group_ids, num_groups, valid, std_ddof)


def zero_signal_groups(
    rewards: jax.Array,  # f32[B]
    group_ids: jax.Array,  # int[B] in [0, num_groups)
    num_groups: int,
    *,
    valid: jax.Array | None = None,  # bool[B]
) -> jax.Array:  # bool[num_groups]
    """The groups that carry no signal: fewer than two valid members, or all valid rewards equal.

    The one definition of a group without signal: `group_statistics` calls it `degenerate`,
    `group_advantages` gives its members advantage 0 exactly, and the trainer counts these
    groups (`frac_zero_std`) and, with dynamic sampling, replaces them. A group with no valid
    member has no signal. Invalid members are ignored, as in `group_advantages`; ragged
    groups in any order, as there. Equality is tested on the f32 rewards themselves, not on
    a variance that rounding can leave at 1e-16.

    The flag does not depend on `scale`, `std_ddof`, `eps` or `clip`, and for every `scale`
    ("group", "batch", "none") it means the same as "every member's advantage is 0": a group
    without signal gets 0 exactly, and a group with signal has a valid member whose reward
    differs from the group mean, hence a nonzero advantage (NaN where a valid reward is NaN).
    With beta > 0 the KL term still acts on the members of a group without signal.
    """
    rewards, group_ids, valid = _check_inputs(rewards, group_ids, num_groups, valid)
    return _zero_signal(rewards, group_ids, num_groups, valid)


def _zero_signal(rewards, group_ids, num_groups, valid) -> jax.Array:
    segment = dict(segment_ids=group_ids, num_segments=num_groups)
    count = jax.ops.segment_sum(valid.astype(jnp.int32), **segment)
    group_max = jax.ops.segment_max(jnp.where(valid, rewards, -jnp.inf), **segment)
    group_min = jax.ops.segment_min(jnp.where(valid, rewards, jnp.inf), **segment)
    return (count < 2) | (group_max <= group_min)


def _statistics(rewards, group_ids, num_groups, valid, std_ddof) -> GroupStats:
    segment = dict(segment_ids=group_ids, num_segments=num_groups)

    count = jax.ops.segment_sum(valid.astype(jnp.int32), **segment)
    total = jax.ops.segment_sum(jnp.where(valid, rewards, 0.0), **segment)
    mean = total / jnp.maximum(count, 1).astype(jnp.float32)
    deviation = jnp.where(valid, rewards - mean[group_ids], 0.0)
    variance = jax.ops.segment_sum(jnp.square(deviation), **segment) / jnp.maximum(
        count - std_ddof, 1
    ).astype(jnp.float32)
    degenerate = _zero_signal(rewards, group_ids, num_groups, valid)  # advantage 0 exactly
    std = jnp.where(degenerate, 0.0, _safe_sqrt(variance))
    return GroupStats(count=count, mean=mean, std=std, degenerate=degenerate)


def group_advantages(
    rewards: jax.Array,  # f32[B]
    group_ids: jax.Array,  # int[B] in [0, num_groups)
    num_groups: int,
    *,
    valid: jax.Array | None = None,  # bool[B]
    scale: str = "group",
    std_ddof: int = 0,
    eps: float = 1e-4,
    clip: float | None = None,
) -> jax.Array:  # f32[B]
    """Advantage of every completion relative to its group.

        scale="group": A_i = (r_i - mean_g) / (std_g + eps)
        scale="batch": A_i = (r_i - mean_g) / (std_batch + eps)   (std over all valid rewards)
        scale="none":  A_i =  r_i - mean_g                         (Dr. GRPO)

    Args:
      rewards: one scalar reward per completion.
      group_ids: the prompt (group) each completion belongs to; ragged groups in any order.
      num_groups: static upper bound on the group ids (a Python int).
      valid: False for members to ignore (padding rows, completions no reward could score):
        they enter no statistic and get advantage 0, whatever their reward (NaN included:
        it reaches no other row's value or gradient).
      scale: how the centred reward is scaled, see above.
      std_ddof: 0 for the population std (the default), 1 for the sample std (TRL, verl).
      eps: added to the std before dividing.
      clip: if set, advantages are clipped to [-clip, clip].

    Groups with fewer than two valid members or all-equal rewards get advantage 0 exactly.
    Worked example: rewards [2, 4, 6, 8] in one group -> [-1.34, -0.45, 0.45, 1.34].
    """
    check_choice("scale", scale, SCALES)
    check_choice("std_ddof", std_ddof, STD_DDOFS)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}.")
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be None or > 0, got {clip}.")
    rewards, group_ids, valid = _check_inputs(rewards, group_ids, num_groups, valid)
    stats = _statistics(rewards, group_ids, num_groups, valid, std_ddof)

    centred = rewards - stats.mean[group_ids]  # [B]
    if scale == "group":
        advantages = centred / (stats.std[group_ids] + eps)
    elif scale == "batch":
        batch_deviation = jnp.where(valid, rewards - _masked_mean(rewards, valid), 0.0)
        batch_std = _masked_std(batch_deviation, valid.sum(), std_ddof)
        advantages = centred / (batch_std + eps)
    else:
        advantages = centred
    if clip is not None:
        advantages = jnp.clip(advantages, -clip, clip)
    no_signal = stats.degenerate[group_ids] | ~valid
    return jnp.where(no_signal, 0.0, advantages)


def _masked_mean(values: jax.Array, valid: jax.Array) -> jax.Array:
    return jnp.where(valid, values, 0.0).sum() / jnp.maximum(valid.sum(), 1)


def _check_inputs(rewards, group_ids, num_groups, valid):
    """Validates shapes and static arguments; returns f32 rewards (0 where not valid), int
    ids, bool valid. Zeroing first keeps a NaN or inf in an invalid row out of every valid
    row's gradient (a zero cotangent times a NaN value is still NaN)."""
    if not isinstance(num_groups, int) or isinstance(num_groups, bool) or num_groups < 1:
        raise ValueError(
            f"num_groups must be a static Python int >= 1 (the number of prompts), "
            f"got {num_groups!r}."
        )
    rewards = jnp.asarray(rewards, jnp.float32)
    group_ids = jnp.asarray(group_ids)
    check_shape("rewards", rewards, ndim=1)
    check_shape("group_ids", group_ids, like=("rewards", rewards))
    if not jnp.issubdtype(group_ids.dtype, jnp.integer):
        raise ValueError(f"group_ids must be integers, got dtype {group_ids.dtype}.")
    if valid is None:
        valid = jnp.ones(rewards.shape, bool)
    else:
        valid = jnp.asarray(valid).astype(bool)
        check_shape("valid", valid, like=("rewards", rewards))
    _check_group_id_range(group_ids, num_groups)
    return jnp.where(valid, rewards, 0.0), group_ids, valid


def _check_group_id_range(group_ids: jax.Array, num_groups: int) -> None:
    """Out-of-range ids would be dropped silently by the segment ops: refuse them.

    Only possible when the ids are concrete (outside `jit`); under `jit` it is the caller's
    contract, as documented.
    """
    if isinstance(group_ids, jax.core.Tracer) or group_ids.size == 0:
        return
    low, high = int(group_ids.min()), int(group_ids.max())
    if low < 0 or high >= num_groups:
        raise ValueError(
            f"group_ids must lie in [0, num_groups={num_groups}), got values in "
            f"[{low}, {high}]: raise num_groups or renumber the groups."
        )
