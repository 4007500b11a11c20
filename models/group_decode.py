"""Decoding G rows per prompt against one shared copy of each prompt's KV cache.

A group rollout's G rows continue the same prompt. The prompt's keys and values are computed
once per prompt ([P, K, Lp, D] per layer) and never copied G times: each row's query attends
to its prompt's cache and to its own completion cache ([P*G, K, N, D] per layer), with one
softmax over both. Prefill time and memory therefore do not grow with G, and a decode step
reads each prompt's cache once for its whole group.

The decode step unrolls the layers over one cache buffer per layer, so each layer writes its
slot in place. (Scanning the layers over a stacked [L, ...] cache in the scan carry made XLA on
CPU copy the whole cache for each layer: 5x slower per step at 125M parameters.)

Rows are prompt-major (row p * G + g answers prompt p). Dimension letters as in
`models.transformer`, plus P prompts, Lp prompt slots, N completion slots.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.transformer import (
    _MASKED,
    attention_inputs,
    constrain,
    embed_tokens,
    finish_layer,
    forward,
    rms_norm,
    rope_tables,
)

_CACHE_AXES = ("batch", "kv_heads", "length", "head_dim")


class GroupCache(NamedTuple):
    """Per-layer tuples: each prompt's keys/values once, each row's completion keys/values."""

    prompt_k: tuple[jax.Array, ...]  # L x [P, K, Lp, D]
    prompt_v: tuple[jax.Array, ...]  # L x [P, K, Lp, D]
    completion_k: tuple[jax.Array, ...]  # L x [P*G, K, N, D]
    completion_v: tuple[jax.Array, ...]  # L x [P*G, K, N, D]


def unstack_layers(params: dict, num_layers: int) -> list[dict]:
    """The stacked layer parameters [L, ...] as one dict per layer (for an unrolled step)."""
    return [jax.tree.map(lambda a, i=i: a[i], params["layers"]) for i in range(num_layers)]


def prefill(
    params: dict,
    prompt_ids: jax.Array,  # int32[P, Lp], left-padded
    prompt_mask: jax.Array,  # [P, Lp], 1 on real tokens
    *,
    config: ModelConfig,
    num_generations: int,
    max_new_tokens: int,
) -> tuple[jax.Array, GroupCache]:
    """Runs the P prompts once; returns their last hidden states [P, E] and a `GroupCache`
    with the prompts' keys/values and empty completion buffers for P * G rows."""
    hidden, (k, v) = forward(
        params,
        prompt_ids,
        attention_mask=prompt_mask,
        config=config,
        return_hidden=True,
        return_kv=True,
    )  # k, v [L, P, K, Lp, D]
    dtype = params["embed"].dtype
    prompts = prompt_ids.shape[0]
    shape = (prompts * num_generations, config.num_kv_heads, max_new_tokens, config.head_dim)
    layers = range(config.num_layers)
    cache = GroupCache(
        prompt_k=tuple(constrain(k[i].astype(dtype), _CACHE_AXES) for i in layers),
        prompt_v=tuple(constrain(v[i].astype(dtype), _CACHE_AXES) for i in layers),
        completion_k=tuple(constrain(jnp.zeros(shape, dtype), _CACHE_AXES) for _ in layers),
        completion_v=tuple(constrain(jnp.zeros(shape, dtype), _CACHE_AXES) for _ in layers),
    )
    return hidden[:, -1], cache


