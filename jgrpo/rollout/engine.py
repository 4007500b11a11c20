"""The rollout engine: one typed decode state, `prepare` (the prelude, once per rollout) and one
`step`, which every driver (`jgrpo.rollout.drivers`, `jgrpo.rollout.turns`) runs.

Shapes: P prompts, G generations per prompt, R = P * G rows (prompt-major: row p * G + g),
L prompt slots, T the tokens a row's record holds after its prompt (its turns and the context
between them), S slots that decode at once, V vocabulary.

A row's record is written left to right, one column per decode step, by `_draw` alone: the
token the model draws, or on multi-turn rows the next token of the environment's answer
(context, log-prob 0, outside the model's mask). Column t of row r is drawn with the uniform
(t, r) of the rollout's key, so a row's tokens depend on the seed, the prompt and the row,
whatever slot runs it and whatever rows run beside it.

Two layouts of the slot table, chosen by the drivers:
- lockstep (`fed` a scalar): every row is its own slot and all are at the same column, so a
  decode step writes one cache slot for every row (in place) and its attention buffers can
  grow in phases (`jgrpo.rollout.memory.attention_phases`);
- slots (`fed` int32[S]): each slot holds one row at its own column and reads its prompt's
  cache from the shared prompt table by index; a slot whose row is done takes the next row of
  the queue (`take_slots`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jgrpo.models.config import ModelConfig
from jgrpo.models.embedding import logits_from_hidden
from jgrpo.models.group_decode import (
    GroupCache,
    decode_layers,
    decode_logits,
    decode_rope_tables,
    decode_step,
    prefill,
    unembedding_rows,
)
from jgrpo.models.precision import with_matmul_unembedding
from jgrpo.rollout.sampler import SamplingConfig, sample_tokens


class DecodeLayout(NamedTuple):
    """The weights as the decode step reads them (`decode_layout`), made once per rollout and
    kept for all its steps and turns (a LoRA model's adapters are merged into them once)."""

    layers: list[dict]  # `jgrpo.models.group_decode.decode_layers`
    rope: dict  # {sliding: (cos, sin) f32[L + T, D/2]}, `decode_rope_tables`
    # [V, E] when it is not the parameters' own table (an untied lm_head transposed, or the
    # bf16 copy of `weights_dtype`); None: the embedding table itself (`unembedding_rows`)
    unembedding: jax.Array | None


class DecodeState(NamedTuple):
    """Everything a rollout carries from one decode step to the next (a pytree)."""

    cache: GroupCache  # each prompt's keys and values once; S (lockstep: R) completion buffers
    prompt_lengths: jax.Array  # int32[P]: real prompt tokens (prompts are left-padded)
    uniforms: jax.Array  # f32[T, R]: the uniform of column t of row r, drawn up front

    # The records, per row.
    tokens: jax.Array  # int32[R, T]; pad_token_id after the last written column
    logprobs: jax.Array  # f32[R, T]: the policy's log_softmax(logits / T); 0 off the model's
    sampler_logprobs: jax.Array | None  # f32[R, T] under top-k/p/min-p filters; None: logprobs
    model_mask: jax.Array | None  # bool[R, T]: the model's own tokens (multi-turn); None: all
    written: jax.Array  # int32[R]: columns written
    stopped: jax.Array  # bool[R]: the row's last turn ended on a stop token
    finished_at: jax.Array  # int32[R]: the decode step that wrote the row's last column

    # Turns: the environment's answers, written into the record before the next turn.
    context: jax.Array | None  # int32[R, T]: answer tokens at their columns; None: one turn
    turn_start: jax.Array  # int32[R]: the column the row's current turn starts at

    # The slot table.
    slot_row: jax.Array  # int32[S]: the row each slot holds; R: none
    fed: jax.Array  # int32[S] | int32[] (lockstep): columns of the slot's row in the cache
    last_token: jax.Array  # int32[S]: the slot's row's last written token, the next it feeds
    active: jax.Array  # bool[S]: the slot's row is on its turn (writes a column each step)
    queue: jax.Array  # int32[R]: rows in the order they take slots
    queued: jax.Array  # int32[]: rows of the queue that have taken a slot
    queue_length: jax.Array  # int32[]: rows in the queue
    decode_step: jax.Array  # int32[]: decode steps run


def matmul_dtype_of(sampling: SamplingConfig):
    """The dtype the rollout's weight matrices are cast to; None: the parameters' own."""
    return None if sampling.weights_dtype == "float32" else jnp.dtype(sampling.weights_dtype)


def decode_layout(
    params: dict, config: ModelConfig, sampling: SamplingConfig, positions: int
) -> DecodeLayout:
    """The `DecodeLayout` of `params` for rows that reach `positions` positions, its weight
    matrices in `sampling.weights_dtype`."""
    matmul_dtype = matmul_dtype_of(sampling)
    derived = matmul_dtype is not None or "lm_head" in params
    table_params = params if matmul_dtype is None else with_matmul_unembedding(params, matmul_dtype)
    return DecodeLayout(
        layers=decode_layers(params, config, matmul_dtype),
        rope=decode_rope_tables(config, positions),
        unembedding=unembedding_rows(table_params) if derived else None,
    )


def prepare(
    params: dict,
    prompt_ids: jax.Array,  # int32[P, L], left-padded
    prompt_mask: jax.Array,  # [P, L], 1 on real prompt tokens
    key: jax.Array,
    *,
    config: ModelConfig,
    num_generations: int,
    sampling: SamplingConfig,
    total_tokens: int,
    slots: int | None,
    first_buffer: int,
    turns: bool = False,
    stop_after: jax.Array | None = None,
) -> tuple[DecodeLayout, DecodeState]:
    """The prelude of every rollout, once: prefill each prompt once for its G rows, the decode
    layout of the weights, the uniforms, and every row's first token drawn from its prompt's
    last logits (repeated G times, never the cache).

    `slots`: the completion buffers' rows, S (None: lockstep, every row at once); each holds
    `first_buffer` columns (a lockstep rollout in phases grows them). `turns`: the rows are
    episodes whose turns the host answers (every row queues for a slot, and the state keeps
    the model's mask and the answers' tokens); otherwise the rows that drew a stop token
    first need no slot. `stop_after` (int32[R], benchmarks only): token stop_after[r] - 1 of
    each of row r's turns becomes the first stop token (`jgrpo.rollout.rollout`).
    """
    rows = prompt_ids.shape[0] * num_generations
    matmul_dtype = matmul_dtype_of(sampling)
    if matmul_dtype is not None:  # the bf16 unembedding; the layers are cast in their own passes
        params = with_matmul_unembedding(params, matmul_dtype)
    hidden, cache = prefill(
        params,
        prompt_ids,
        prompt_mask,
        config=config,
        num_generations=num_generations,
        max_new_tokens=first_buffer,
        matmul_dtype=matmul_dtype,
        completion_rows=slots,
    )
    logits = logits_from_hidden(params, hidden, config.final_logit_softcapping)  # [P, V]
    layout = decode_layout(params, config, sampling, prompt_ids.shape[1] + total_tokens)
    empty = jnp.zeros((rows, total_tokens), jnp.float32)
    state = DecodeState(
        cache=cache,
        prompt_lengths=prompt_mask.astype(jnp.int32).sum(-1),
        # All the randomness up front: the decode loop then holds no random-bit generator.
        uniforms=jax.random.uniform(key, (total_tokens, rows)),
        tokens=jnp.full((rows, total_tokens), sampling.pad_token_id, jnp.int32),
        logprobs=empty,
        sampler_logprobs=empty if sampling.filters else None,
        model_mask=jnp.zeros((rows, total_tokens), bool) if turns else None,
        written=jnp.zeros((rows,), jnp.int32),
        stopped=jnp.zeros((rows,), bool),
        finished_at=jnp.zeros((rows,), jnp.int32),
        context=jnp.zeros((rows, total_tokens), jnp.int32) if turns else None,
        turn_start=jnp.zeros((rows,), jnp.int32),
        slot_row=jnp.arange(rows, dtype=jnp.int32),
        fed=jnp.asarray(-1, jnp.int32),  # column 0 comes from the prefill: no feed before it
        last_token=jnp.zeros((rows,), jnp.int32),
        active=jnp.ones((rows,), bool),
        queue=jnp.arange(rows, dtype=jnp.int32),
        queued=jnp.asarray(rows, jnp.int32),
        queue_length=jnp.asarray(rows, jnp.int32),
        decode_step=jnp.zeros((), jnp.int32),
    )
    state = _draw(
        state, jnp.repeat(logits, num_generations, axis=0), sampling=sampling, stop_after=stop_after
    )
    if slots is None:
        return layout, state
    # The slot table: the rows that decode, in row order, take the S slots as they free up.
    waiting = jnp.ones((rows,), bool) if turns else state.active
    state = state._replace(
        slot_row=jnp.full((slots,), rows, jnp.int32),
        fed=jnp.zeros((slots,), jnp.int32),
        last_token=jnp.zeros((slots,), jnp.int32),
        active=jnp.zeros((slots,), bool),
        queue=jnp.argsort(~waiting, stable=True).astype(jnp.int32),
        queued=jnp.zeros((), jnp.int32),
        queue_length=waiting.sum(dtype=jnp.int32),
    )
    return layout, take_slots(state, jnp.ones((slots,), bool), sampling)


def step(
    params: dict,
    layout: DecodeLayout,
    prompt_mask: jax.Array,  # [P, L]
    state: DecodeState,
    *,
    config: ModelConfig,
    num_generations: int,
    sampling: SamplingConfig,
    refill: bool = False,
    stop_after: jax.Array | None = None,
) -> DecodeState:
    """One decode step of every slot: feeds its row's last written column into the cache and
    writes the next column (`_draw`). The state comes last, so that
    `functools.partial(step, params, layout, prompt_mask, ...)` is a decode loop's body.
    `refill`: a slot whose row's turn ended takes the next
    row of the queue at once (single turns, where a turn is the whole episode); otherwise it
    waits for the host (`jgrpo.rollout.turns`)."""
    lockstep = state.fed.ndim == 0  # every row at one column: one cache slot written in place
    rows = state.tokens.shape[0]
    row = jnp.minimum(state.slot_row, rows - 1)  # [S]; an empty slot computes on row R - 1
    prompt_row = row // num_generations
    hidden, cache = decode_step(
        params,
        layout.layers,
        state.cache,
        state.last_token,
        jnp.take(state.prompt_lengths, prompt_row) + state.fed,
        state.fed,
        prompt_mask,
        rope=layout.rope,
        config=config,
        prompt_rows=None if lockstep else prompt_row,
    )
    table = unembedding_rows(params) if layout.unembedding is None else layout.unembedding
    logits = decode_logits(table, hidden, config.final_logit_softcapping)  # [S, V]
    state = state._replace(cache=cache, decode_step=state.decode_step + 1)
    ended_before = ~state.active
    state = _draw(state, logits, sampling=sampling, stop_after=stop_after)
    if refill:
        state = take_slots(state, ~state.active & ~ended_before, sampling)
    return state


def _draw(
    state: DecodeState,
    logits: jax.Array,  # f32[S, V]: each slot's logits for the column after its last fed one
    *,
    sampling: SamplingConfig,
    stop_after: jax.Array | None = None,
) -> DecodeState:
    """Writes the next column of each active slot's row, the one writer of the records: the
    token drawn from `logits` on the model's turn, or before it the next token of the
    environment's answer (`DecodeState.context`). A turn ends at a stop token, after
    `sampling.max_new_tokens` tokens, or when the record is full."""
    rows, total = state.tokens.shape
    lockstep = state.fed.ndim == 0
    column = jnp.minimum(state.fed + 1, total - 1)  # [] | [S]
    row = jnp.minimum(state.slot_row, rows - 1)

    def at_rows(values):  # a per-row array [R, ...] at the slots' rows
        return values if lockstep else values[row]

    uniform = state.uniforms[column] if lockstep else state.uniforms[column, row]
    token, logprob, sampler_logprob = sample_tokens(logits, uniform, sampling)
    turns = state.context is not None
    turn_start = at_rows(state.turn_start) if turns else 0  # a single turn starts at 0
    if stop_after is not None:  # benchmarks: the length chosen for each of the row's turns
        stop_ids = jnp.asarray(sampling.stop_token_ids, jnp.int32)
        token = jnp.where(column - turn_start + 1 >= at_rows(stop_after), stop_ids[0], token)
    active = state.active
    drawn = active & (column >= turn_start)  # the model's turn: no answer left to write
    if turns:
        answer = state.context[:, column] if lockstep else state.context[row, column]
        token = jnp.where(drawn, token, answer)

    if lockstep:

        def write(record, value):  # one column of every row; rows not writing keep theirs
            return record.at[:, column].set(jnp.where(active, value, record[:, column]))

    else:
        target = jnp.where(active, state.slot_row, rows)  # rows >= R are dropped

        def write(record, value):
            return record.at[target, column].set(value, mode="drop")

    records = dict(
        tokens=write(state.tokens, token),
        logprobs=write(state.logprobs, jnp.where(drawn, logprob, 0.0)),
    )
    if state.sampler_logprobs is not None:
        records["sampler_logprobs"] = write(
            state.sampler_logprobs, jnp.where(drawn, sampler_logprob, 0.0)
        )
    if state.model_mask is not None:
        records["model_mask"] = write(state.model_mask, drawn)

    written = column + 1
    is_stop = drawn & jnp.isin(token, jnp.asarray(sampling.stop_token_ids, jnp.int32))
    goes_on = (
        active & ~is_stop & (written < total) & (written - turn_start < sampling.max_new_tokens)
    )
    ended = active & ~goes_on
    if lockstep:
        records.update(
            written=jnp.where(active, written, state.written),
            stopped=state.stopped | is_stop,
            finished_at=jnp.where(ended, state.decode_step, state.finished_at),
        )
    else:
        ending = jnp.where(ended, state.slot_row, rows)
        records.update(
            written=state.written.at[target].set(written, mode="drop"),
            stopped=state.stopped.at[ending].set(is_stop, mode="drop"),
            finished_at=state.finished_at.at[ending].set(state.decode_step, mode="drop"),
        )
    return state._replace(
        **records,
        fed=state.fed + 1 if lockstep else jnp.where(active, state.fed + 1, state.fed),
        last_token=jnp.where(active, token, state.last_token),
        active=goes_on,
    )


def on_turn(state: DecodeState, rows: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """bool[...]: whether each of `rows` (< R) has a column to write: its turn has not ended."""
    written = state.written[rows]
    return (
        ~state.stopped[rows]
        & (written < state.tokens.shape[1])
        & (written - state.turn_start[rows] < sampling.max_new_tokens)
    )


def take_slots(state: DecodeState, free: jax.Array, sampling: SamplingConfig) -> DecodeState:
    """The slots in `free` (bool[S]) take the next rows of the queue, in slot order (empty
    once it is exhausted): each continues its row from its last written column. Single turns
    queue only rows that go on after their first token, so a row taken is on its turn at
    column 1; an episode may have ended its turn already, and then waits for the host."""
    rows = state.tokens.shape[0]
    index = state.queued + jnp.cumsum(free, dtype=jnp.int32) - 1  # [S]
    taken = free & (index < state.queue_length)
    slot_row = jnp.where(
        taken, state.queue[jnp.minimum(index, rows - 1)], jnp.where(free, rows, state.slot_row)
    )
    row = jnp.minimum(slot_row, rows - 1)
    if state.context is None:  # single turns
        fed, starts = jnp.zeros_like(state.fed), taken
    else:
        fed, starts = jnp.maximum(state.written[row] - 1, 0), taken & on_turn(state, row, sampling)
    return state._replace(
        slot_row=slot_row,
        fed=jnp.where(taken, fed, state.fed),
        last_token=jnp.where(taken, state.tokens[row, fed], state.last_token),
        active=jnp.where(free, starts, state.active),
        queued=state.queued + taken.sum(dtype=jnp.int32),
    )


def awaiting_host(state: DecodeState) -> jax.Array:
    """bool[S]: slots whose row's turn has ended and which wait for the host's answer."""
    return (state.slot_row < state.tokens.shape[0]) & ~state.active
