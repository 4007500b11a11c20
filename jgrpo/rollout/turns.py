"""Multi-turn rollouts: the model's turns, and between them what its tools or its environment
answer, in one record per row whose KV cache lives on the device from turn to turn.

Each of the P x G rows is one episode. The prompt (an `Environment.reset`'s messages, rendered
by the chat template with the tools' schemas) is prefilled once per group and every row draws
its first token (`jgrpo.rollout.engine.prepare`). The episodes then decode in S slots (every
row at once when `SamplingConfig.max_concurrent` is 0): an episode holds its slot, with its
completion cache, from its first turn to its last. Round by round:

1. `play_turns` (one compiled loop of `jgrpo.rollout.engine.step`) decodes every slot that is on
   its turn; a slot whose turn ends (a stop token, `max_new_tokens`, or its record full) waits
   for the host. The loop returns when enough slots wait (`awaiting_share`) or none decodes;
2. on the host, each finished turn is decoded and handed to the environment
   (`jgrpo.tools.ToolEnvironment` runs the turn's tool calls); its answer (e.g. `tool`
   messages) is rendered by the chat template and given to the row as context tokens, which
   the step writes into the record and feeds before the row's next turn, one decode step each
   (never prefilled again); or the episode ends (no call, `rollout.max_turns`, or no room
   left), and its slot goes to the next episode waiting (`answer_turns`).

A row's record holds its turns and the context between them: `mask` covers every written token
(what attention sees), `model_mask` only the model's own tokens (what the loss, the KL and the
sampler correction see); context tokens get log-prob 0. A row's column t is drawn with the
uniform (t, row) of the rollout's key, so its tokens depend on the seed, the prompt and the
row, not on the slot it ran in or on the order the host answered the turns.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo import distributed
from jgrpo.models.config import ModelConfig
from jgrpo.rollout.engine import (
    DecodeLayout,
    DecodeState,
    awaiting_host,
    decode_layout,
    prepare,
    step,
    take_slots,
)
from jgrpo.rollout.memory import concurrent_rows
from jgrpo.rollout.sampler import SamplingConfig
from jgrpo.tools import Environment

# A round of turns returns to the host once this share of the slots wait for their answers
# (or no slot decodes): the waiting slots idle until the round ends, so a smaller share keeps
# more slots busy for more host round trips. Every row at once (no slot to refill) returns
# only when no row decodes, one round per turn.
AWAITING_SHARE = 1 / 8


def awaiting_threshold(slots: int, rows: int) -> int:
    """Waiting slots that end a round of `play_turns` (`AWAITING_SHARE`); more than `slots`
    (never) when every row has its own slot."""
    if slots >= rows:
        return slots + 1
    return max(1, int(slots * AWAITING_SHARE))


@functools.partial(
    jax.jit,
    static_argnames=("model_config", "num_generations", "sampling", "total_tokens", "slots"),
)
def start_episodes(
    params: dict,
    prompt_ids: jax.Array,  # int32[P, L], left-padded
    prompt_mask: jax.Array,  # [P, L]
    key: jax.Array,
    *,
    model_config: ModelConfig,
    num_generations: int,
    sampling: SamplingConfig,
    total_tokens: int,  # T: each row's record, turns and context together
    slots: int,  # S episodes at once
    stop_after: jax.Array | None = None,  # int32[R]: benchmarks only (`prepare`)
) -> DecodeState:
    """`prepare` for episodes: the prompts prefilled once per group, every row's first token,
    and the first S episodes in the slots. A turn holds at most `sampling.max_new_tokens`
    tokens. The decode layout comes from `episode_layout`, a program of its own."""
    _, state = prepare(
        params,
        prompt_ids,
        prompt_mask,
        key,
        config=model_config,
        num_generations=num_generations,
        sampling=sampling,
        total_tokens=total_tokens,
        slots=slots,
        first_buffer=total_tokens,
        turns=True,
        stop_after=stop_after,
    )
    return state


@functools.partial(jax.jit, static_argnames=("model_config", "sampling", "positions"))
def episode_layout(
    params: dict, *, model_config: ModelConfig, sampling: SamplingConfig, positions: int
) -> DecodeLayout:
    """The decode layout of the weights, made once per rollout and kept for every round (a
    LoRA model's adapters merged once). A program apart from `start_episodes`: returned from
    one program beside the prefill's caches, the prompt caches came back from XLA:CPU (jax
    0.10.2) in a memory layout that later programs misread, while reading them to the host
    gave the right values (`tests/test_turns.py` compares the episodes with a full forward)."""
    return decode_layout(params, model_config, sampling, positions)


@functools.partial(
    jax.jit,
    static_argnames=("model_config", "num_generations", "sampling", "threshold"),
    donate_argnames="state",
)
def play_turns(
    params: dict,
    layout: DecodeLayout,
    state: DecodeState,
    prompt_mask: jax.Array,  # [P, L]
    *,
    model_config: ModelConfig,
    num_generations: int,
    sampling: SamplingConfig,
    threshold: int,
    stop_after: jax.Array | None = None,  # int32[R]: benchmarks only (`prepare`)
) -> tuple[DecodeState, jax.Array]:  # (state, bool[R]: rows waiting for the host)
    """Decodes the slots on their turns until `threshold` slots wait for the host or none
    decodes; returns the state and which rows wait."""

    def keep_going(state):
        return jnp.any(state.active) & (awaiting_host(state).sum() < threshold)

    body = functools.partial(
        step,
        params,
        layout,
        prompt_mask,
        config=model_config,
        num_generations=num_generations,
        sampling=sampling,
        stop_after=stop_after,
    )
    state = jax.lax.while_loop(keep_going, body, state)
    rows = state.tokens.shape[0]
    waiting = jnp.where(awaiting_host(state), state.slot_row, rows)
    return state, jnp.zeros((rows,), bool).at[waiting].set(True, mode="drop")


@functools.partial(jax.jit, static_argnames="sampling", donate_argnames="state")
def answer_turns(
    state: DecodeState,
    context: jax.Array,  # int32[R, T]: each resuming row's answer tokens at their columns
    turn_start: jax.Array,  # int32[R]: where a resuming row's next turn starts, after them
    resume: jax.Array,  # bool[R]: rows that take another turn
    end: jax.Array,  # bool[R]: rows whose episode ended
    *,
    sampling: SamplingConfig,
) -> DecodeState:
    """The host's answers: resuming rows get their context and go on, on their slots; the
    slots of ended episodes take the next episodes waiting."""
    rows = state.tokens.shape[0]
    row = jnp.minimum(state.slot_row, rows - 1)
    held = state.slot_row < rows
    state = state._replace(
        context=jnp.where(resume[:, None], context, state.context),
        turn_start=jnp.where(resume, turn_start, state.turn_start),
        stopped=state.stopped & ~resume,
        active=state.active | (held & resume[row]),
    )
    return take_slots(state, held & end[row], sampling)


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
    slots: int  # episodes that decoded at once (rollout.max_concurrent, or every row)
    decode_steps: int  # decode steps of the whole rollout, over all its rounds
    rounds: int  # compiled decode loops the host answered turns between (`play_turns`)


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
    stop_after: jax.Array | None = None,
) -> Episodes:
    """P x G episodes of `examples` (rows prompt-major), up to `max_turns` model turns and
    `total_tokens` tokens of turns and context each, `sampling.max_concurrent` of them at once
    (0: all); each episode gets its own environment from `new_environment()`, and a group's
    prompt is its first episode's `reset` messages, rendered with the `tools` schemas and
    left-padded to `prompt_width` columns. `place` puts a host array of this process's rows on
    the devices and `local` reads them back (a `RowBlock`'s, on a mesh). `stop_after`
    (int32[R], for benchmarks only, never for training): token stop_after[r] - 1 of each of
    row r's turns becomes the first stop token, so the turns end at lengths the benchmark
    chose."""
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
    prompt_ids_global, prompt_mask_global = place(ids), place(prompt_mask)
    all_rows = prompt_ids_global.shape[0] * g  # every process's
    slots = concurrent_rows(sampling.max_concurrent, all_rows) or all_rows
    statics = dict(model_config=model_config, num_generations=g, sampling=sampling)
    state = start_episodes(
        params,
        prompt_ids_global,
        prompt_mask_global,
        key,
        total_tokens=total_tokens,
        slots=slots,
        stop_after=stop_after,
        **statics,
    )
    layout = episode_layout(
        params, model_config=model_config, sampling=sampling, positions=ids.shape[1] + total_tokens
    )
    rows = len(environments)  # this process's
    history = [list(messages) for messages in starts]
    completions: list[list[dict[str, Any]]] = [[] for _ in range(rows)]
    turns, calls, errors = (np.zeros(rows, np.int32) for _ in range(3))
    out_of_turns, out_of_tokens = np.zeros(rows, bool), np.zeros(rows, bool)
    ended = np.zeros(rows, bool)  # episodes over
    stop_ids = set(sampling.stop_token_ids)
    threshold = awaiting_threshold(slots, all_rows)
    rounds = 0
    while True:
        rounds += 1
        state, waiting = play_turns(
            params,
            layout,
            state,
            prompt_mask_global,
            threshold=threshold,
            stop_after=stop_after,
            **statics,
        )
        waiting = local(waiting)
        tokens, written = local(state.tokens), local(state.written)
        stopped, turn_start = local(state.stopped), local(state.turn_start)
        context = np.zeros((rows, total_tokens), np.int32)  # one shape: compiles once
        next_start = np.zeros(rows, np.int32)
        resume, end = np.zeros(rows, bool), np.zeros(rows, bool)
        for row in np.flatnonzero(waiting):
            turns[row] += 1
            drawn = tokens[row, turn_start[row] : written[row]]
            stop = int(drawn[-1]) if stopped[row] and int(drawn[-1]) in stop_ids else None
            text = tokenizer.decode(
                drawn[:-1] if stop is not None else drawn, skip_special_tokens=False
            )
            message = {"role": "assistant", "content": text}
            completions[row].append(message)
            end[row] = True  # unless the episode goes on below
            if stop is None:  # hit max_new_tokens, or filled its record, mid-turn
                out_of_tokens[row] = True
                continue
            answer = environments[row].step([*history[row], message])
            calls[row] += answer.tool_calls
            errors[row] += answer.tool_errors
            if answer.done:
                continue
            if turns[row] == max_turns:
                out_of_turns[row] = True
                continue
            stop_text = tokenizer.decode([stop], skip_special_tokens=False)
            text = context_after_turn(tokenizer, history[row], answer.messages, stop_text, tools)
            context_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if written[row] + len(context_ids) >= total_tokens:  # no room for the next turn
                out_of_tokens[row] = True
                continue
            history[row] += [message, *answer.messages]
            completions[row] += answer.messages
            context[row, written[row] : written[row] + len(context_ids)] = context_ids
            next_start[row] = written[row] + len(context_ids)
            resume[row], end[row] = True, False
        ended |= end
        state = answer_turns(
            state, place(context), place(next_start), place(resume), place(end), sampling=sampling
        )
        if distributed.agree_all(bool(ended.all())):
            break
    written = local(state.written)
    mask = np.arange(total_tokens)[None] < written[:, None]
    logprobs = local(state.logprobs)
    sampler = logprobs if state.sampler_logprobs is None else local(state.sampler_logprobs)
    return Episodes(
        prompt_ids=ids,
        prompt_mask=prompt_mask,
        tokens=local(state.tokens),
        mask=mask,
        model_mask=local(state.model_mask) & mask,
        logprobs=logprobs,
        sampler_logprobs=sampler,
        lengths=written.astype(np.int32),
        truncated=out_of_turns | out_of_tokens,
        conversations=completions,
        turns=turns,
        tool_calls=calls,
        tool_errors=errors,
        out_of_turns=out_of_turns,
        out_of_tokens=out_of_tokens,
        slots=slots,
        decode_steps=int(state.decode_step.addressable_data(0)),  # replicated
        rounds=rounds,
    )
