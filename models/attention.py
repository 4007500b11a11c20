"""Attention: RoPE tables and rotations, each layer kind's mask and tables (`layer_variants`),
queries, keys and values of a layer, grouped-query attention and its softmax.

Dimension letters in shape comments as in `jgrpo.models.transformer`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo.models.config import LinearRopeScaling, ModelConfig
from jgrpo.models.primitives import norm_scale, rms_norm, soft_cap
from jgrpo.models.projection import normed_projections

_MASKED = float(np.finfo(np.float32).min)  # finite: a fully masked row gives no NaN


def inverse_frequencies(config: ModelConfig, sliding: bool = False) -> np.ndarray:  # f32[D/2]
    """RoPE inverse frequencies theta^(-2i/D), with Llama 3 or linear scaling when configured;
    for a sliding layer with its own base (Gemma 3's `rope_local_theta`), that base unscaled."""
    exponents = np.arange(0, config.head_dim, 2, dtype=np.float32) / config.head_dim
    local = sliding and config.rope_local_theta is not None
    theta = config.rope_local_theta if local else config.rope_theta
    inv_freq = (1.0 / (theta**exponents)).astype(np.float32)
    scaling = None if local else config.rope_scaling
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearRopeScaling):
        return (inv_freq / scaling.factor).astype(np.float32)
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope_tables(
    config: ModelConfig, positions: jax.Array, sliding: bool = False
) -> tuple[jax.Array, jax.Array]:
    """cos and sin f32[..., D/2] of positions [...] * inverse frequencies (a sliding layer's
    when `sliding`)."""
    inv_freq = inverse_frequencies(config, sliding)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates [B, T, N, D] by position; halves layout (HF's rotate_half), computed in f32."""
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)


class LayerVariant(NamedTuple):
    """What a layer's kind decides: its attention mask and its RoPE tables."""

    mask: jax.Array  # bool[..., T, S]
    cos: jax.Array  # f32[..., T, D/2]
    sin: jax.Array


def layer_variants(
    config: ModelConfig, mask: jax.Array, distance: jax.Array, positions: jax.Array
) -> tuple[LayerVariant, LayerVariant]:
    """(full, sliding): the inputs of a full-attention layer and of a sliding-window one.

    `mask` bool[..., T, S] is the causal mask; `distance` [..., T, S] how many positions
    each key lies before its query (the sliding mask keeps distance < W); `positions`
    [..., T] the queries' RoPE positions. A sliding layer of Gemma 3 rotates by its own RoPE
    base (`rope_local_theta`). Without a window both are the full layer's.
    """
    full = LayerVariant(mask, *rope_tables(config, positions))
    if config.sliding_window is None:
        return full, full
    window_mask = mask & (distance < config.sliding_window)
    local = config.rope_local_theta is not None
    tables = rope_tables(config, positions, sliding=True) if local else (full.cos, full.sin)
    return full, LayerVariant(window_mask, *tables)


def attention_inputs(config, params, x, cos, sin):
    """Queries [B, T, H, D] and keys, values [B, K, T, D] of one layer for x [B, T, E]:
    pre-norm, projections, optional biases and qk-norm, RoPE."""
    q, k, v = token_major_attention_inputs(config, params, x, cos, sin)
    return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def token_major_attention_inputs(config, params, x, cos, sin):
    """`attention_inputs` with keys and values left token-major, [B, T, K, D], for callers
    that split the tokens before attention (`jgrpo.models.group_forward`)."""
    eps = config.rms_norm_eps
    kernels = (params["q_kernel"], params["k_kernel"], params["v_kernel"])
    q, k, v = normed_projections(x, norm_scale(config, params["attn_norm"]), kernels, eps)
    # q [B, T, H, D]; k, v [B, T, K, D]
    if config.qkv_bias:
        q, k, v = q + params["q_bias"], k + params["k_bias"], v + params["v_bias"]
    if config.qk_norm:
        q = rms_norm(q, norm_scale(config, params["q_norm"]), eps)
        k = rms_norm(k, norm_scale(config, params["k_norm"]), eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def grouped_query_attention(q, k, v, mask, scale=None, softcap=None):
    """softmax(softcap(q k^T * scale)) v with H = K * G query heads sharing each kv head.

    q [B, T, H, D]; k, v [B, K, S, D]; mask bool[B, T, S]. Scores and softmax in f32; the
    scale defaults to D^-1/2 (`config.attention_scale`), `softcap` (Gemma 2) bounds the
    scores (`soft_cap`). The G query heads of a kv head are laid out as G x T rows of one
    matrix, so scores and output are plain batched matmuls over (B, K) with the key axis
    contiguous.
    """
    batch, length, heads, dim = q.shape
    kv_heads = k.shape[1]
    per_kv = heads // kv_heads
    q = q.reshape(batch, length, kv_heads, per_kv, dim).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, D]
    scores = jnp.einsum("bkgtd,bksd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = soft_cap(scores * (dim**-0.5 if scale is None else scale), softcap)
    scores = jnp.where(mask[:, None, None], scores, _MASKED)  # [B, K, G, T, S]
    probs = softmax(scores)
    out = jnp.einsum("bkgts,bksd->bkgtd", probs.astype(v.dtype), v)  # [B, K, G, T, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, heads, dim)


@jax.custom_jvp
def softmax(x: jax.Array) -> jax.Array:
    """Softmax over the last axis whose derivative needs only its output.

    `jax.nn.softmax` differentiates through its exp and division by default and so keeps
    both the unnormalised exponentials and the probabilities for the backward pass: two
    [B, K, G, T, S] tensors per attention layer where one suffices.
    """
    shifted = x - jax.lax.stop_gradient(x.max(axis=-1, keepdims=True))
    weights = jnp.exp(shifted)
    return weights / weights.sum(axis=-1, keepdims=True)


@softmax.defjvp
def _softmax_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    y = softmax(x)
    return y, y * (x_dot - (y * x_dot).sum(axis=-1, keepdims=True))
