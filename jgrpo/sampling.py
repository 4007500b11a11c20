"""Group sampling as one compiled program: prefill each prompt once, decode its G rows against
that one prompt cache (`jgrpo.models.group_decode`) in a `jax.lax.while_loop` that stops when every
row has stopped: every row at once, or with `SamplingConfig.max_concurrent` in that many slots
that refill as rows stop (`decode_in_slots`).

Shapes: P prompts, G generations per prompt, L (bucketed) prompt length, N new tokens,
V vocabulary. Rows are ordered prompt-major: row p * G + g.

Each token gets two log-probabilities. `logprobs`: the policy's at temperature T,
log_softmax(logits / T), which is what the trainer recomputes with
`jgrpo.token_logprobs(..., temperature=T)` (use the same temperature for both).
`sampler_logprobs`: under the distribution the token was really drawn from, the log_softmax of
logits / T over the tokens top-k / top-p / min-p kept (TRL asks vLLM for these "processed"
log-probs for its importance-sampling correction); without a filter the two are equal. Greedy
decoding (T = 0) reports log_softmax(logits) for both.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jgrpo.models.config import ModelConfig
from jgrpo.models.group_decode import (
    cache_bytes_per_slot,
    completion_cache_bytes,
    decode_layers,
    decode_logits,
    decode_rope_tables,
    decode_step,
    grow_completion_cache,
    prefill,
    unembedding_rows,
)
from jgrpo.models.transformer import logits_from_hidden, with_matmul_unembedding
from jgrpo.sharding import traced_shard_count


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
    weights_dtype: str = "float32"  # "bfloat16": bf16 weight matrices, f32 sums (see rollout)
    max_concurrent: int = 0  # sequences decoding at once, in refilled slots; 0 = every row

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
        if not isinstance(self.max_concurrent, int) or self.max_concurrent < 0:
            raise ValueError(
                f"max_concurrent must be an int >= 0 (0 = every row at once), got "
                f"{self.max_concurrent!r}."
            )
        if self.weights_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"weights_dtype must be 'float32' or 'bfloat16', got {self.weights_dtype!r}."
            )
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def filters(self) -> bool:
        """Whether top-k, top-p or min-p narrows the distribution tokens are drawn from
        (greedy decoding, T = 0, ignores them)."""
        filtered = self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0
        return self.temperature > 0 and filtered


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


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """One draw per row from softmax(logits [B, V]): int32[B]. See `inverse_cdf_sample`."""
    return inverse_cdf_sample(jax.random.uniform(key, logits.shape[:1]), logits)[0]


def inverse_cdf_sample(
    uniform: jax.Array, logits: jax.Array
) -> tuple[jax.Array, jax.Array]:  # (int32[B], f32[B])
    """The token whose CDF interval under softmax(logits [B, V]) holds uniform [B], and
    logsumexp(logits) per row (the normaliser of that CDF, which it sums anyway), so the
    drawn token's log-prob is logits[token] - logsumexp without another pass over [B, V].

    One uniform per row where `jax.random.categorical` needs B * V Gumbels (on CPU those cost
    more than a decoder step). The CDF is inverted in two levels, over blocks of `block`
    tokens and then inside the chosen block, so no length-V cumulative sum is built (XLA on
    CPU computes a cumulative sum in time quadratic in its length); blocks of about sqrt(V)
    tokens keep both levels short. Tokens of probability 0 (logits -inf) are never drawn,
    whatever the rounding.
    """
    rows, vocab = logits.shape
    block = 1 << max(0, math.ceil(math.log2(vocab) / 2))  # the power of two >= sqrt(V)
    top = jnp.max(logits, axis=-1, keepdims=True)  # [B, 1]
    weights = jnp.exp(logits - top)  # [B, V], 0 for -inf
    weights = jnp.pad(weights, ((0, 0), (0, -vocab % block))).reshape(rows, -1, block)
    block_mass = weights.sum(-1)  # [B, V/block]
    block_end = jnp.cumsum(block_mass, axis=-1)
    target = uniform * block_end[:, -1]  # [B], in [0, total)
    chosen_block = _first_above(block_end, target, block_mass > 0)  # [B]
    in_block = jnp.take_along_axis(weights, chosen_block[:, None, None], axis=1)[:, 0]
    block_start = jnp.take_along_axis(block_end - block_mass, chosen_block[:, None], axis=1)
    offset = _first_above(jnp.cumsum(in_block, axis=-1), target - block_start[:, 0], in_block > 0)
    log_normaliser = top[:, 0] + jnp.log(block_end[:, -1])  # [B] logsumexp(logits)
    return (chosen_block * block + offset).astype(jnp.int32), log_normaliser


def _first_above(cumulative: jax.Array, target: jax.Array, positive: jax.Array) -> jax.Array:
    """Per row, the first index with positive mass whose cumulative mass exceeds the target;
    the last positive one if rounding left the target at or above the total."""
    hit = positive & (cumulative > target[:, None])  # [B, n]
    last_positive = positive.shape[-1] - 1 - jnp.argmax(positive[:, ::-1], axis=-1)
    return jnp.where(hit.any(-1), jnp.argmax(hit, axis=-1), last_positive)


def sample_tokens(
    logits: jax.Array,  # f32[B, V]
    uniform: jax.Array,  # f32[B] in [0, 1): the randomness of this draw
    sampling: SamplingConfig,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (int32[B], f32[B], f32[B])
    """Draws one token y per row from the filtered softmax(logits / T); returns y, its
    log-prob under the policy and under the distribution it was drawn from:

        z = logits / T,   K = the tokens top-k / top-p / min-p keep (y is always in K)
        logprob         = z_y - logsumexp_{v} z_v          (log_softmax(z), the policy)
        sampler_logprob = z_y - logsumexp_{v in K} z_v     (log_softmax over K, the sampler)

    The sampler's normaliser comes with the draw; the policy's costs one more reduction over
    [B, V] only when a filter is on (without one K is every token and the two are equal).
    Greedy decoding (T = 0) gives log_softmax(logits)[y] for both.
    """
    if sampling.temperature == 0:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        chosen = jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]
        return tokens, chosen, chosen
    scaled = logits / sampling.temperature  # [B, V]
    kept = filter_logits(scaled, top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p)
    tokens, kept_normaliser = inverse_cdf_sample(uniform, kept)
    chosen = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0]  # z_y
    sampler_logprob = chosen - kept_normaliser
    if not sampling.filters:
        return tokens, sampler_logprob, sampler_logprob
    return tokens, chosen - jax.nn.logsumexp(scaled, axis=-1), sampler_logprob


# Completions at least this long decode in phases of growing attention windows, provided
# the completion caches one device holds (its rows' keys and values, every layer) take at
# least PHASED_DECODE_MIN_CACHE_BYTES: below that, attention is too small a share of a decode
# step to repay compiling a copy of the step per phase (docs/benchmarks.md: the compare workload's
# 94 MB cache sampled 6% faster in four phases; the tests' tiny model's 1 MB no faster, for
# 1.2-2.2 s more compile).
PHASED_DECODE_MIN_TOKENS = 64
PHASED_DECODE_MIN_CACHE_BYTES = 16 * 2**20
_PHASES = 4
_PHASE_MULTIPLE = 8  # phase ends are multiples of this many completion slots


def attention_phases(max_new_tokens: int, cache_bytes: int | None = None) -> list[int]:
    """Ends of the decode loop's phases, in completion slots; the last is `max_new_tokens`.

    A decode step attends to every slot of its completion buffers, written or not; with the
    loop in four phases whose buffers hold only the slots written by the phase's end, a
    rollout reads about 5/8 of the slots one phase would. Each phase compiles its own copy
    of the decode step, so short completions and small completion caches (`cache_bytes`,
    when given), where attention is a small part of a step, decode in one phase.
    """
    small_cache = cache_bytes is not None and cache_bytes < PHASED_DECODE_MIN_CACHE_BYTES
    if max_new_tokens < PHASED_DECODE_MIN_TOKENS or small_cache:
        return [max_new_tokens]
    size = -(-max_new_tokens // _PHASES)
    size = -(-size // _PHASE_MULTIPLE) * _PHASE_MULTIPLE
    return [*range(size, max_new_tokens, size), max_new_tokens]


def kv_cache_bytes(
    rows: int, slots: int, config: ModelConfig, dtype, *, completion: bool = False
) -> int:
    """Bytes of KV cache (`rows` rows of `slots` slots, every layer's keys and values) that
    one device holds; `completion`: completion caches, whose sliding layers keep their
    window's slots only (`completion_cache_bytes`), rather than prompt caches. Under a mesh
    and logical rules (`jgrpo.sharding.rules_context`) the caches split as
    `jgrpo.models.group_decode` places them: rows over the batch axes and kv heads over
    `tensor`, where those axes divide them. Used by the rollout (while tracing) and the
    memory plan."""
    if completion:
        total = rows * completion_cache_bytes(config, slots, dtype)
    else:
        total = rows * slots * cache_bytes_per_slot(config, dtype)
    return total // traced_shard_count((rows, config.num_kv_heads), ("batch", "kv_heads"))


def concurrent_rows(max_concurrent: int, rows: int) -> int | None:
    """The slots a rollout of `rows` sequences decodes in (`SamplingConfig.max_concurrent`):
    None when every row decodes at once (0, or at least `rows`)."""
    return max_concurrent if 0 < max_concurrent < rows else None


def decode_in_slots(
    first: dict,
    feed,
    uniforms: jax.Array,  # f32[N, P*G]: the uniform of token t of row r is uniforms[t, r]
    *,
    slots: int,
    num_generations: int,
    stop_ids: jax.Array,
    sampling: SamplingConfig,
    stop_after: jax.Array | None = None,
) -> dict:
    """Decodes the rows of `first` (the rollout's state after every row drew its first token
    from the prefill) in `slots` refilled slots, on device: when a row stops, the next row
    still to decode (in row order) takes its slot at once, at completion position 0.

    `feed(cache, tokens [S], slot [S], prompt_rows [S])` runs one decode step of the slots
    (each at its own completion position, reading its prompt from the shared prompt table)
    and returns their logits [S, V] and the cache. A row's token t is drawn with
    uniforms[t, row], as in the all-rows loop, so its tokens and log-probs depend on the seed,
    the prompt and the row, not on the slot that ran it or on how many slots there are.
    `stop_after` is `rollout`'s (benchmarks only).
    Returns `first` with every row's record filled in, and `finished_at`: the decode step
    after which each row drew its last token.
    """
    rows, steps = first["tokens"].shape
    idle = rows  # a slot's row index when it has none: scatters to it are dropped
    pending = ~first["stopped"] & (steps > 1)  # rows that need decode steps
    order = jnp.argsort(~pending, stable=True).astype(jnp.int32)  # those first, in row order
    count = pending.sum(dtype=jnp.int32)
    slot_index = jnp.arange(slots, dtype=jnp.int32)
    row = jnp.where(slot_index < count, order[:slots], idle)
    state = dict(
        first,
        row=row,  # int32[S]: the row each slot decodes
        drawn=jnp.ones((slots,), jnp.int32),  # tokens the slot's row has drawn
        slot_token=jnp.take(first["last_token"], jnp.minimum(row, rows - 1)),
        next_pending=jnp.minimum(count, slots),  # index into `order` of the next row to start
        decode_step=jnp.zeros((), jnp.int32),
        finished_at=jnp.zeros((rows,), jnp.int32),
    )

    def one_step(state):
        row, drawn = state["row"], state["drawn"]
        active = row < idle
        safe_row = jnp.minimum(row, rows - 1)
        logits, cache = feed(
            state["cache"], state["slot_token"], drawn - 1, safe_row // num_generations
        )
        uniform = uniforms[jnp.minimum(drawn, steps - 1), safe_row]  # [S]
        token, logprob, sampler_logprob = sample_tokens(logits, uniform, sampling)
        if stop_after is not None:  # benchmarks: the row's chosen length
            token = jnp.where(drawn + 1 >= stop_after[safe_row], stop_ids[0], token)
        column = jnp.minimum(drawn, steps - 1)
        written = dict(
            tokens=state["tokens"].at[row, column].set(token, mode="drop"),
            logprobs=state["logprobs"].at[row, column].set(logprob, mode="drop"),
        )
        if sampling.filters:
            sampler = state["sampler_logprobs"].at[row, column].set(sampler_logprob, mode="drop")
            written["sampler_logprobs"] = sampler
        drawn = drawn + 1
        is_stop = jnp.isin(token, stop_ids)
        done = active & (is_stop | (drawn >= steps))
        finished = jnp.where(done, row, idle)
        decode_step = state["decode_step"] + 1
        # The next pending rows take the finished slots, in slot order.
        start = state["next_pending"] + jnp.cumsum(done, dtype=jnp.int32) - 1
        refill = jnp.where(start < count, order[jnp.minimum(start, rows - 1)], idle)
        new_row = jnp.where(done, refill, row)
        first_token = jnp.take(state["last_token"], jnp.minimum(new_row, rows - 1))
        return dict(
            state,
            **written,
            cache=cache,
            lengths=state["lengths"].at[finished].set(drawn, mode="drop"),
            stopped=state["stopped"].at[finished].set(is_stop, mode="drop"),
            finished_at=state["finished_at"].at[finished].set(decode_step, mode="drop"),
            row=new_row,
            drawn=jnp.where(done, 1, drawn),
            slot_token=jnp.where(done, first_token, token),
            next_pending=jnp.minimum(state["next_pending"] + done.sum(dtype=jnp.int32), count),
            decode_step=decode_step,
        )

    final = jax.lax.while_loop(lambda state: jnp.any(state["row"] < idle), one_step, state)
    return {name: final[name] for name in first} | {"finished_at": final["finished_at"]}


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
    [P*G, N] record (`sample_tokens`).

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
    `jgrpo.models.transformer.with_matmul_weights` (the update scores them with the f32
    parameters). The cast is fused into the passes that read the f32 weights anyway: the
    decode layout (`decode_layers`, once per rollout) and the prefill's layer loop
    (`forward(..., matmul_dtype=...)`, a layer at a time); a cast stacked copy cost XLA:CPU
    two more passes over the weights (2-4% of a bf16 rollout of the compare workload).
    """
    prompts = prompt_ids.shape[0]
    rows, steps = prompts * num_generations, sampling.max_new_tokens
    matmul_dtype = None
    if sampling.weights_dtype != "float32":
        matmul_dtype = jnp.dtype(sampling.weights_dtype)
        params = with_matmul_unembedding(params, matmul_dtype)

    softcap = model_config.final_logit_softcapping  # Gemma 2 caps its logits
    # Prefill: P rows; the G rows of a prompt share its cache and start from its last logits.
    slots = concurrent_rows(sampling.max_concurrent, rows)  # None: every row at once
    cache_bytes = kv_cache_bytes(rows, steps, model_config, params["embed"].dtype, completion=True)
    # one device's completion caches decide; slots hold whole completions from the start
    phases = attention_phases(steps, cache_bytes) if slots is None else [steps]
    hidden, cache = prefill(
        params,
        prompt_ids,
        prompt_mask,
        config=model_config,
        num_generations=num_generations,
        max_new_tokens=phases[0],  # completion slots of the first phase
        matmul_dtype=matmul_dtype,
        completion_rows=slots,
    )
    next_logits = jnp.repeat(
        logits_from_hidden(params, hidden, softcap),
        num_generations,
        axis=0,
    )
    prompt_lengths = jnp.repeat(prompt_mask.astype(jnp.int32).sum(-1), num_generations)  # [P*G]
    layers = decode_layers(params, model_config, matmul_dtype)
    # RoPE tables of every position a row reaches (prompt slots, then completion slots).
    rope = decode_rope_tables(model_config, prompt_ids.shape[1] + steps)  # by layer kind
    unembedding = unembedding_rows(params)  # [V, E]

    # All the randomness up front: the loop body then holds no random-bit generator.
    uniforms = jax.random.uniform(key, (steps, rows))  # [N, P*G]
    stop_ids = jnp.asarray(sampling.stop_token_ids, jnp.int32)
    start = dict(
        step=jnp.zeros((), jnp.int32),
        cache=cache,
        last_token=jnp.zeros((rows,), jnp.int32),
        tokens=jnp.full((rows, steps), sampling.pad_token_id, jnp.int32),
        logprobs=jnp.zeros((rows, steps), jnp.float32),
        lengths=jnp.zeros((rows,), jnp.int32),
        stopped=jnp.zeros((rows,), bool),
    )
    if sampling.filters:  # the sampler's log-probs differ from the policy's: keep both
        start["sampler_logprobs"] = jnp.zeros((rows, steps), jnp.float32)

    def sample_step(state, logits):  # logits f32[P*G, V] for the token at state["step"]
        step, stopped = state["step"], state["stopped"]
        token, logprob, sampler_logprob = sample_tokens(logits, uniforms[step], sampling)
        if stop_after is not None:
            token = jnp.where(step + 1 >= stop_after, stop_ids[0], token)
        token = jnp.where(stopped, sampling.pad_token_id, token)
        is_stop = jnp.isin(token, stop_ids) & ~stopped
        state = dict(
            state,
            step=step + 1,
            last_token=token,
            tokens=state["tokens"].at[:, step].set(token),
            logprobs=state["logprobs"].at[:, step].set(jnp.where(stopped, 0.0, logprob)),
            lengths=state["lengths"] + (~stopped).astype(jnp.int32),
            stopped=stopped | is_stop,
        )
        if sampling.filters:
            sampler_logprob = jnp.where(stopped, 0.0, sampler_logprob)
            state["sampler_logprobs"] = state["sampler_logprobs"].at[:, step].set(sampler_logprob)
        return state

    def keep_going(state):
        return (state["step"] < steps) & ~jnp.all(state["stopped"])

    def decode_step_and_sample(state):
        """Feeds the last drawn token (completion slot step - 1), then draws the next one."""
        slot = state["step"] - 1
        hidden, cache = decode_step(
            params,
            layers,
            state["cache"],
            state["last_token"],
            prompt_lengths + slot,
            slot,
            prompt_mask,
            rope=rope,
            config=model_config,
        )
        logits = decode_logits(unembedding, hidden, softcap)  # [P*G, V]
        return sample_step(dict(state, cache=cache), logits)

    # Token 0 comes from the prefill's logits, so N tokens take N - 1 decode forwards. The
    # step at state["step"] = s writes completion slot s - 1, so a phase whose buffers hold
    # `end` slots runs the steps s <= end (`attention_phases`).
    final = sample_step(start, next_logits)
    if slots is not None:

        def feed(cache, tokens, slot, prompt_rows):  # -> (logits f32[S, V], cache)
            positions = jnp.take(prompt_lengths, prompt_rows * num_generations) + slot
            hidden, cache = decode_step(
                params,
                layers,
                cache,
                tokens,
                positions,
                slot,
                prompt_mask,
                rope=rope,
                config=model_config,
                prompt_rows=prompt_rows,
            )
            return decode_logits(unembedding, hidden, softcap), cache

        final = decode_in_slots(
            final,
            feed,
            uniforms,
            slots=slots,
            num_generations=num_generations,
            stop_ids=stop_ids,
            sampling=sampling,
            stop_after=stop_after,
        )
    for end in phases if slots is None else ():
        final = jax.lax.while_loop(
            lambda state, end=end: keep_going(state) & (state["step"] <= end),
            decode_step_and_sample,
            dict(final, cache=grow_completion_cache(final["cache"], end, model_config)),
        )
    lengths = final["lengths"]
    return Rollout(
        tokens=final["tokens"],
        mask=jnp.arange(steps)[None, :] < lengths[:, None],
        logprobs=final["logprobs"],
        sampler_logprobs=final.get("sampler_logprobs", final["logprobs"]),
        lengths=lengths,
        truncated=~final["stopped"],
        group_ids=jnp.repeat(jnp.arange(prompts, dtype=jnp.int32), num_generations),
        finished_at=final.get("finished_at", lengths - 1),
    )
