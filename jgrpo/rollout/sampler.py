"""Drawing one token per row: the sampling settings, the top-k / top-p / min-p filters, and the
inverse-CDF draw from one uniform per row, with the two log-probabilities every drawn token
gets.

`logprobs`: the policy's at temperature T, log_softmax(logits / T), which is what the trainer
recomputes with `jgrpo.token_logprobs(..., temperature=T)` (use the same temperature for both).
`sampler_logprobs`: under the distribution the token was really drawn from, the log_softmax of
logits / T over the tokens top-k / top-p / min-p kept (TRL asks vLLM for these "processed"
log-probs for its importance-sampling correction); without a filter the two are equal. Greedy
decoding (T = 0) reports log_softmax(logits) for both.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


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
