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
    temperature: float | jax.Array = 1.0,
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
    temperature: float | jax.Array = 1.0,
    chunk_size: int = 4096,
    keep_logits: bool = False,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array]:  # (f32[B, T], f32[B, T])
    """`token_logprobs(hidden @ unembedding, targets)` without building the logits.

    The vocabulary is processed about `chunk_size` columns at a time (an online logsumexp
    carries the running max, the normaliser and the entropy's sum), and the backward pass
    recomputes each chunk instead of storing it: temporary memory is O(B*T*chunk_size)
    instead of O(B*T*V). `keep_logits=True` trades that memory back for time: the forward
    pass under differentiation stores every chunk's f32 logits (B*T*V*4 bytes) and the
    backward pass reads them instead of repeating the chunk's product, with the same
    results to float rounding (a quarter fewer products in this head; its forward and
    backward at the compare workload's shapes took 2.2-2.3 against 2.6-2.8 s on CPU,
    docs/benchmarks.md). Without differentiation nothing is stored either way. Logits are
    accumulated in f32 whatever the input dtype. A table in a lower precision than the
    hidden states (bf16 for f32 ones, as `jgrpo.models.precision.with_matmul_weights` makes)
    rounds the hidden states to its dtype: every product, forward and backward, takes bf16
    operands and sums in f32.

    Chunks are strided (chunk j holds tokens j, j + n, j + 2n, ...), so a vocabulary axis
    sharded across devices stays evenly sharded inside every chunk. Each chunk is read as a
    block of rows of the [V, D] table (`unembedding.T`, free for a tied table), so no copy of
    the table is transposed or cut by columns: on CPU the forward and backward at the compare
    workload's shapes took 3.1 against 4.0 s (docs/benchmarks.md). An untied [D, V] head is
    transposed once per call.

    `temperature` may be an array, traced or differentiated, as for `token_logprobs` (a
    scalar, or [..., 1] for one per position): it then scales the hidden states before the
    products rather than the logits after them, equal up to float rounding.

    `softcap` c (Gemma 2's `final_logit_softcapping`) caps the logits before the
    temperature, z = c tanh(hidden @ unembedding / c) / temperature, as the model's own
    logits are capped before sampling; the temperature must then be a Python number.
    """
    _check_temperature(temperature)
    if softcap is not None and not isinstance(temperature, Real):
        raise ValueError(
            "a soft-capped head (softcap) takes a Python number as temperature: the cap "
            "comes before the temperature, which then cannot scale the hidden states."
        )
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
    if not isinstance(temperature, Real):
        # An array (traced under jit, or differentiated) cannot be the chunk loop's static
        # argument: it divides the hidden states instead, (h / tau) @ W = (h @ W) / tau up to
        # float rounding, and plain autodiff carries its gradient.
        hidden = hidden / jnp.asarray(temperature, jnp.float32)
        temperature = 1.0

    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # [N, D]
    flat_targets = targets.reshape(-1)  # [N]
    # Chunks are row blocks of the [V, D] table: a tied table's transpose (the caller's) cancels.
    table = unembedding.T  # [V, D]
    # The target logit is a gather of N rows: cheap, and plain autodiff handles it.
    target_rows = jnp.take(table, flat_targets, axis=0)  # [N, D]
    target_logits = jnp.einsum(  # a bf16 table rounds the hidden states too, as below
        "nd,nd->n",
        flat_hidden.astype(table.dtype),
        target_rows,
        preferred_element_type=jnp.float32,
    )
    target_logits = _soft_cap(target_logits.astype(jnp.float32), softcap) / temperature
    layout = _vocab_layout(table.shape[0], chunk_size)
    log_normaliser, entropy = _logsumexp_and_entropy(
        flat_hidden, table, (temperature, softcap), layout, keep_logits
    )  # [N], [N]
    logprobs = (target_logits - log_normaliser).reshape(targets.shape)
    return logprobs, entropy.reshape(targets.shape)


