"""Single-turn rollouts as one compiled program: `prepare`, then the decode loop of one of two
drivers over `jgrpo.rollout.engine.step` (every row at once in phases, or refilled slots), then
the `Rollout` of the records.

Shapes: P prompts, G generations per prompt, L (bucketed) prompt length, N new tokens.
Rows are ordered prompt-major: row p * G + g.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jgrpo.models.config import ModelConfig
from jgrpo.models.group_decode import grow_completion_cache
from jgrpo.rollout import memory
from jgrpo.rollout.engine import DecodeLayout, DecodeState, prepare, step
from jgrpo.rollout.sampler import SamplingConfig


class Rollout(NamedTuple):
    """G completions of each of P prompts; every array has P * G rows, prompt-major."""

    tokens: jax.Array  # int32[P*G, N]; pad_token_id after the stop
    mask: jax.Array  # bool[P*G, N]; completion tokens, up to and including the first stop
    logprobs: jax.Array  # f32[P*G, N]; the policy's log_softmax(logits / T), 0 where masked
    sampler_logprobs: jax.Array  # f32[P*G, N]; the same over the kept tokens, 0 where masked
    lengths: jax.Array  # int32[P*G]; mask.sum(-1)
    truncated: jax.Array  # bool[P*G]; reached max_new_tokens without a stop token
    group_ids: jax.Array  # int32[P*G]; the prompt each row answers
    # int32[P*G]: the decode step after which the row's last token was drawn (0: its first,
    # from the prefill); the rollout ran max(finished_at) decode steps (`slot_efficiency`)
    finished_at: jax.Array


@functools.partial(jax.jit, static_argnames=("model_config", "num_generations", "sampling"))
def rollout(
    params: dict,
    prompt_ids: jax.Array,  # int32[P, L], left-padded
    prompt_mask: jax.Array,  # [P, L], 1 on real prompt tokens
    key: jax.Array,
    *,
    model_config: ModelConfig,
    num_generations: int,
    sampling: SamplingConfig,
    stop_after: jax.Array | None = None,  # int32[P*G]; benchmarks only
) -> Rollout:
    """G completions for each prompt, sampled by the model with parameters `params`.

    Args:
      params: the model's parameters, e.g. `jgrpo.models.Transformer.params()`.
      key: a PRNG key; draw a fresh one for every rollout.
      stop_after: for benchmarks of ragged lengths only, never for training: row r's token
        stop_after[r] - 1 becomes the first stop token (its log-probs stay the drawn
        token's), so the rows stop at lengths the benchmark chose.
      model_config: static, like num_generations and sampling: a new value compiles anew.

    Returns a `Rollout` of P * G rows, prompt-major (row p * G + g). Its `sampler_logprobs`
    are `logprobs` unless top-k / top-p / min-p is on; only then does the loop keep a second
    [P*G, N] record (`jgrpo.rollout.sample_tokens`).

    Each prompt is prefilled once (cost independent of G) and its KV cache is shared by its G
    rows, never copied; only its last logits are repeated G times. The decode loop runs on
    device until every row has emitted a stop token or N tokens. From N = 64 (and 16 MiB of
    completion caches on a device, `kv_cache_bytes`) it runs in four phases whose
    completion buffers grow (`attention_phases`), so that attention reads about 5/8 of the
    cache slots it would read in one phase.

    With `sampling.max_concurrent` = S below P * G, the rows decode in S slots instead
    (`decode_in_slots`): each slot holds one row's whole completion cache, and when its row
    stops the next row waiting takes the slot, on device, without a host round trip. The
    completion caches then take S / (P * G) of their memory, and a decode step costs S rows
    however ragged the lengths; a row's tokens are those the all-rows loop draws (the same
    uniforms). At one S a row's tokens and log-probs are bit-for-bit the same in any slot;
    across slot counts its log-probs equal the all-rows loop's to float rounding (XLA picks
    kernels by batch shape), and a draw within that rounding of a token boundary could
    differ. Slots read their prompt's cache from the shared prompt table by index, so the
    prompts are still prefilled and stored once per group; there are no phases.

    With `sampling.weights_dtype="bfloat16"` the weight matrices are cast to bf16 and every
    product accumulates in f32: decoding reads half the bytes, and tokens and their log-probs
    come from the policy with its matrices rounded to bf16, as under
    `jgrpo.models.precision.with_matmul_weights` (the update scores them with the f32
    parameters). The cast is fused into the passes that read the f32 weights anyway: the
    decode layout (`decode_layers`, once per rollout) and the prefill's layer loop
    (`forward(..., matmul_dtype=...)`, a layer at a time); a cast stacked copy cost XLA:CPU
    two more passes over the weights (2-4% of a bf16 rollout of the compare workload).
    """
    prompts = prompt_ids.shape[0]
    rows, steps = prompts * num_generations, sampling.max_new_tokens
    slots = memory.concurrent_rows(sampling.max_concurrent, rows)  # None: every row at once
    # one device's completion caches decide; slots hold whole completions from the start
    cache_bytes = memory.kv_cache_bytes(
        rows, steps, model_config, params["embed"].dtype, completion=True
    )
    phases = memory.attention_phases(steps, cache_bytes) if slots is None else [steps]
    layout, state = prepare(
        params,
        prompt_ids,
        prompt_mask,
        key,
        config=model_config,
        num_generations=num_generations,
        sampling=sampling,
        total_tokens=steps,
        slots=slots,
        first_buffer=phases[0],  # completion slots of the first phase
        stop_after=stop_after,
    )
    statics = dict(config=model_config, num_generations=num_generations, sampling=sampling)
    if slots is None:
        state = decode_all_rows(
            params, layout, state, prompt_mask, phases=phases, stop_after=stop_after, **statics
        )
    else:
        state = decode_in_slots(
            params, layout, state, prompt_mask, stop_after=stop_after, **statics
        )
    return Rollout(
        tokens=state.tokens,
        mask=jnp.arange(steps)[None, :] < state.written[:, None],
        logprobs=state.logprobs,
        sampler_logprobs=state.logprobs
        if state.sampler_logprobs is None
        else state.sampler_logprobs,
        lengths=state.written,
        truncated=~state.stopped,
        group_ids=jnp.repeat(jnp.arange(prompts, dtype=jnp.int32), num_generations),
        finished_at=state.finished_at,
    )


def decode_all_rows(
    params: dict,
    layout: DecodeLayout,
    state: DecodeState,
    prompt_mask: jax.Array,
    *,
    phases: list[int],
    config: ModelConfig,
    num_generations: int,
    sampling: SamplingConfig,
    stop_after: jax.Array | None = None,
) -> DecodeState:
    """Decodes every row in lockstep until each has stopped or filled its record, in one loop
    per phase: the loop whose completion buffers hold `end` columns feeds the columns before
    `end` (`memory.attention_phases`), and the buffers grow between loops."""
    body = functools.partial(
        step,
        params,
        layout,
        prompt_mask,
        config=config,
        num_generations=num_generations,
        sampling=sampling,
        stop_after=stop_after,
    )
    for end in phases:
        state = jax.lax.while_loop(
            lambda state, end=end: jnp.any(state.active) & (state.fed < end),
            body,
            state._replace(cache=grow_completion_cache(state.cache, end, config)),
        )
    return state


def decode_in_slots(
    params: dict,
    layout: DecodeLayout,
    state: DecodeState,
    prompt_mask: jax.Array,
    *,
    config: ModelConfig,
    num_generations: int,
    sampling: SamplingConfig,
    stop_after: jax.Array | None = None,
) -> DecodeState:
    """Decodes the queued rows in the state's slots, on device: when a row stops, the next row
    still to decode (in row order) takes its slot at once, at its first column. A row's column
    t is drawn with uniforms[t, row], as in the all-rows loop, so its tokens and log-probs
    depend on the seed, the prompt and the row, not on the slot that ran it or on how many
    slots there are."""
    body = functools.partial(
        step,
        params,
        layout,
        prompt_mask,
        config=config,
        num_generations=num_generations,
        sampling=sampling,
        refill=True,
        stop_after=stop_after,
    )
    return jax.lax.while_loop(lambda state: jnp.any(state.active), body, state)
