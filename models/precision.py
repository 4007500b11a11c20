"""Lower precision: weight matrices cast for bf16 products with f32 sums (`mixed_matmul` and its
custom VJP), and the writes and layouts that keep narrow buffers fast on XLA:CPU.

Dimension letters in shape comments as in `jgrpo.models.transformer`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint


def with_matmul_weights(params: dict, dtype) -> dict:
    """`params` with its weight matrices in `dtype`: the layers' kernels, and the output
    projection (`lm_head`, or for tied embeddings a copy of the [V, E] table as
    `tied_unembedding`, since the lookup keeps the original's dtype); embeddings, norms and
    biases keep theirs.

    `project`, `logits_from_hidden` and `jgrpo.chunked_token_logprobs` multiply f32
    activations by such weights in `dtype`, accumulating in f32: at bf16 that halves the
    bytes a decode step reads, and under `jax.grad` (the cast differentiates back to the
    f32 parameters) it is mixed-precision training (`jgrpo.UpdateConfig.matmul_dtype`).
    """
    out = with_matmul_unembedding(params, dtype)
    out["layers"] = matmul_kernels(params["layers"], dtype)
    return out


def with_rounded_weights(params: dict, dtype) -> dict:
    """`params` with every weight matrix and the embedding table in `dtype`, norms and biases
    as they were: a frozen model in about half the memory at bf16 (the KL's reference,
    `model.reference_dtype`). The forward pass reads the table's rows back in the norms'
    dtype and multiplies its activations by the rounded matrices with f32 sums, as with
    `with_matmul_weights`, whose values it equals but for the rounded embeddings."""
    out = dict(params, embed=params["embed"].astype(dtype))
    if "lm_head" in params:
        out["lm_head"] = params["lm_head"].astype(dtype)
    out["layers"] = matmul_kernels(params["layers"], dtype)
    return out


def with_matmul_unembedding(params: dict, dtype) -> dict:
    """`params` with only the output projection in `dtype` (`with_matmul_weights`)."""
    out = dict(params)
    if "lm_head" in params:
        out["lm_head"] = params["lm_head"].astype(dtype)
    else:
        out["tied_unembedding"] = params["embed"].astype(dtype)
    return out


def matmul_kernels(layer_params: dict, dtype) -> dict:
    """Layer parameters (stacked or one layer's) with the weight matrices in `dtype`."""
    return {
        name: value.astype(dtype) if name.endswith("_kernel") else value
        for name, value in layer_params.items()
    }


@jax.custom_vjp
def mixed_matmul(a: jax.Array, b: jax.Array) -> jax.Array:  # [N, I] x [I, O] -> f32[N, O]
    """a @ b with both operands rounded to the lower-precision dtype of the two (bf16), every
    product summed in f32; the backward pass likewise (the cotangent rounded to it too).

    Used when a kernel's dtype differs from its activations' (`with_matmul_weights`). The
    custom VJP keeps the backward products in that dtype: differentiating the forward's dot
    would multiply f32 cotangents by bf16 operands, which runs in f32. On CPU it also
    materialises the transposed operands in row-major order (`row_major`): XLA:CPU's fast
    bf16 products (YNNPACK; AMX where the CPU has it) take only untransposed operands and
    otherwise fall back to f32, about 3-6x slower on an AMX host.
    """
    dtype = _lower_precision(a, b)
    return jnp.dot(a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


def _mixed_matmul_fwd(a, b):
    return mixed_matmul(a, b), (a, b)


def _mixed_matmul_bwd(residuals, grad):  # grad f32[N, O]
    a, b = residuals
    dtype = _lower_precision(a, b)
    a_low, b_low, grad_low = a.astype(dtype), b.astype(dtype), grad.astype(dtype)
    grad_a = jnp.dot(grad_low, row_major(b_low.T), preferred_element_type=jnp.float32)  # [N, I]
    # a^T g, never (g^T a)^T: XLA folds a transposed result back into the product's operands.
    grad_b = jnp.dot(row_major(a_low.T), grad_low, preferred_element_type=jnp.float32)  # [I, O]
    return grad_a.astype(a.dtype), grad_b.astype(b.dtype)


mixed_matmul.defvjp(_mixed_matmul_fwd, _mixed_matmul_bwd)


def _lower_precision(*arrays: jax.Array):
    """The dtype with the fewest bits among the arrays'."""
    return min((x.dtype for x in arrays), key=lambda dtype: jnp.finfo(dtype).bits)


def write_slice(buffer: jax.Array, update: jax.Array, start: tuple) -> jax.Array:
    """`jax.lax.dynamic_update_slice(buffer, update cast to buffer's dtype, start)`, in place.

    A buffer narrower than 32 bits (a bf16 KV cache) is written through its bits: XLA:CPU
    otherwise widens the whole buffer to f32 around the update and narrows it back, two
    full copies of the cache for every token written, which made long bf16 rollouts
    quadratic in their length.
    """
    update = update.astype(buffer.dtype)
    if buffer.dtype.itemsize >= 4:
        return jax.lax.dynamic_update_slice(buffer, update, start)
    bits = jnp.dtype(f"uint{8 * buffer.dtype.itemsize}")
    written = jax.lax.dynamic_update_slice(
        jax.lax.bitcast_convert_type(buffer, bits),
        jax.lax.bitcast_convert_type(update, bits),
        start,
    )
    return jax.lax.bitcast_convert_type(written, buffer.dtype)


def row_major(x: jax.Array) -> jax.Array:
    """x stored in row-major order (on CPU), so that XLA multiplies a transpose written in
    memory rather than folding it into the product's dimensions. Elsewhere x unchanged."""
    if jax.default_backend() != "cpu":
        return x
    return with_layout_constraint(x, Layout(major_to_minor=tuple(range(x.ndim))))
