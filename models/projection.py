"""Activations times weight matrices: `project` and `project_each` over plain kernels, kernels
in another dtype than the activations (`mixed_matmul`) and LoRA-adapted ones (`LoraKernel`).

Dimension letters in shape comments as in `jgrpo.models.transformer`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jgrpo.models.precision import mixed_matmul
from jgrpo.models.primitives import rms_norm


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=("base", "a", "b"), meta_fields=("scale",)
)
@dataclasses.dataclass(frozen=True)
class LoraKernel:
    """A weight matrix with a low-rank adapter: base + scale * a @ b, never multiplied out.

    base [*I, *O] is the frozen kernel; a [*I, r] and b [r, *O] the adapter
    (`jgrpo.models.lora`). `project` multiplies x by the base and, apart, by a then b, so the
    backward pass computes no gradient for the base (the product base + a b would need the
    full [*I, *O] gradient first). It stands wherever a layer's kernel does (stacked [L, ...]
    leaves slice per layer in the layer loop); `astype` casts all three, for mixed precision.
    """

    base: jax.Array
    a: jax.Array
    b: jax.Array
    scale: float

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    @property
    def dtype(self):
        return self.base.dtype

    def astype(self, dtype) -> LoraKernel:
        return LoraKernel(
            self.base.astype(dtype), self.a.astype(dtype), self.b.astype(dtype), self.scale
        )

    def __getitem__(self, layer) -> LoraKernel:
        """One layer's kernel of a stacked [L, ...] one."""
        return LoraKernel(self.base[layer], self.a[layer], self.b[layer], self.scale)

    def merged(self) -> jax.Array:  # f32[*I, *O]
        """W + scale * A B of one layer's kernel, summed in f32."""
        delta = jnp.tensordot(self.a, self.b, axes=1, preferred_element_type=jnp.float32)
        return self.base.astype(jnp.float32) + self.scale * delta


def project(x: jax.Array, kernel: jax.Array, contract: int = 1) -> jax.Array:
    """x's last `contract` axes times the kernel's first ones: [..., *I] x [*I, *O] -> [..., *O]."""
    return project_each(x, (kernel,), contract)[0]


def project_each(
    x: jax.Array, kernels: tuple[jax.Array, ...], contract: int = 1
) -> tuple[jax.Array, ...]:
    """`project(x, kernel, contract)` for each kernel, from one [N, I] reshape of x.

    x is multiplied as a 2D matrix rather than by an einsum over [B, T, ...]: the result is
    the same, but XLA:CPU then lays out the backward pass's weight-gradient products without
    transposed copies of the [B*T, M] activations (in a profile of the SmolLM2-135M benchmark
    update, the einsum form spent ~10 s in such copies; this one ~1.5). The kernels are
    contracted as they are, [*I, *O], not reshaped: the backward pass then keeps the shared
    2D x once and no reshaped copy of a kernel (each would be another [L, ...] buffer in a
    scanned layer stack). A kernel in another dtype than x (bf16 weights for f32
    activations, `with_matmul_weights`) multiplies in the kernel's dtype and accumulates in
    f32 (`mixed_matmul`). A `LoraKernel` (LoRA) adds its adapter's product, x A then B.
    """
    inner = kernels[0].shape[:contract]
    lead = x.shape[: x.ndim - contract]
    rows = x.reshape(math.prod(lead), *inner)  # [N, *I]: one value for every kernel
    matrix = rows.reshape(len(rows), -1)  # [N, I]: the same value, for `mixed_matmul`
    dims = ((tuple(range(1, contract + 1)), tuple(range(contract))), ((), ()))
    products = []
    for kernel in kernels:
        if isinstance(kernel, LoraKernel):  # x W + s (x A) B: [N, r] between the products
            base, low_rank = project_each(x, (kernel.base, kernel.a), contract)  # [..., r]
            adapted = project(low_rank * jnp.asarray(kernel.scale, low_rank.dtype), kernel.b)
            products.append(base + adapted)
            continue
        if kernel.dtype == x.dtype:
            flat = jax.lax.dot_general(rows, kernel, dims)  # [N, *O]
        else:  # 2D operands: [N, I] x [I, O]
            flat = mixed_matmul(matrix, kernel.reshape(matrix.shape[1], -1)).astype(x.dtype)
        products.append(flat.reshape(*lead, *kernel.shape[contract:]))
    return tuple(products)


@functools.partial(jax.checkpoint, prevent_cse=False, static_argnums=(3,))
def normed_projections(
    x: jax.Array, scale: jax.Array, kernels: tuple[jax.Array, ...], eps: float
) -> tuple[jax.Array, ...]:
    """`project_each(rms_norm(x, scale, eps), kernels)`, the normalised x recomputed from x in
    the backward pass.

    The weight gradients need the products' input; plain autodiff keeps the normalised x
    for them, a second [B, T, E] per norm beside x, which the norm's own backward keeps
    anyway (docs/benchmarks.md: with `gated_projection`, the update's temporary memory at
    the compare workload 3.20 -> 2.49 GB). Only the norm is recomputed: the backward does
    not read the products, so XLA drops their recomputation (the update has as many dots
    as without the checkpoint).
    """
    return project_each(rms_norm(x, scale, eps), kernels)
