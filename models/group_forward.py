"""The training forward of G rows per prompt: each prompt's tokens once, the completions on top.

In a GRPO batch the G completions of a prompt sit in G consecutive rows behind copies of the
same left-padded prompt, so a plain forward over [B, Lp + N] tokens computes every prompt's
hidden states G times, identically. Here the layers run on the P prompts ([P, Lp] tokens) and
on the B = P * G completions ([B, N] tokens): each completion token attends to its prompt's keys
and values (shared by its group) and causally to its own row's, with one softmax over both.
The result equals the plain forward's up to float rounding, and gradients flow into the shared
prompt states from all G rows. With a bucketed prompt as long as the completion, the layers see
about half the tokens (P * Lp + B * N instead of B * (Lp + N)).

Rows are prompt-major (row p * G + g answers prompt p). Dimension letters as in
`models.transformer`, plus P prompts, Lp prompt tokens, N completion tokens, G rows per prompt.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.transformer import (
    _MASKED,
    attention_inputs,
    embed_tokens,
    finish_layer,
    grouped_query_attention,
    rms_norm,
    rope_tables,
)


def group_completion_hidden(
    params: dict,
    input_ids: jax.Array,  # int[B, Lp + N]: left-padded prompt, then completion
    attention_mask: jax.Array,  # [B, Lp + N]: 1 on real tokens
    *,
    config: ModelConfig,
    group_size: int,
    completion_length: int,
) -> jax.Array:  # [B, N, E]
    """Final hidden states at the N positions that predict each row's completion tokens.

    Equal, up to rounding, to `forward(params, input_ids, attention_mask=attention_mask,
    return_hidden=True)[:, -N - 1 : -1]`, provided every group of `group_size` consecutive
    rows repeats one prompt (ids and mask of the first Lp tokens): only the first row of each
    group is read for the prompt.
    """
    rows, total = input_ids.shape
    if group_size < 1 or rows % group_size:
        raise ValueError(f"{rows} rows do not split into groups of group_size={group_size}.")
    n = completion_length
    if not 0 < n < total:
        raise ValueError(f"completion_length={n} must be in [1, {total - 1}] for {total} tokens.")
    prompt_length = total - n
    attention_mask = attention_mask.astype(jnp.int32)
    positions = jnp.maximum(jnp.cumsum(attention_mask, axis=1) - 1, 0)  # [B, Lp + N]

    prompt_ids = input_ids[::group_size, :prompt_length]  # [P, Lp]
    prompt_mask = attention_mask[::group_size, :prompt_length]  # [P, Lp]
    completion_key_mask = attention_mask[:, prompt_length:]  # [B, N]
    prompt_cos, prompt_sin = rope_tables(config, positions[::group_size, :prompt_length])
    completion_cos, completion_sin = rope_tables(config, positions[:, prompt_length:])
    causal = jnp.tril(jnp.ones((prompt_length, prompt_length), bool))  # [Lp, Lp]
    prompt_attention_mask = causal[None] & prompt_mask[:, None, :].astype(bool)  # [P, Lp, Lp]

    def layer(carry, layer_params):
        prompt_x, completion_x = carry  # [P, Lp, E], [B, N, E]
        q, k, v = attention_inputs(config, layer_params, prompt_x, prompt_cos, prompt_sin)
        attention = grouped_query_attention(q, k, v, prompt_attention_mask)
        new_prompt_x = finish_layer(config, layer_params, prompt_x, attention)
        cq, ck, cv = attention_inputs(
            config, layer_params, completion_x, completion_cos, completion_sin
        )
        attention = prompt_shared_attention(cq, k, v, ck, cv, prompt_mask, completion_key_mask)
        new_completion_x = finish_layer(config, layer_params, completion_x, attention)
        return (new_prompt_x, new_completion_x), None

    if config.remat:
        layer = jax.checkpoint(layer, prevent_cse=False)
    start = (
        embed_tokens(params["embed"], prompt_ids),
        embed_tokens(params["embed"], input_ids[:, prompt_length:]),
    )
    (prompt_x, completion_x), _ = jax.lax.scan(layer, start, params["layers"])
    last_prompt = jnp.repeat(prompt_x[:, -1:], group_size, axis=0)  # [B, 1, E]
    predicting = jnp.concatenate([last_prompt, completion_x[:, :-1]], axis=1)  # [B, N, E]
    return rms_norm(predicting, params["final_norm"], config.rms_norm_eps)


def prompt_shared_attention(
    q: jax.Array,  # [B, N, H, D]: the completion tokens' queries
    prompt_k: jax.Array,  # [P, K, Lp, D]
    prompt_v: jax.Array,  # [P, K, Lp, D]
    completion_k: jax.Array,  # [B, K, N, D]
    completion_v: jax.Array,  # [B, K, N, D]
    prompt_mask: jax.Array,  # [P, Lp]: 1 on real prompt tokens
    completion_mask: jax.Array,  # [B, N]: 1 on real completion tokens
) -> jax.Array:  # [B, N, H, D]
    """Completion tokens attending to their prompt's keys and causally to their own row's.

    The numerics of `models.transformer.grouped_query_attention` (scores and softmax in f32,
    one softmax over prompt and completion keys); the G rows of a prompt read its keys as
    one [G * G' * N, D] x [D, Lp] product per prompt and kv head, never copied G times.
    """
    rows, length, heads, dim = q.shape
    prompts, kv_heads, prompt_length, _ = prompt_k.shape
    group, per_kv = rows // prompts, heads // kv_heads
    q = q.reshape(prompts, group, length, kv_heads, per_kv, dim).transpose(0, 3, 1, 4, 2, 5)

    def by_prompt(x):  # [B, K, N, D] -> [P, K, G, N, D]
        return x.reshape(prompts, group, kv_heads, length, dim).transpose(0, 2, 1, 3, 4)

    completion_k, completion_v = by_prompt(completion_k), by_prompt(completion_v)
    # q is [P, K, G, G', N, D]: batch (p, k) against the prompt, (p, k, g) against the row.
    prompt_scores = jnp.einsum(
        "pkgqnd,pkld->pkgqnl", q, prompt_k, preferred_element_type=jnp.float32
    )
    completion_scores = jnp.einsum(
        "pkgqnd,pkgmd->pkgqnm", q, completion_k, preferred_element_type=jnp.float32
    )
    scores = jnp.concatenate([prompt_scores, completion_scores], axis=-1) * (dim**-0.5)
    causal = jnp.tril(jnp.ones((length, length), bool))  # [N (query), N (key)]
    own = completion_mask.astype(bool).reshape(prompts, 1, group, 1, 1, length) & causal
    prompt_keys = jnp.broadcast_to(
        prompt_mask.astype(bool)[:, None, None, None, None, :],
        (prompts, 1, group, 1, length, prompt_length),
    )
    mask = jnp.concatenate([prompt_keys, own], axis=-1)  # [P, 1, G, 1, N, Lp + N]
    probs = jax.nn.softmax(jnp.where(mask, scores, _MASKED), axis=-1).astype(prompt_v.dtype)
    out = jnp.einsum("pkgqnl,pkld->pkgqnd", probs[..., :prompt_length], prompt_v) + jnp.einsum(
        "pkgqnm,pkgmd->pkgqnd", probs[..., prompt_length:], completion_v
    )
    return out.transpose(0, 2, 4, 1, 3, 5).reshape(rows, length, heads, dim)
