"""The training forward of G rows per prompt: each prompt's tokens once, the completions on top.

In a GRPO batch the G completions of a prompt sit in G consecutive rows behind copies of the
same left-padded prompt, so a plain forward over [B, Lp + N] tokens computes every prompt's
hidden states G times, identically. Here each prompt is one sequence of its Lp prompt tokens
followed by its G rows' N completion tokens, [P, Lp + G * N]: the layers' projections and MLP
run on all of those tokens as one matrix, and only attention splits them again. A prompt
token attends causally within its prompt; a completion token attends to its prompt's keys and
values and causally to its own row's, one softmax over both. The result equals the plain
forward's up to float rounding, and gradients reach the shared prompt states from all G rows.
With a bucketed prompt as long as the completion, the layers see about half the tokens
(P * Lp + B * N instead of B * (Lp + N)).

One token matrix rather than a prompt set and a completion set halves the number of
operations outside attention: the tiny test model's update ran 5-9% faster, the
SmolLM2-135M workload's no slower (docs/benchmarks.md). The prompt's keys and values are
repeated for its G rows before attention ([B, K, Lp, D] per layer): in training, attention
is a small share of the work next to the projections, and the copy lets the completions
reuse `grouped_query_attention` (decoding reads one shared copy instead:
`models.group_decode`).

Rows are prompt-major (row p * G + g answers prompt p). Dimension letters as in
`models.transformer`, plus P prompts, Lp prompt tokens, N completion tokens, G rows per prompt.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.transformer import (
    embed_tokens,
    finish_layer,
    grouped_query_attention,
    over_layers,
    rms_norm,
    rope_tables,
    token_major_attention_inputs,
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
    prompts = rows // group_size
    attention_mask = attention_mask.astype(jnp.int32)
    positions = jnp.maximum(jnp.cumsum(attention_mask, axis=1) - 1, 0)  # [B, Lp + N]

    def per_prompt(prompt_part, completion_part):  # [P, Lp, ...], [B, N, ...]
        """[P, Lp + G * N, ...]: a prompt's tokens, then its G rows' completion tokens."""
        completions = completion_part.reshape(prompts, group_size * n, *completion_part.shape[2:])
        return jnp.concatenate([prompt_part, completions], axis=1)

    def merged(x):  # [B, Lp + N, ...] -> [P, Lp + G * N, ...]
        """Each prompt's tokens, read from its group's first row, then its rows' completions."""
        return per_prompt(x[::group_size, :prompt_length], x[:, prompt_length:])

    token_ids = merged(input_ids)
    cos, sin = rope_tables(config, merged(positions))  # [P, Lp + G * N, D/2] each
    prompt_mask = attention_mask[::group_size, :prompt_length]  # [P, Lp]
    completion_key_mask = attention_mask[:, prompt_length:]  # [B, N]
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

    def by_row(x):  # [P, G * N, ...] -> [B, N, ...]
        return x.reshape(rows, n, *x.shape[2:])

    def layer(x, layer_params):  # x [P, Lp + G * N, E]
        q, k, v = token_major_attention_inputs(config, layer_params, x, cos, sin)
        # q [P, Lp + G*N, H, D]; k, v [P, Lp + G*N, K, D]
        prompt_k = k[:, :prompt_length].transpose(0, 2, 1, 3)  # [P, K, Lp, D]
        prompt_v = v[:, :prompt_length].transpose(0, 2, 1, 3)
        prompt_attention = grouped_query_attention(
            q[:, :prompt_length], prompt_k, prompt_v, prompt_attention_mask
        )  # [P, Lp, H, D]
        own_k = by_row(k[:, prompt_length:]).transpose(0, 2, 1, 3)  # [B, K, N, D]
        own_v = by_row(v[:, prompt_length:]).transpose(0, 2, 1, 3)
        keys = jnp.concatenate([jnp.repeat(prompt_k, group_size, axis=0), own_k], axis=2)
        values = jnp.concatenate([jnp.repeat(prompt_v, group_size, axis=0), own_v], axis=2)
        completion_attention = grouped_query_attention(
            by_row(q[:, prompt_length:]), keys, values, completion_attention_mask
        )  # [B, N, H, D]
        attention = per_prompt(prompt_attention, completion_attention)  # [P, Lp + G*N, H, D]
        return finish_layer(config, layer_params, x, attention), None

    if config.remat:
        layer = jax.checkpoint(layer, prevent_cse=False)
    x = embed_tokens(params["embed"], token_ids)  # [P, Lp + G * N, E]
    x, _ = over_layers(layer, x, params["layers"], config.num_layers)
    last_prompt = jnp.repeat(x[:, prompt_length - 1 : prompt_length], group_size, axis=0)
    completion_x = by_row(x[:, prompt_length:])  # [B, N, E]
    predicting = jnp.concatenate([last_prompt, completion_x[:, :-1]], axis=1)  # [B, N, E]
    return rms_norm(predicting, params["final_norm"], config.rms_norm_eps)
