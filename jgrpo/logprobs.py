"""Log-probabilities and entropy of sampled tokens, from logits or from final hidden states.

The policy is sampled from softmax(logits / temperature), so the trainer must score tokens
with the same temperature: pass the sampling temperature here.

`chunked_token_logprobs` starts from the final hidden states and the unembedding matrix and
walks the vocabulary in chunks with an online logsumexp, recomputing each chunk in the
backward pass, so the [B, T, V] logits (the largest activation of a training step) are
never materialised.
"""

from __future__ import annotations

import functools
import math
from numbers import Real
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

from jgrpo._checks import check_shape


def token_logprobs(
    logits: jax.Array,  # [B, T, V], any float dtype
    targets: jax.Array,  # int[B, T]
    *,
    temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array]:  # (f32[B, T], f32[B, T])
    """Log-prob of each target token and the entropy of each position's distribution.

        z = logits / temperature        (in f32, whatever the logits dtype)
        logprobs_t = z_t[targets_t] - logsumexp(z_t)
        entropy_t  = -sum_v p_t,v log p_t,v,   p_t = softmax(z_t)

    Leading dimensions are free: logits [..., V] with targets [...].
    """
    _check_temperature(temperature)
    check_shape("targets", targets, shape=logits.shape[:-1])
    _check_integer("targets", targets)
    scaled = logits.astype(jnp.float32) / temperature  # [B, T, V]
    log_probs = jax.nn.log_softmax(scaled, axis=-1)  # [B, T, V]
    # -sum p log p on normalised log-probs: no cancellation between two large numbers.
    entropy = -(jnp.exp(log_probs) * log_probs).sum(axis=-1)
    return jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0], entropy


def chunked_token_logprobs(
    hidden: jax.Array,  # [B, T, D] final hidden states (after the last norm)
    unembedding: jax.Array,  # [D, V] (a tied embedding table [V, D] is passed transposed)
    targets: jax.Array,  # int[B, T]
    *,
    temperature: float = 1.0,
    chunk_size: int = 4096,
) -> tuple[jax.Array, jax.Array]:  # (f32[B, T], f32[B, T])
    """`token_logprobs(hidden @ unembedding, targets)` without building the logits.

    The vocabulary is processed about `chunk_size` columns at a time (an online logsumexp
    carries the running max, the normaliser and the entropy's sum), and the backward pass
    recomputes each chunk instead of storing it: temporary memory is O(B*T*chunk_size)
    instead of O(B*T*V). Logits are accumulated in f32 whatever the input dtype. A table in
    a lower precision than the hidden states (bf16 for f32 ones, as
    `models.transformer.with_matmul_weights` makes) rounds the hidden states to its dtype:
    every product, forward and backward, takes bf16 operands and sums in f32.

    Chunks are strided (chunk j holds columns j, j + n, j + 2n, ...), so a vocabulary axis
    sharded across devices stays evenly sharded inside every chunk.
    """
    _check_temperature(temperature)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}.")
    check_shape("unembedding", unembedding, ndim=2)
    if hidden.shape[-1] != unembedding.shape[0]:
        raise ValueError(
            f"hidden's last dimension ({hidden.shape[-1]}) must equal unembedding's first "
            f"({unembedding.shape[0]}): unembedding is [D, V]; pass a [V, D] embedding "
            "table transposed."
        )
    check_shape("targets", targets, shape=hidden.shape[:-1])
    _check_integer("targets", targets)

    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # [N, D]
    flat_targets = targets.reshape(-1)  # [N]
    # The target logit is a gather of N columns: cheap, and plain autodiff handles it.
    target_columns = jnp.take(unembedding, flat_targets, axis=1).T  # [N, D]
    target_logits = jnp.einsum(  # a bf16 table rounds the hidden states too, as below
        "nd,nd->n",
        flat_hidden.astype(unembedding.dtype),
        target_columns,
        preferred_element_type=jnp.float32,
    )
    target_logits = target_logits.astype(jnp.float32) / temperature
    layout = _vocab_layout(unembedding.shape[1], chunk_size)
    log_normaliser, entropy = _logsumexp_and_entropy(
        flat_hidden, unembedding, temperature, layout
    )  # [N], [N]
    logprobs = (target_logits - log_normaliser).reshape(targets.shape)
    return logprobs, entropy.reshape(targets.shape)


