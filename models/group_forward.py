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
`jgrpo.models.group_decode`).

Packed completions (`PackedCompletions`, `jgrpo.packing`) put several short completions of a
group into one row of N slots, so the prompt is followed by Gb <= G packed rows: a token
then attends to its own completion's earlier tokens only, at its padded row's positions, and
`packed_head_inputs` hands the log-prob head only the positions that predict a token.

Rows are prompt-major (row p * G + g answers prompt p). Dimension letters as in
`jgrpo.models.transformer`, plus P prompts, Lp prompt tokens, N completion tokens, G rows per
prompt, Gb packed rows per prompt.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jgrpo.models.attention import (
    grouped_query_attention,
    layer_variants,
    token_major_attention_inputs,
)
from jgrpo.models.config import ModelConfig
from jgrpo.models.embedding import input_embeddings
from jgrpo.models.primitives import norm_scale, rms_norm
from jgrpo.models.transformer import choose, finish_layer, layer_kinds, over_layers


class PackedCompletions(NamedTuple):
    """Where each completion token sits when a group's G rows are packed into Gb <= G rows
    of the same N slots (`jgrpo.packing.pack_completions` builds it).

    Indices are within a group, so a batch's groups (and processes' blocks of groups) pack
    independently: row g's token t is completion token g * N + t of its group, and its
    group's token matrix holds the Lp prompt tokens, then the Gb packed rows' slots.
    """

    source: jax.Array  # int32[P * Gb, N]: completion token g * N + t in each slot; -1 if empty
    predictor: jax.Array  # int32[B, N]: group token (< Lp + Gb * N) that predicts row b's token t


