"""The small pieces every part of the decoder shares: sharding constraints by logical axis
names, RMSNorm and the factor its weight stands for, soft-capping.

Dimension letters in shape comments as in `jgrpo.models.transformer`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jgrpo.models.config import ModelConfig


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """Sharding constraint by logical axis names; a no-op outside a mesh with rules."""
    rules = nn.get_logical_axis_rules()
    if not rules or jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, nn.logical_to_mesh_axes(axes, rules))


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (Gemma 2's soft-capping of attention scores and logits); x if None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def norm_scale(config: ModelConfig, weight: jax.Array) -> jax.Array:
    """The factor an RMSNorm weight stands for: the weight, or Gemma's 1 + weight in f32 (as
    transformers computes it, so a bf16 weight keeps its precision)."""
    if not config.norm_weight_offset:
        return weight
    return weight.astype(jnp.float32) + config.norm_weight_offset


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, axis: int = -1) -> jax.Array:
    """x / rms(x) * scale over `axis` (scale broadcast against x), in f32, in x's dtype.

    Recomputed from x in the backward pass: plain autodiff keeps the normalised x and
    more of the same size, beside x and the output that the next product keeps anyway.
    """

    @jax.checkpoint
    def normalise(x, scale):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=axis, keepdims=True) + eps)
        return (normed * scale.astype(jnp.float32)).astype(x.dtype)

    return normalise(x, scale)
