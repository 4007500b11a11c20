"""Multi-turn rollouts: the model's turns, and between them what its tools or its environment
answer, in one sequence per row whose KV cache lives on the device from turn to turn.

Each of the P x G rows is one episode. The prompt (an `Environment.reset`'s messages, rendered
by the chat template with the tools' schemas) is prefilled once per group, as in
`jgrpo.sampling.rollout`. Then, turn by turn:

1. `continue_turns` (one compiled loop) decodes every row that is on its turn until it draws
   a stop token or fills `max_total_tokens`; a row whose next token is context (below) is fed
   that token instead of drawing one, so the context costs one decode step per token and is
   never prefilled again;
2. on the host, each finished turn is decoded and handed to the environment
   (`jgrpo.tools.ToolEnvironment` runs the turn's tool calls); its answer (e.g. `tool`
   messages) is rendered by the chat template and appended to the row as context tokens
   (`append_context`), or the episode ends (no call, `rollout.max_turns`, or no room left).

A row's completion area holds its turns and the context between them: `mask` covers every
written token (what attention sees), `model_mask` only the model's own tokens (what the loss,
the KL and the sampler correction see); context tokens get log-prob 0. A row's token t is
drawn with the uniform (t, row) of the rollout's key, as in the single-turn rollout.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo.models.config import ModelConfig
from jgrpo.models.group_decode import (
    decode_layers,
    decode_logits,
    decode_rope_tables,
    decode_step,
    prefill,
    unembedding_rows,
)
from jgrpo.models.transformer import logits_from_hidden, with_matmul_unembedding
from jgrpo.sampling import SamplingConfig, sample_tokens
from jgrpo.tools import Environment


def _matmul_dtype(sampling: SamplingConfig):
    return None if sampling.weights_dtype == "float32" else jnp.dtype(sampling.weights_dtype)


@functools.partial(
    jax.jit, static_argnames=("model_config", "num_generations", "sampling", "total_tokens")
)
def start_turns(
    params: dict,
    prompt_ids: jax.Array,  # int32[P, L], left-padded
    prompt_mask: jax.Array,  # [P, L]
    key: jax.Array,
    *,
    model_config: ModelConfig,
    num_generations: int,
    sampling: SamplingConfig,
    total_tokens: int,  # T: each row's completion area, turns and context together
) -> dict:
    """Prefills the prompts once per group and draws every row's first token: the state that
    `continue_turns` decodes the first turn from. A turn holds at most
    `sampling.max_new_tokens` tokens."""
    rows = prompt_ids.shape[0] * num_generations
    softcap = model_config.final_logit_softcapping  # Gemma 2 caps its logits
    matmul_dtype = _matmul_dtype(sampling)
    if matmul_dtype is not None:
        params = with_matmul_unembedding(params, matmul_dtype)
    hidden, cache = prefill(
        params,
        prompt_ids,
        prompt_mask,
        config=model_config,
        num_generations=num_generations,
        max_new_tokens=total_tokens,
        matmul_dtype=matmul_dtype,
    )
    logits = jnp.repeat(
        logits_from_hidden(params, hidden, softcap),
        num_generations,
        axis=0,
    )  # [R, V]
    uniforms = jax.random.uniform(key, (total_tokens, rows))  # token t of row r: [t, r]
    token, logprob, sampler_logprob = sample_tokens(logits, uniforms[0], sampling)
    stops = jnp.isin(token, jnp.asarray(sampling.stop_token_ids, jnp.int32))
    tokens = jnp.full((rows, total_tokens), sampling.pad_token_id, jnp.int32)
    zeros = jnp.zeros((rows, total_tokens), jnp.float32)
    return dict(
        cache=cache,
        tokens=tokens.at[:, 0].set(token),  # int32[R, T]
        model_mask=jnp.zeros((rows, total_tokens), bool).at[:, 0].set(True),  # bool[R, T]
        logprobs=zeros.at[:, 0].set(logprob),  # f32[R, T], 0 on context
        sampler_logprobs=zeros.at[:, 0].set(sampler_logprob),
        written=jnp.ones((rows,), jnp.int32),  # tokens in the row's area
        fed=jnp.zeros((rows,), jnp.int32),  # of which fed to the model (cached)
        prompt_lengths=jnp.repeat(prompt_mask.astype(jnp.int32).sum(-1), num_generations),
        active=~stops & (min(total_tokens, sampling.max_new_tokens) > 1),  # on its turn
        turn_ended=stops,  # the turn ended on a stop token
        turn_start=jnp.zeros((rows,), jnp.int32),  # where the row's current turn began
        uniforms=uniforms,  # f32[T, R]: drawn once, read by every turn's decode
    )


@functools.partial(jax.jit, static_argnames=("model_config", "num_generations", "sampling"))
def continue_turns(
    params: dict,
    state: dict,
    prompt_mask: jax.Array,  # [P, L]
    *,
    model_config: ModelConfig,
    num_generations: int,
    sampling: SamplingConfig,
) -> dict:
    """Decodes the active rows until each draws a stop token or fills its area, feeding the
    context tokens a row has before it draws (one decode step each)."""
    rows, total = state["tokens"].shape
    softcap = model_config.final_logit_softcapping
    matmul_dtype = _matmul_dtype(sampling)
    if matmul_dtype is not None:
        params = with_matmul_unembedding(params, matmul_dtype)
    layers = decode_layers(params, model_config, matmul_dtype)
    rope = decode_rope_tables(model_config, prompt_mask.shape[1] + total)
    unembedding = unembedding_rows(params)
    stop_ids = jnp.asarray(sampling.stop_token_ids, jnp.int32)
    row_index = jnp.arange(rows)
    prompt_rows = row_index // num_generations

    def one_step(state):
        fed, active, written = state["fed"], state["active"], state["written"]
        feed = jnp.take_along_axis(state["tokens"], fed[:, None], axis=1)[:, 0]
        hidden, cache = decode_step(
            params,
            layers,
            state["cache"],
            feed,
            state["prompt_lengths"] + fed,
            fed,
            prompt_mask,
            rope=rope,
            config=model_config,
            prompt_rows=prompt_rows,
        )
        logits = decode_logits(unembedding, hidden, softcap)  # [R, V]
        index = jnp.minimum(fed + 1, total - 1)  # the token these logits predict
        draw = active & (fed + 1 >= written)  # the model's turn (no context left to feed)
        token, logprob, sampler_logprob = sample_tokens(
            logits, state["uniforms"][index, row_index], sampling
        )
        target = jnp.where(draw, row_index, rows)  # rows that draw; the rest are dropped
        written = jnp.where(draw, written + 1, written)
        is_stop = draw & jnp.isin(token, stop_ids)
        return dict(
            state,
            cache=cache,
            tokens=state["tokens"].at[target, index].set(token, mode="drop"),
            model_mask=state["model_mask"].at[target, index].set(True, mode="drop"),
            logprobs=state["logprobs"].at[target, index].set(logprob, mode="drop"),
            sampler_logprobs=state["sampler_logprobs"]
            .at[target, index]
            .set(sampler_logprob, mode="drop"),
            written=written,
            fed=jnp.where(active, fed + 1, fed),
            # a turn ends at a stop token, at sampling.max_new_tokens, or with the area full
            active=active
            & ~is_stop
            & (written < total)
            & (written - state["turn_start"] < sampling.max_new_tokens),
            turn_ended=state["turn_ended"] | is_stop,
        )

    return jax.lax.while_loop(lambda state: jnp.any(state["active"]), one_step, state)


@functools.partial(jax.jit, donate_argnums=0)
def append_context(
    state: dict,
    context: jax.Array,  # int32[R, A], right-padded
    lengths: jax.Array,  # int32[R]: context tokens of each row
    resume: jax.Array,  # bool[R]: rows that take another turn (their context fits)
) -> dict:
    """Writes each resuming row's context after its written tokens (model_mask 0) and makes
    it active for its next turn."""
    rows, total = state["tokens"].shape
    columns = state["written"][:, None] + jnp.arange(context.shape[1])[None]  # [R, A]
    keep = resume[:, None] & (jnp.arange(context.shape[1])[None] < lengths[:, None])
    target = jnp.where(keep & (columns < total), jnp.arange(rows)[:, None], rows)
    written = jnp.where(resume, state["written"] + lengths, state["written"])
    return dict(
        state,
        tokens=state["tokens"]
        .at[target, jnp.minimum(columns, total - 1)]
        .set(context, mode="drop"),
        written=written,
        active=resume & (written < total),
        turn_ended=jnp.where(resume, False, state["turn_ended"]),
        turn_start=jnp.where(resume, written, state["turn_start"]),
    )


@dataclasses.dataclass
class Episodes:
    """A multi-turn rollout's rows (host arrays of this process's rows, prompt-major)."""

    prompt_ids: np.ndarray  # int32[P, L]: each group's rendered prompt, left-padded
    prompt_mask: np.ndarray  # int32[P, L]

    tokens: np.ndarray  # int32[R, T]: turns and context
    mask: np.ndarray  # bool[R, T]: every written token
    model_mask: np.ndarray  # bool[R, T]: the model's own tokens
    logprobs: np.ndarray  # f32[R, T], 0 on context
    sampler_logprobs: np.ndarray  # f32[R, T], 0 on context
    lengths: np.ndarray  # int32[R]: written tokens
    truncated: np.ndarray  # bool[R]: ended by max_turns or max_total_tokens, not by an answer
    conversations: list[list[dict[str, Any]]]  # the completion of each row, as messages
    turns: np.ndarray  # int32[R]: model turns
    tool_calls: np.ndarray  # int32[R]
    tool_errors: np.ndarray  # int32[R]
    out_of_turns: np.ndarray  # bool[R]: still calling tools at rollout.max_turns
    out_of_tokens: np.ndarray  # bool[R]: filled rollout.max_total_tokens


def context_after_turn(
    tokenizer,
    history: Sequence[Mapping[str, Any]],
    answer: Sequence[Mapping[str, Any]],
    stop_text: str,
    tools: list[dict] | None,
) -> str:
    """The text to append after a model turn (whose stop token, `stop_text`, is already in the
    sequence): what the chat template renders between the turn and the next assistant turn
    when `answer` (e.g. tool messages) follows it. The turn is rendered as a marker (the
    sequence holds the model's own tokens; the template only places the answer), so its text
    (empty, or repeated in the history) cannot be mistaken for the boundary."""
    turned = [*history, {"role": "assistant", "content": _TURN_MARKER}]
    before = tokenizer.apply_chat_template(turned, tools=tools, tokenize=False)
    after = tokenizer.apply_chat_template(
        [*turned, *answer], tools=tools, add_generation_prompt=True, tokenize=False
    )
    end = before.find(_TURN_MARKER) + len(_TURN_MARKER)
    if end < len(_TURN_MARKER) or not after.startswith(before[:end]):
        raise ValueError(
            "the chat template renders the conversation before a tool answer differently "
            "once the answer follows it, so the answer cannot be appended to the sequence."
        )
    rest = after[end:]
    return rest[len(stop_text) :] if stop_text and rest.startswith(stop_text) else rest


_TURN_MARKER = "\u2063jgrpo-turn\u2063"  # invisible separators around a name no text holds


def run_episodes(
    params,
    examples: Sequence[Mapping[str, Any]],
    key: jax.Array,
    *,
    new_environment: Callable[[], Environment],
    tokenizer,
    model_config: ModelConfig,
    num_generations: int,
    sampling: SamplingConfig,
    max_turns: int,
    total_tokens: int,
    prompt_width: int,
    tools: list[dict] | None = None,
    place: Callable[[np.ndarray], jax.Array] = jnp.asarray,
    local: Callable[[jax.Array], np.ndarray] = np.asarray,
) -> Episodes:
    """P x G episodes of `examples` (rows prompt-major), up to `max_turns` model turns and
    `total_tokens` tokens of turns and context each; each episode gets its own environment
    from `new_environment()`, and a group's prompt is its first episode's `reset` messages,
    rendered with the `tools` schemas and left-padded to `prompt_width` columns. `place` puts a
    host array of this process's rows on the devices and `local` reads them back (a
    `RowBlock`'s, on a mesh)."""
    from jgrpo.generation import pad_prompts

    g = num_generations
    environments = [new_environment() for _ in range(len(examples) * g)]
    starts = [environments[row].reset(examples[row // g]) for row in range(len(environments))]
    first = starts[::g]
    prompt_ids = [
        tokenizer(
            tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )["input_ids"]
        for messages in first
    ]
    for example, ids in zip(examples, prompt_ids, strict=True):
        if len(ids) > prompt_width:
            raise ValueError(
                f"the prompt of {example['prompt']!r} is {len(ids)} tokens with the tools' "
                f"schemas, more than rollout.max_prompt_length={prompt_width}; raise it "
                "(nothing is truncated)."
            )
    ids, prompt_mask = pad_prompts(prompt_ids, buckets=(prompt_width,))
    prompt_mask_global = place(prompt_mask)
    statics = dict(model_config=model_config, num_generations=g, sampling=sampling)
    state = start_turns(
        params, place(ids), prompt_mask_global, key, total_tokens=total_tokens, **statics
    )
    rows = len(examples) * g
    history = [list(messages) for messages in starts]
    completions: list[list[dict[str, Any]]] = [[] for _ in range(rows)]
    turn_start = np.zeros(rows, np.int64)  # where each row's current turn begins
    turns, calls, errors = (np.zeros(rows, np.int32) for _ in range(3))
    out_of_turns, out_of_tokens = np.zeros(rows, bool), np.zeros(rows, bool)
    stop_ids = set(sampling.stop_token_ids)
    playing = np.ones(rows, bool)  # rows whose episode goes on
    for turn in range(max_turns):
        state = continue_turns(params, state, prompt_mask_global, **statics)
        tokens, written = local(state["tokens"]), local(state["written"])
        ended = local(state["turn_ended"])
        contexts: list[list[int]] = [[] for _ in range(rows)]
        resume = np.zeros(rows, bool)
        for row in np.flatnonzero(playing):
            turns[row] += 1
            drawn = tokens[row, turn_start[row] : written[row]]
            stop = int(drawn[-1]) if ended[row] and int(drawn[-1]) in stop_ids else None
            text = tokenizer.decode(
                drawn[:-1] if stop is not None else drawn, skip_special_tokens=False
            )
            message = {"role": "assistant", "content": text}
            completions[row].append(message)
            if stop is None:  # hit max_new_tokens, or filled its area, mid-turn
                out_of_tokens[row] = True
                continue
            answer = environments[row].step([*history[row], message])
            calls[row] += answer.tool_calls
            errors[row] += answer.tool_errors
            if answer.done:
                continue
            if turn + 1 == max_turns:
                out_of_turns[row] = True
                continue
            stop_text = tokenizer.decode([stop], skip_special_tokens=False)
            context = context_after_turn(tokenizer, history[row], answer.messages, stop_text, tools)
            context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
            if written[row] + len(context_ids) >= total_tokens:  # no room for the next turn
                out_of_tokens[row] = True
                continue
            history[row] += [message, *answer.messages]
            completions[row] += answer.messages
            contexts[row], resume[row] = context_ids, True
            turn_start[row] = written[row] + len(context_ids)
        playing = resume
        if not resume.any():
            break
        padded = np.zeros((rows, total_tokens), np.int32)  # one shape: append compiles once
        for row, context in enumerate(contexts):
            padded[row, : len(context)] = context
        lengths = np.asarray([len(context) for context in contexts], np.int32)
        state = append_context(state, place(padded), place(lengths), place(resume))
    written = local(state["written"])
    total = state["tokens"].shape[1]
    mask = np.arange(total)[None] < written[:, None]
    return Episodes(
        prompt_ids=ids,
        prompt_mask=prompt_mask,
        tokens=local(state["tokens"]),
        mask=mask,
        model_mask=local(state["model_mask"]) & mask,
        logprobs=local(state["logprobs"]),
        sampler_logprobs=local(state["sampler_logprobs"]),
        lengths=written.astype(np.int32),
        truncated=out_of_turns | out_of_tokens,
        conversations=completions,
        turns=turns,
        tool_calls=calls,
        tool_errors=errors,
        out_of_turns=out_of_turns,
        out_of_tokens=out_of_tokens,
    )