def decode_step(
    params: dict,
    layers: list[dict],  # unstack_layers(params, L)
    cache: GroupCache,
    tokens: jax.Array,  # int32[P*G], one new token per row
    positions: jax.Array,  # int32[P*G], their RoPE positions
    slot: jax.Array,  # int32 scalar: the completion slot the tokens are written to
    prompt_mask: jax.Array,  # [P, Lp]
    *,
    config: ModelConfig,
) -> tuple[jax.Array, GroupCache]:
    """Feeds one token per row; returns the final hidden states [P*G, E] and the cache with
    completion slot `slot` written. Rows attend to their prompt and completion slots <= slot."""
    completion_mask = jnp.arange(cache.completion_k[0].shape[2]) <= slot  # [N]
    cos, sin = rope_tables(config, positions[:, None])  # [B, 1, D/2]
    x = embed_tokens(params["embed"], tokens[:, None])  # [B, 1, E]
    new_k, new_v = [], []
    for i, layer_params in enumerate(layers):
        q, k, v = attention_inputs(config, layer_params, x, cos, sin)  # k, v [B, K, 1, D]
        completion_k = jax.lax.dynamic_update_slice(
            cache.completion_k[i], k.astype(cache.completion_k[i].dtype), (0, 0, slot, 0)
        )
        completion_v = jax.lax.dynamic_update_slice(
            cache.completion_v[i], v.astype(cache.completion_v[i].dtype), (0, 0, slot, 0)
        )
        attention = shared_prefix_attention(
            q,
            cache.prompt_k[i],
            cache.prompt_v[i],
            completion_k,
            completion_v,
            prompt_mask,
            completion_mask,
        )
        x = finish_layer(config, layer_params, x, attention)
        new_k.append(completion_k)
        new_v.append(completion_v)
    hidden = rms_norm(x[:, 0], params["final_norm"], config.rms_norm_eps)  # [B, E]
    return hidden, cache._replace(completion_k=tuple(new_k), completion_v=tuple(new_v))


def shared_prefix_attention(
    q: jax.Array,  # [P*G, 1, H, D]
    prompt_k: jax.Array,  # [P, K, Lp, D]
    prompt_v: jax.Array,  # [P, K, Lp, D]
    completion_k: jax.Array,  # [P*G, K, N, D]
    completion_v: jax.Array,  # [P*G, K, N, D]
    prompt_mask: jax.Array,  # [P, Lp]
    completion_mask: jax.Array,  # bool[N], the same for every row
) -> jax.Array:  # [P*G, 1, H, D]
    """One query token per row attending to its prompt's slots and its own completion slots:
    softmax over the concatenation of both, computed without building it. Scores in f32."""
    rows, _, heads, dim = q.shape
    prompts, kv_heads, prompt_slots, _ = prompt_k.shape
    groups, per_kv = rows // prompts, heads // kv_heads
    scale = dim**-0.5
    q = q.reshape(rows, kv_heads, per_kv, dim).astype(jnp.float32)  # [B, K, G', D]

    # The G rows of a prompt share its keys: one [G*G', D] x [D, Lp] product per prompt and head.
    q_by_prompt = q.reshape(prompts, groups, kv_heads, per_kv, dim)
    prompt_scores = (
        jnp.einsum("pgkhd,pkld->pgkhl", q_by_prompt, prompt_k, preferred_element_type=jnp.float32)
        * scale
    )  # [P, G, K, G', Lp]
    prompt_scores = jnp.where(prompt_mask[:, None, None, None, :] > 0, prompt_scores, _MASKED)
    prompt_scores = prompt_scores.reshape(rows, kv_heads, per_kv, prompt_slots)
    # Each row's own keys: a multiply-reduce, which XLA fuses (a batched dot of one query row
    # per (row, kv head) is slower on CPU).
    completion_scores = (
        jnp.sum(q[:, :, :, None, :] * completion_k[:, :, None].astype(jnp.float32), axis=-1) * scale
    )  # [B, K, G', N]
    completion_scores = jnp.where(completion_mask, completion_scores, _MASKED)

    top = jnp.maximum(
        prompt_scores.max(-1, keepdims=True), completion_scores.max(-1, keepdims=True)
    )  # [B, K, G', 1]
    prompt_weights = jnp.exp(prompt_scores - top)
    completion_weights = jnp.exp(completion_scores - top)
    total = prompt_weights.sum(-1, keepdims=True) + completion_weights.sum(-1, keepdims=True)

    from_prompt = jnp.einsum(
        "pgkhl,pkld->pgkhd",
        prompt_weights.reshape(prompts, groups, kv_heads, per_kv, prompt_slots),
        prompt_v.astype(jnp.float32),
    ).reshape(rows, kv_heads, per_kv, dim)
    from_completion = jnp.sum(
        completion_weights[..., None] * completion_v[:, :, None].astype(jnp.float32), axis=-2
    )  # [B, K, G', D]
    out = (from_prompt + from_completion) / total
    return out.reshape(rows, 1, heads, dim).astype(prompt_v.dtype)