def group_completion_hidden(
    params: dict,
    input_ids: jax.Array,  # int[B, Lp + N]: left-padded prompt, then completion
    attention_mask: jax.Array,  # [B, Lp + N]: 1 on real tokens
    *,
    config: ModelConfig,
    group_size: int,
    completion_length: int,
    packed: PackedCompletions | None = None,
    router_stats: bool = False,
):  # [B, N, E]; with router_stats, (that, RouterStats | None)
    """Final hidden states at the N positions that predict each row's completion tokens
    (and with `router_stats`, a mixture of experts' `RouterStats` summed over its layers,
    each prompt token weighing G as in the plain forward; None for a dense model).

    Equal, up to rounding, to `forward(params, input_ids, attention_mask=attention_mask,
    return_hidden=True)[:, -N - 1 : -1]`, provided every group of `group_size` consecutive
    rows repeats one prompt (ids and mask of the first Lp tokens): only the first row of each
    group is read for the prompt.

    With `packed`, each group's real completion tokens run in its Gb packed rows instead of
    its G padded ones: a token attends to its prompt and to the earlier tokens of its own
    completion only, at the position it has in its row, so the real positions' results are
    equal up to rounding while the layers see P * (Lp + Gb * N) tokens. Positions that hold
    no real completion token get finite values of no meaning (mask them, as the loss does).
    """
    x, stats = _group_layers(
        params, input_ids, attention_mask, config, group_size, completion_length, packed
    )
    rows, n = input_ids.shape[0], completion_length
    prompt_length = input_ids.shape[1] - n
    if packed is None:
        last_prompt = jnp.repeat(x[:, prompt_length - 1 : prompt_length], group_size, axis=0)
        completion_x = x[:, prompt_length:].reshape(rows, n, -1)  # [B, N, E]
        predicting = jnp.concatenate([last_prompt, completion_x[:, :-1]], axis=1)  # [B, N, E]
    else:
        index = packed.predictor.reshape(rows // group_size, group_size * n)  # [P, G * N]
        predicting = jnp.take_along_axis(x, index[:, :, None], axis=1).reshape(rows, n, -1)
    hidden = rms_norm(predicting, norm_scale(config, params["final_norm"]), config.rms_norm_eps)
    return (hidden, stats) if router_stats else hidden


def packed_head_inputs(
    params: dict,
    input_ids: jax.Array,  # int[B, Lp + N]: left-padded prompt, then completion
    attention_mask: jax.Array,  # [B, Lp + N]: 1 on real tokens
    packed: PackedCompletions,
    *,
    config: ModelConfig,
    group_size: int,
    completion_length: int,
    router_stats: bool = False,
) -> tuple:  # f32[M, E], int[M], int[B, N] (then RouterStats | None with router_stats)
    """The packed forward's final hidden states where the unembedding should read them.

    Returns (hidden, targets, index) with M = P * (G + Gb * N), per prompt: its last token G
    times (it predicts each of the group's rows' first completion token), then its packed
    slots (each predicts the token in the slot after it). A log-prob computed from hidden[m]
    and targets[m] belongs to completion position index[b, t]: so the log-prob head runs on
    the packed tokens, not on all B * N padded positions, and a prompt's positions stay
    together (as its rows do when the batch is sharded). Positions that predict no real
    token read a position of no meaning (mask them, as the loss does).
    """
    x, stats = _group_layers(
        params, input_ids, attention_mask, config, group_size, completion_length, packed
    )
    rows, n = input_ids.shape[0], completion_length
    prompt_length, prompts = input_ids.shape[1] - n, rows // group_size
    slots = x.shape[1] - prompt_length  # Gb * N per group
    per_prompt = group_size + slots
    first = jnp.broadcast_to(
        x[:, prompt_length - 1 : prompt_length], (prompts, group_size, x.shape[-1])
    )  # [P, G, E]
    hidden = jnp.concatenate([first, x[:, prompt_length:]], axis=1).reshape(-1, x.shape[-1])
    hidden = rms_norm(hidden, norm_scale(config, params["final_norm"]), config.rms_norm_eps)
    # hidden [M, E]
    completion_ids = input_ids[:, prompt_length:].reshape(prompts, group_size * n)
    slot_ids = jnp.take_along_axis(
        completion_ids, jnp.maximum(packed.source.reshape(prompts, slots), 0), axis=1
    )  # [P, Gb * N]
    # a used slot's next slot holds the next token of its completion
    next_ids = jnp.concatenate([slot_ids[:, 1:], slot_ids[:, :1]], axis=1)
    first_ids = completion_ids[:, ::n]  # [P, G]: each row's first completion token
    targets = jnp.concatenate([first_ids, next_ids], axis=1).reshape(-1)  # [M]
    # predictor < Lp: the prompt's last token (row b's first token, or padding)
    row = jnp.arange(rows, dtype=jnp.int32)[:, None]  # [B, 1]
    start = row // group_size * per_prompt  # [B, 1]: the row's prompt's first position
    in_slots = start + group_size + packed.predictor - prompt_length  # [B, N]
    index = jnp.where(packed.predictor >= prompt_length, in_slots, start + row % group_size)
    return (hidden, targets, index, stats) if router_stats else (hidden, targets, index)


def _group_layers(
    params, input_ids, attention_mask, config, group_size, completion_length, packed
):  # ([P, Lp + U * N, E]: each prompt's tokens, then its U units' slots; RouterStats | None)
    """The layers over each prompt's tokens and its rows' (or packed rows') completion slots,
    and a mixture of experts' router stats summed over the layers (a prompt token weighing
    G, as it runs G times in the plain forward; a padding slot nothing)."""
    rows, total = input_ids.shape
    if group_size < 1 or rows % group_size:
        raise ValueError(f"{rows} rows do not split into groups of group_size={group_size}.")
    n = completion_length
    if not 0 < n < total:
        raise ValueError(f"completion_length={n} must be in [1, {total - 1}] for {total} tokens.")
    prompt_length = total - n
    prompts = rows // group_size
    attention_mask = attention_mask.astype(jnp.int32)
    prompt_mask = attention_mask[::group_size, :prompt_length]  # [P, Lp]
    positions = jnp.maximum(jnp.cumsum(attention_mask, axis=1) - 1, 0)  # [B, Lp + N]
    prompt_positions = positions[::group_size, :prompt_length]  # [P, Lp]
    prompt_ids = input_ids[::group_size, :prompt_length]  # [P, Lp]
    if packed is None:  # unit = a row: G units of N slots per prompt
        units_per_prompt = group_size
        unit_ids = input_ids[:, prompt_length:]  # [B, N]
        unit_positions = positions[:, prompt_length:]  # [B, N]
        unit_key_mask = attention_mask[:, prompt_length:].astype(bool)  # [B, N]
        unit_real = unit_key_mask
        own_mask = jnp.tril(jnp.ones((n, n), bool)) & unit_key_mask[:, None, :]  # [B, N, N]
    else:  # unit = a packed row: Gb units of N slots per prompt
        if packed.source.shape[0] % prompts or packed.source.shape[1] != n:
            raise ValueError(
                f"packed.source has shape {packed.source.shape}; expected [{prompts} x packed "
                f"rows per group, {n}] for {prompts} groups of {n} completion slots."
            )
        units_per_prompt = packed.source.shape[0] // prompts
        source = packed.source.reshape(prompts, units_per_prompt * n)  # [P, Gb * N]
        taken = jnp.maximum(source, 0)
        group_ids = input_ids[:, prompt_length:].reshape(prompts, group_size * n)  # [P, G * N]
        unit_ids = jnp.take_along_axis(group_ids, taken, axis=1).reshape(-1, n)  # [P * Gb, N]
        # token t of a completion sits at its prompt's real length + t, as in its padded row
        unit_positions = (prompt_mask.sum(1)[:, None] + taken % n).reshape(-1, n)
        completion = jnp.where(packed.source >= 0, packed.source // n, -1)  # [P * Gb, N]
        unit_real = packed.source >= 0
        causal = jnp.tril(jnp.ones((n, n), bool))  # slots in order within a completion
        own_mask = causal & (completion[:, :, None] == completion[:, None, :])
        own_mask &= (completion >= 0)[:, None, :]  # [P * Gb, N, N]
    units = prompts * units_per_prompt

    def per_prompt(prompt_part, unit_part):  # [P, Lp, ...], [P * U, N, ...]
        """[P, Lp + U * N, ...]: a prompt's tokens, then its U units' completion slots."""
        slots = unit_part.reshape(prompts, units_per_prompt * n, *unit_part.shape[2:])
        return jnp.concatenate([prompt_part, slots], axis=1)

    token_ids = per_prompt(prompt_ids, unit_ids)  # [P, Lp + U * N]
    # Prompt tokens attend causally within their prompt; completion tokens to their prompt's
    # real tokens and causally to their own completion's real tokens.
    prompt_causal = jnp.tril(jnp.ones((prompt_length, prompt_length), bool))  # [Lp, Lp]
    prompt_attention_mask = prompt_causal & prompt_mask[:, None, :].astype(bool)  # [P, Lp, Lp]
    unit_prompt_mask = jnp.repeat(prompt_mask, units_per_prompt, axis=0).astype(bool)  # [P * U, Lp]
    unit_attention_mask = jnp.concatenate(
        [jnp.broadcast_to(unit_prompt_mask[:, None, :], (units, n, prompt_length)), own_mask],
        axis=2,
    )  # [P * U, N, Lp + N]
    # Sliding layers keep keys fewer than W positions back (packed slots sit at their padded
    # row's positions, so positions, not slots, measure it).
    unit_key_positions = jnp.concatenate(
        [jnp.repeat(prompt_positions, units_per_prompt, axis=0), unit_positions], axis=1
    )  # [P * U, Lp + N]
    prompt_full, prompt_sliding = layer_variants(
        config,
        prompt_attention_mask,
        prompt_positions[:, :, None] - prompt_positions[:, None, :],
        prompt_positions,
    )  # masks [P, Lp, Lp]
    unit_full, unit_sliding = layer_variants(
        config,
        unit_attention_mask,
        unit_positions[:, :, None] - unit_key_positions[:, None, :],
        unit_positions,
    )  # masks [P * U, N, Lp + N]

    def layer_inputs(prompt, unit):  # masks, then cos and sin [P, Lp + U * N, D/2]
        return (
            prompt.mask,
            unit.mask,
            per_prompt(prompt.cos, unit.cos),
            per_prompt(prompt.sin, unit.sin),
        )

    full = layer_inputs(prompt_full, unit_full)
    sliding = full if unit_sliding is unit_full else layer_inputs(prompt_sliding, unit_sliding)

    def by_unit(x):  # [P, U * N, ...] -> [P * U, N, ...]
        return x.reshape(units, n, *x.shape[2:])

    def layer(x, scanned):  # x [P, Lp + U * N, E]
        layer_params, is_sliding = scanned
        prompt_layer_mask, unit_layer_mask, cos, sin = choose(is_sliding, sliding, full)
        q, k, v = token_major_attention_inputs(config, layer_params, x, cos, sin)
        # q [P, Lp + U*N, H, D]; k, v [P, Lp + U*N, K, D]
        prompt_k = k[:, :prompt_length].transpose(0, 2, 1, 3)  # [P, K, Lp, D]
        prompt_v = v[:, :prompt_length].transpose(0, 2, 1, 3)
        scale, softcap = config.attention_scale, config.attn_logit_softcapping
        prompt_attention = grouped_query_attention(
            q[:, :prompt_length], prompt_k, prompt_v, prompt_layer_mask, scale, softcap
        )  # [P, Lp, H, D]
        own_k = by_unit(k[:, prompt_length:]).transpose(0, 2, 1, 3)  # [P * U, K, N, D]
        own_v = by_unit(v[:, prompt_length:]).transpose(0, 2, 1, 3)
        keys = jnp.concatenate([jnp.repeat(prompt_k, units_per_prompt, axis=0), own_k], axis=2)
        values = jnp.concatenate([jnp.repeat(prompt_v, units_per_prompt, axis=0), own_v], axis=2)
        unit_attention = grouped_query_attention(
            by_unit(q[:, prompt_length:]), keys, values, unit_layer_mask, scale, softcap
        )  # [P * U, N, H, D]
        attention = per_prompt(prompt_attention, unit_attention)  # [P, Lp + U*N, H, D]
        return finish_layer(config, layer_params, x, attention, token_weights)

    if config.remat:
        layer = jax.checkpoint(layer, prevent_cse=False)
    x = input_embeddings(params, token_ids, config)  # [P, Lp + U * N, E]
    token_weights = per_prompt(group_size * prompt_mask, unit_real.astype(jnp.int32))
    x, stats = over_layers(layer, x, (params["layers"], layer_kinds(config)), config.num_layers)
    return x, None if stats is None else jax.tree.map(lambda s: s.sum(0), stats)