class _VocabLayout(NamedTuple):
    """The vocabulary as num_chunks strided chunks of `chunk` columns (padded if needed)."""

    vocab: int
    num_chunks: int
    chunk: int


def _vocab_layout(vocab: int, chunk_size: int) -> _VocabLayout:
    """Chunk count that divides the vocabulary when a divisor gives chunks near chunk_size.

    A divisor avoids padding (and so copying) the unembedding matrix. When the vocabulary
    has none that keeps chunks at least half of chunk_size, it is padded instead.
    """
    target = min(chunk_size, vocab)
    fewest = math.ceil(vocab / target)
    for num_chunks in range(fewest, 2 * fewest + 1):
        if vocab % num_chunks == 0:
            return _VocabLayout(vocab, num_chunks, vocab // num_chunks)
    return _VocabLayout(vocab, fewest, math.ceil(vocab / fewest))


_MASKED_LOGIT = -1e30  # padding columns: exp underflows to 0 and 0 * it stays finite


def _chunk_logits(hidden, unembedding_3d, index, temperature, layout):
    """Logits of chunk `index`: columns index, index + n, ... as f32[N, chunk]."""
    columns = jax.lax.dynamic_index_in_dim(unembedding_3d, index, axis=2, keepdims=False)
    logits = jnp.dot(hidden, columns, preferred_element_type=jnp.float32) / temperature
    if layout.num_chunks * layout.chunk != layout.vocab:
        vocab_ids = jnp.arange(layout.chunk) * layout.num_chunks + index  # [chunk]
        logits = jnp.where(vocab_ids < layout.vocab, logits, _MASKED_LOGIT)
    return logits, columns


def _as_3d(unembedding, layout):
    """[D, V] -> [D, chunk, num_chunks]: a free reshape (after padding, when needed)."""
    padding = layout.num_chunks * layout.chunk - layout.vocab
    if padding:
        unembedding = jnp.pad(unembedding, ((0, 0), (0, padding)))
    return unembedding.reshape(unembedding.shape[0], layout.chunk, layout.num_chunks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _logsumexp_and_entropy(hidden, unembedding, temperature, layout):
    """(logsumexp_v z_v, -sum_v p_v log p_v) per row, z = hidden @ unembedding / temperature."""
    return _logsumexp_and_entropy_fwd(hidden, unembedding, temperature, layout)[0]


def _logsumexp_and_entropy_fwd(hidden, unembedding, temperature, layout):
    """One pass over the chunks carrying, relative to the running max m of each row,
    s = sum exp(z - m) and w = sum exp(z - m) (z - m); then logsumexp = m + log s and
    entropy = log s - w / s (both from small numbers: no cancellation)."""
    unembedding_3d = _as_3d(unembedding, layout)
    rows = hidden.shape[0]
    operand = hidden.astype(unembedding.dtype)  # a bf16 table multiplies in bf16, f32 sums

    def body(index, carry):
        running_max, normaliser, weighted = carry  # [N] each
        logits, _ = _chunk_logits(operand, unembedding_3d, index, temperature, layout)
        new_max = jnp.maximum(running_max, logits.max(axis=-1))
        shift = running_max - new_max  # <= 0
        rescale = jnp.exp(shift)
        shifted = logits - new_max[:, None]  # [N, chunk]
        exp_shifted = jnp.exp(shifted)
        weighted = rescale * (weighted + shift * normaliser) + (exp_shifted * shifted).sum(-1)
        normaliser = normaliser * rescale + exp_shifted.sum(axis=-1)
        return new_max, normaliser, weighted

    start = (
        jnp.full((rows,), _MASKED_LOGIT, jnp.float32),  # finite: shift * 0 stays 0
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    running_max, normaliser, weighted = jax.lax.fori_loop(0, layout.num_chunks, body, start)
    log_normaliser = running_max + jnp.log(normaliser)
    entropy = jnp.log(normaliser) - weighted / normaliser
    return (log_normaliser, entropy), (hidden, unembedding, log_normaliser, entropy)


def _logsumexp_and_entropy_bwd(temperature, layout, residuals, cotangents):
    """Recomputes each chunk. With log p = z - logsumexp z and H the entropy:
    d logsumexp / dz = p;  dH / dz = -p (log p + H)."""
    hidden, unembedding, log_normaliser, entropy = residuals
    grad_lse, grad_entropy = cotangents  # [N] each
    unembedding_3d = _as_3d(unembedding, layout)
    # A table in a lower precision than the hidden states (`with_matmul_weights`):
    # the backward's products too take operands in its dtype, untransposed (`mixed_matmul`).
    mixed = unembedding.dtype != hidden.dtype
    operand = hidden.astype(unembedding.dtype)
    operand_t = _row_major(operand.T) if mixed else None  # [D, N]

    def body(index, carry):
        grad_hidden, grad_unembedding_3d = carry
        logits, columns = _chunk_logits(operand, unembedding_3d, index, temperature, layout)
        log_probs = logits - log_normaliser[:, None]  # [N, chunk]
        grad_logits = jnp.exp(log_probs) * (
            grad_lse[:, None] - grad_entropy[:, None] * (log_probs + entropy[:, None])
        )
        grad_logits = grad_logits / temperature  # through z = hidden @ W / temperature
        if mixed:
            grad_low = grad_logits.astype(unembedding.dtype)
            grad_hidden = grad_hidden + jnp.dot(
                grad_low, _row_major(columns.T), preferred_element_type=jnp.float32
            )
            grad_columns = jnp.dot(operand_t, grad_low, preferred_element_type=jnp.float32)
        else:
            grad_hidden = grad_hidden + jnp.dot(grad_logits, columns.astype(jnp.float32).T)
            grad_columns = jnp.dot(hidden.astype(jnp.float32).T, grad_logits)  # [D, chunk]
        grad_unembedding_3d = jax.lax.dynamic_update_index_in_dim(
            grad_unembedding_3d, grad_columns, index, axis=2
        )
        return grad_hidden, grad_unembedding_3d

    start = (
        jnp.zeros(hidden.shape, jnp.float32),
        jnp.zeros(unembedding_3d.shape, jnp.float32),
    )
    grad_hidden, grad_unembedding_3d = jax.lax.fori_loop(0, layout.num_chunks, body, start)
    grad_unembedding = grad_unembedding_3d.reshape(unembedding.shape[0], -1)
    grad_unembedding = grad_unembedding[:, : layout.vocab]
    return grad_hidden.astype(hidden.dtype), grad_unembedding.astype(unembedding.dtype)


_logsumexp_and_entropy.defvjp(_logsumexp_and_entropy_fwd, _logsumexp_and_entropy_bwd)


def _row_major(x: jax.Array) -> jax.Array:
    """x written out in row-major order on CPU (a transpose materialised, not folded into the
    next product, which XLA:CPU then runs in bf16 only untransposed); elsewhere unchanged.
    `models.transformer.row_major` does the same: this module stays free of the model stack."""
    if jax.default_backend() != "cpu":
        return x
    return with_layout_constraint(x, Layout(major_to_minor=tuple(range(x.ndim))))


def _check_temperature(temperature) -> None:
    if isinstance(temperature, Real) and not temperature > 0:
        raise ValueError(
            f"temperature must be > 0 (use the sampling temperature; greedy decoding has no "
            f"log-probs to train on), got {temperature}."
        )


def _check_integer(name: str, array) -> None:
    if not jnp.issubdtype(array.dtype, jnp.integer):
        raise ValueError(f"{name} must hold integer token ids, got dtype {array.dtype}.")