class _VocabLayout(NamedTuple):
    """The vocabulary as num_chunks strided chunks of `chunk` tokens (padded if needed)."""

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


_MASKED_LOGIT = -1e30  # padding rows: exp underflows to 0 and 0 * it stays finite


def _as_3d(table, layout):
    """[V, D] -> [chunk, num_chunks, D]: a free reshape (after padding, when needed)."""
    padding = layout.num_chunks * layout.chunk - layout.vocab
    if padding:
        table = jnp.pad(table, ((0, padding), (0, 0)))
    return table.reshape(layout.chunk, layout.num_chunks, table.shape[1])


def _chunk_rows(table_3d, index):
    """The [chunk, D] rows of the table that chunk `index` holds (tokens index, index + n, ...)."""
    return jax.lax.dynamic_index_in_dim(table_3d, index, axis=1, keepdims=False)


def _soft_cap(x, cap):
    return x if cap is None else cap * jnp.tanh(x / cap)


def _chunk_logits(operand, rows, index, scaling, layout):
    """Logits of chunk `index` as f32[N, chunk], from its `_chunk_rows`; `scaling` is
    (temperature, softcap)."""
    temperature, softcap = scaling
    if operand.dtype == jnp.float32:
        logits = _times_transposed(operand, rows)  # [N, chunk]
    else:  # XLA:CPU multiplies bf16 fast only untransposed: one [D, chunk] copy per chunk
        logits = jnp.dot(operand, _row_major(rows.T), preferred_element_type=jnp.float32)
    logits = _soft_cap(logits, softcap) / temperature
    if layout.num_chunks * layout.chunk != layout.vocab:
        vocab_ids = jnp.arange(layout.chunk) * layout.num_chunks + index  # [chunk]
        logits = jnp.where(vocab_ids < layout.vocab, logits, _MASKED_LOGIT)
    return logits


