"""Group sampling as one compiled program: prefill each prompt once, fan its KV cache out to
its G rows, then decode in a `jax.lax.while_loop` that stops when every row has stopped.

Shapes: P prompts, G generations per prompt, L (bucketed) prompt length, N new tokens,
S = L + N cache slots, V vocabulary. Rows are ordered prompt-major: row p * G + g.

Log-probabilities are those of the temperature-scaled distribution, log_softmax(logits / T),
which is what the trainer recomputes with `jgrpo.token_logprobs(..., temperature=T)`: use the
same temperature for both. top-k / top-p / min-p restrict which tokens can be drawn but are
not folded into the returned log-probs (as in TRL); greedy decoding (T = 0) reports T = 1
log-probs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.transformer import forward, init_cache, logits_from_hidden


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How completions are drawn; static (part of the compiled program)."""

    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()  # EOS and, for chat models, the end-of-turn token
    pad_token_id: int = 0  # written after a row has stopped (always masked out)

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}.")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1) (0 = off), got {self.min_p}.")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


class Rollout(NamedTuple):
    """G completions of each of P prompts; every array has P * G rows, prompt-major."""

    tokens: jax.Array  # int32[P*G, N]; pad_token_id after the stop
    mask: jax.Array  # bool[P*G, N]; completion tokens, up to and including the first stop
    logprobs: jax.Array  # f32[P*G, N]; log_softmax(logits / T) at each token, 0 where masked
    lengths: jax.Array  # int32[P*G]; mask.sum(-1)
    truncated: jax.Array  # bool[P*G]; reached max_new_tokens without a stop token
    group_ids: jax.Array  # int32[P*G]; the prompt each row answers


def filter_logits(logits: jax.Array, *, top_k: int, top_p: float, min_p: float) -> jax.Array:
    """Sets to -inf the logits [B, V] of tokens outside the top-k / top-p / min-p sets.

    Applied in that order, each on the distribution the previous one left: top-k keeps the k
    largest; top-p the smallest set of most likely tokens whose mass reaches top_p; min-p the
    tokens with probability >= min_p times the largest. The most likely token always stays.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth_largest = jax.lax.top_k(logits, top_k)[0][..., -1:]  # [B, 1]
        logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]  # [B, V] descending
        sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep = mass_before < top_p  # the first token always (mass before it is 0)
        threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    if min_p > 0.0:
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        floor = jnp.max(log_probs, axis=-1, keepdims=True) + jnp.log(min_p)
        logits = jnp.where(log_probs < floor, -jnp.inf, logits)
    return logits


def sample_tokens(
    logits: jax.Array,  # f32[B, V]
    key: jax.Array,
    sampling: SamplingConfig,
) -> tuple[jax.Array, jax.Array]:  # (int32[B], f32[B])
    """Draws one token per row; returns it and its log-prob under log_softmax(logits / T)."""
    if sampling.temperature == 0:
        tokens = jnp.argmax(logits, axis=-1)
        scaled = logits
    else:
        scaled = logits / sampling.temperature
        allowed = filter_logits(
            scaled, top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p
        )
        tokens = jax.random.categorical(key, allowed, axis=-1)
    log_probs = jax.nn.log_softmax(scaled, axis=-1)
    chosen = jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]
    return tokens.astype(jnp.int32), chosen


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
) -> Rollout:
    """G completions for each prompt, sampled by the model with parameters `params`.

    Each prompt is prefilled once (cost independent of G); its KV cache, its slot mask and
    its last logits are then repeated G times. The decode loop runs on device until every row
    has emitted a stop token or N tokens.
    """
    prompts, prompt_length = prompt_ids.shape
    rows, steps = prompts * num_generations, sampling.max_new_tokens
    slots = prompt_length + steps

    # Prefill: P rows, logits only at the last (real) position.
    cache = init_cache(model_config, prompts, slots, params["embed"].dtype)
    slot_mask = jnp.zeros((prompts, slots), jnp.int32).at[:, :prompt_length].set(prompt_mask)
    hidden, cache = forward(
        params,
        prompt_ids,
        attention_mask=slot_mask,
        cache=cache,
        config=model_config,
        return_hidden=True,
    )
    next_logits = logits_from_hidden(params, hidden[:, -1])  # [P, V]

    # Fan out to the G rows of each prompt.
    def fan_out(x, axis=0):
        return jnp.repeat(x, num_generations, axis=axis)

    cache = cache._replace(k=fan_out(cache.k, axis=1), v=fan_out(cache.v, axis=1))
    slot_mask, next_logits = fan_out(slot_mask), fan_out(next_logits)

    stop_ids = jnp.asarray(sampling.stop_token_ids, jnp.int32)
    start = dict(
        step=jnp.zeros((), jnp.int32),
        cache=cache,
        slot_mask=slot_mask,
        last_token=jnp.zeros((rows,), jnp.int32),
        tokens=jnp.full((rows, steps), sampling.pad_token_id, jnp.int32),
        logprobs=jnp.zeros((rows, steps), jnp.float32),
        lengths=jnp.zeros((rows,), jnp.int32),
        stopped=jnp.zeros((rows,), bool),
    )

    def sample_step(state, logits):  # logits f32[P*G, V] for the token at state["step"]
        step, stopped = state["step"], state["stopped"]
        step_key = jax.random.fold_in(key, step)
        token, logprob = sample_tokens(logits, step_key, sampling)
        token = jnp.where(stopped, sampling.pad_token_id, token)
        logprob = jnp.where(stopped, 0.0, logprob)
        is_stop = jnp.isin(token, stop_ids) & ~stopped
        return dict(
            state,
            step=step + 1,
            last_token=token,
            tokens=state["tokens"].at[:, step].set(token),
            logprobs=state["logprobs"].at[:, step].set(logprob),
            lengths=state["lengths"] + (~stopped).astype(jnp.int32),
            stopped=stopped | is_stop,
        )

    def keep_going(state):
        return (state["step"] < steps) & ~jnp.all(state["stopped"])

    def decode_step(state):
        """Feeds the last drawn token (slot L + step - 1), then draws the next one."""
        slot_mask = state["slot_mask"].at[:, prompt_length + state["step"] - 1].set(1)
        logits, cache = forward(
            params,
            state["last_token"][:, None],
            attention_mask=slot_mask,
            cache=state["cache"],
            config=model_config,
        )
        return sample_step(dict(state, cache=cache, slot_mask=slot_mask), logits[:, 0])

    # Token 0 comes from the prefill's logits, so N tokens take N - 1 decode forwards.
    final = jax.lax.while_loop(keep_going, decode_step, sample_step(start, next_logits))
    lengths = final["lengths"]
    return Rollout(
        tokens=final["tokens"],
        mask=jnp.arange(steps)[None, :] < lengths[:, None],
        logprobs=final["logprobs"],
        lengths=lengths,
        truncated=~final["stopped"],
        group_ids=jnp.repeat(jnp.arange(prompts, dtype=jnp.int32), num_generations),
    )
