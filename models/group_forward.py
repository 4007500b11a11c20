"""The training forward of G rows per prompt: each prompt's tokens once, the completions on top.

In a GRPO batch the G completions of a prompt sit in G consecutive rows behind copies of the
same left-padded prompt, so a plain forward over [B, Lp + N] tokens computes every prompt's
hidden states G times, identically. Here the layers run on the P prompts ([P, Lp] tokens) and
on the B = P * G completions ([B, N] tokens); in each layer a completion token attends to its
prompt's keys and values and causally to its own row's, one softmax over both. The result
equals the plain forward's up to float rounding, and gradients reach the shared prompt states
from all G rows. With a bucketed prompt as long as the completion, the layers see about half
the tokens (P * Lp + B * N instead of B * (Lp + N)).

The prompt's keys and values are repeated for its G rows before attention ([B, K, Lp, D] per
layer): in training, attention is a small share of the work next to the projections, and the
copy lets the completions reuse `grouped_query_attention` (decoding, which is bound by memory
traffic, reads one shared copy instead: `models.group_decode`).

Rows are prompt-major (row p * G + g answers prompt p). Dimension letters as in
`models.transformer`, plus P prompts, Lp prompt tokens, N completion tokens, G rows per prompt.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.transformer import (
    attention_inputs,
    embed_tokens,
    finish_layer,
    grouped_query_attention,
    over_layers,
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
    # Prompt tokens attend causally within their prompt; completion tokens to their prompt's
    # real tokens and causally to their own row's real tokens.
    prompt_causal = jnp.tril(jnp.ones((prompt_length, prompt_length), bool))  # [Lp, Lp]
    prompt_attention_mask = prompt_causal & prompt_mask[:, None, :].astype(bool)  # [P, Lp, Lp]
    row_prompt_mask = jnp.repeat(prompt_mask, group_size, axis=0).astype(bool)  # [B, Lp]
    completion_causal = jnp.tril(jnp.ones((n, n), bool))  # [N, N]
    completion_attention_mask = jnp.concatenate(
        [
            jnp.broadcast_to(row_prompt_mask[:, None, :], (rows, n, prompt_length)),
            completion_causal & completion_key_mask[:, None, :].astype(bool),
        ],
        axis=2,
    )  # [B, N, Lp + N]

    def layer(carry, layer_params):
        prompt_x, completion_x = carry  # [P, Lp, E], [B, N, E]
        q, k, v = attention_inputs(config, layer_params, prompt_x, prompt_cos, prompt_sin)
        attention = grouped_query_attention(q, k, v, prompt_attention_mask)  # [P, Lp, H, D]
        new_prompt_x = finish_layer(config, layer_params, prompt_x, attention)

        cq, ck, cv = attention_inputs(
            config, layer_params, completion_x, completion_cos, completion_sin
        )  # ck, cv [B, K, N, D]
        keys = jnp.concatenate([jnp.repeat(k, group_size, axis=0), ck], axis=2)  # [B, K, Lp+N, D]
        values = jnp.concatenate([jnp.repeat(v, group_size, axis=0), cv], axis=2)
        attention = grouped_query_attention(cq, keys, values, completion_attention_mask)
        new_completion_x = finish_layer(config, layer_params, completion_x, attention)
        return (new_prompt_x, new_completion_x), None

    if config.remat:
        layer = jax.checkpoint(layer, prevent_cse=False)
    start = (
        embed_tokens(params["embed"], prompt_ids),
        embed_tokens(params["embed"], input_ids[:, prompt_length:]),
    )
    (prompt_x, completion_x), _ = over_layers(layer, start, params["layers"], config.num_layers)
    last_prompt = jnp.repeat(prompt_x[:, -1:], group_size, axis=0)  # [B, 1, E]
    predicting = jnp.concatenate([last_prompt, completion_x[:, :-1]], axis=1)  # [B, N, E]
    return rms_norm(predicting, params["final_norm"], config.rms_norm_eps)