def _times_transposed(a, b):
    """a [N, D] @ b[M, D]^T -> f32[N, M]."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _logsumexp_and_entropy(hidden, table, scaling, layout, keep_logits):
    """(logsumexp_v z_v, -sum_v p_v log p_v) per row, z = softcap(hidden @ table^T) /
    temperature, `scaling` = (temperature, softcap)."""
    del keep_logits  # only the differentiated forward pass stores logits
    return _online_logsumexp_and_entropy(hidden, table, scaling, layout, keep=False)[:2]


def _online_logsumexp_and_entropy(hidden, table, scaling, layout, *, keep):
    """One pass over the chunks carrying, relative to the running max m of each row,
    s = sum exp(z - m) and w = sum exp(z - m) (z - m); then logsumexp = m + log s and
    entropy = log s - w / s (both from small numbers: no cancellation). With `keep`, also
    every chunk's logits, f32[num_chunks, N, chunk]; else None."""
    table_3d = _as_3d(table, layout)
    rows = hidden.shape[0]
    operand = hidden.astype(table.dtype)  # a bf16 table multiplies in bf16, f32 sums

    def body(carry, index):
        running_max, normaliser, weighted = carry  # [N] each
        rows = _chunk_rows(table_3d, index)  # [chunk, D]
        logits = _chunk_logits(operand, rows, index, scaling, layout)
        new_max = jnp.maximum(running_max, logits.max(axis=-1))
        shift = running_max - new_max  # <= 0
        rescale = jnp.exp(shift)
        shifted = logits - new_max[:, None]  # [N, chunk]
        exp_shifted = jnp.exp(shifted)
        weighted = rescale * (weighted + shift * normaliser) + (exp_shifted * shifted).sum(-1)
        normaliser = normaliser * rescale + exp_shifted.sum(axis=-1)
        return (new_max, normaliser, weighted), (logits if keep else None)

    start = (
        jnp.full((rows,), _MASKED_LOGIT, jnp.float32),  # finite: shift * 0 stays 0
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    (running_max, normaliser, weighted), kept = jax.lax.scan(
        body, start, jnp.arange(layout.num_chunks)
    )
    log_normaliser = running_max + jnp.log(normaliser)
    entropy = jnp.log(normaliser) - weighted / normaliser
    return log_normaliser, entropy, kept


def _logsumexp_and_entropy_fwd(hidden, table, scaling, layout, keep_logits):
    log_normaliser, entropy, kept = _online_logsumexp_and_entropy(
        hidden, table, scaling, layout, keep=keep_logits
    )
    return (log_normaliser, entropy), (hidden, table, log_normaliser, entropy, kept)


def _logsumexp_and_entropy_bwd(scaling, layout, keep_logits, residuals, cotangents):
    """Recomputes each chunk's logits (or reads the kept ones). With log p = z - logsumexp z
    and H the entropy: d logsumexp / dz = p;  dH / dz = -p (log p + H)."""
    temperature, softcap = scaling
    hidden, table, log_normaliser, entropy, kept = residuals
    grad_lse, grad_entropy = cotangents  # [N] each
    table_3d = _as_3d(table, layout)
    # A table in a lower precision than the hidden states (`with_matmul_weights`):
    # the backward's products too take operands in its dtype, untransposed (`mixed_matmul`).
    mixed = table.dtype != hidden.dtype
    operand = hidden.astype(table.dtype)

    def body(index, carry):
        grad_hidden, grad_table_3d = carry
        rows = _chunk_rows(table_3d, index)  # [chunk, D]
        if kept is None:
            logits = _chunk_logits(operand, rows, index, scaling, layout)
        else:
            logits = jax.lax.dynamic_index_in_dim(kept, index, keepdims=False)  # [N, chunk]
        log_probs = logits - log_normaliser[:, None]  # [N, chunk]
        grad_logits = jnp.exp(log_probs) * (
            grad_lse[:, None] - grad_entropy[:, None] * (log_probs + entropy[:, None])
        )
        grad_logits = grad_logits / temperature  # through z = softcap(hidden @ W^T) / temperature
        if softcap is not None:  # d c tanh(u / c) / du = 1 - tanh^2, tanh = z T / c
            tanh = jnp.clip(logits * (temperature / softcap), -1.0, 1.0)  # padding: -1
            grad_logits = grad_logits * (1 - jnp.square(tanh))
        if mixed:
            grad_low = grad_logits.astype(table.dtype)
            grad_hidden = grad_hidden + jnp.dot(grad_low, rows, preferred_element_type=jnp.float32)
            grad_rows = jnp.dot(  # [chunk, D]
                _row_major(grad_low.T), operand, preferred_element_type=jnp.float32
            )
        else:
            grad_hidden = grad_hidden + jnp.dot(grad_logits, rows.astype(jnp.float32))
            grad_rows = jax.lax.dot_general(  # grad_logits^T @ hidden, [chunk, D]
                grad_logits, hidden.astype(jnp.float32), (((0,), (0,)), ((), ()))
            )
        grad_table_3d = jax.lax.dynamic_update_index_in_dim(grad_table_3d, grad_rows, index, axis=1)
        return grad_hidden, grad_table_3d

    start = (
        jnp.zeros(hidden.shape, jnp.float32),
        jnp.zeros(table_3d.shape, jnp.float32),
    )
    grad_hidden, grad_table_3d = jax.lax.fori_loop(0, layout.num_chunks, body, start)
    grad_table = grad_table_3d.reshape(-1, table.shape[1])[: layout.vocab]
    return grad_hidden.astype(hidden.dtype), grad_table.astype(table.dtype)


_logsumexp_and_entropy.defvjp(_logsumexp_and_entropy_fwd, _logsumexp_and_entropy_bwd)


def _row_major(x: jax.Array) -> jax.Array:
    """x written out in row-major order on CPU (a transpose materialised, not folded into the
    next product, which XLA:CPU then runs in bf16 only untransposed); elsewhere unchanged.
    `jgrpo.models.precision.row_major` does the same: this module stays free of the model
    stack."""
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
