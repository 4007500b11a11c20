"""The MLP of a layer: the dense gated MLP's activation and product, and the mixture of experts
(router, `RouterStats` and its load-balancing loss, the routed experts, on one device or a mesh).

Dimension letters in shape comments as in `jgrpo.models.transformer`, plus X experts, k experts
per token, N tokens.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jgrpo.models.config import ModelConfig
from jgrpo.models.primitives import constrain
from jgrpo.models.projection import project


@functools.partial(jax.checkpoint, prevent_cse=False, static_argnums=(3,))
def gated_projection(
    gate: jax.Array, up: jax.Array, kernel: jax.Array, activation: str
) -> jax.Array:
    """`project(act(gate) * up, kernel)` (SwiGLU with silu, GeGLU with gelu_pytorch_tanh),
    act(gate) * up recomputed from gate and up in the backward pass: [B, T, M] x [M, E] ->
    [B, T, E].

    Plain autodiff keeps the sigmoid, silu(gate), the product and more [B, T, M]
    intermediates per layer next to gate and up; recomputing them is a few elementwise
    operations (docs/benchmarks.md: with `rms_norm`, `softmax` and `normed_projections`
    alike, the update's temporary memory at the compare workload 5.95 -> 2.49 GB).
    """
    hidden = constrain(activate(gate, activation) * up, ("batch", "length", "mlp"))
    return project(hidden, kernel)


def activate(x: jax.Array, activation: str) -> jax.Array:
    """The gated MLP's activation: silu, or GELU with the tanh approximation (Gemma)."""
    if activation == "silu":
        return jax.nn.silu(x)
    if activation == "gelu_pytorch_tanh":
        return jax.nn.gelu(x, approximate=True)
    raise ValueError(f"activation {activation!r} is not supported.")


class RouterStats(NamedTuple):
    """What a mixture-of-experts layer's router did with its tokens (summed over layers, too):
    enough for the load-balancing loss (`load_balancing_loss`) and the routing metrics."""

    counts: jax.Array  # f32[X]: the tokens' assignments to each expert (k per token), weighted
    probabilities: jax.Array  # f32[X]: the router's probabilities summed over the tokens
    tokens: jax.Array  # f32 scalar: the tokens' weight, summed


def load_balancing_loss(stats: RouterStats) -> jax.Array:
    """transformers' auxiliary loss of Switch-style routing over every layer's tokens:
    X * sum_x (assignments to x / tokens) * (mean router probability of x), its minimum k
    when the router spreads tokens and probability evenly (X experts, k per token)."""
    tokens = jnp.maximum(stats.tokens, 1.0)
    return stats.counts.shape[-1] * jnp.sum(
        (stats.counts / tokens) * (stats.probabilities / tokens)
    )


def mixture_of_experts(
    config: ModelConfig, params: dict, h: jax.Array, token_weights: jax.Array | None = None
) -> tuple[jax.Array, RouterStats]:
    """The MLP of a mixture-of-experts layer (Qwen3-MoE) on normalised activations h [..., E],
    and its `RouterStats` over the tokens weighted by `token_weights` [...] (default 1: a
    padding token weighs 0).

    The router, in f32, scores the experts by a softmax over `router` [E, X] and keeps the
    `experts_per_token` best (their weights renormalised to sum to 1 with `norm_topk_prob`);
    `routed_mlp` runs each token through its chosen experts.

    On a mesh the layer runs per device (`jax.shard_map`): each device routes the tokens it
    holds. Where the rules split the experts over a mesh axis (expert parallelism: `expert`
    over `fsdp`, `jgrpo.sharding.LOGICAL_RULES`), the devices of that axis gather their tokens,
    each runs them through its own X / n experts, and the partial outputs are summed and
    scattered back to the tokens' devices (all-gather and reduce-scatter of activations, as
    Megatron's all-gather dispatcher does): the experts' weights never move and no token is
    dropped. An `mlp` split over `tensor` sums the down projection's partial outputs. Experts
    that the axis does not divide are split as a dense MLP's weights are and gathered by the
    layer, as FSDP gathers every weight.
    """
    lead, embed = h.shape[:-1], h.shape[-1]
    tokens = h.reshape(-1, embed)  # [N, E]
    if token_weights is None:
        weight = jnp.ones((tokens.shape[0],), jnp.float32)
    else:
        weight = token_weights.reshape(-1).astype(jnp.float32)  # [N]
    mesh, rules = jax.sharding.get_abstract_mesh(), nn.get_logical_axis_rules()
    if mesh.empty or not rules or mesh.size == 1:
        out, stats = _experts_of_tokens(config, params, tokens, weight)
    else:
        out, stats = _experts_over_mesh(config, params, tokens, weight, mesh, rules)
    return out.reshape(*lead, embed), stats


EXPERT_WEIGHTS = ("expert_gate_kernel", "expert_up_kernel", "expert_down_kernel")


def _experts_of_tokens(
    config: ModelConfig,
    params: dict,
    tokens: jax.Array,
    weight: jax.Array,
    first: jax.Array | int = 0,
    gathered: tuple[str, ...] = (),
    copied: tuple[str, ...] = (),
) -> tuple[jax.Array, RouterStats]:
    """The layer on the tokens [n, E] at hand with the experts `first` .. `first` + the
    kernels' count (all of them off a mesh). Experts split over mesh axes: `gathered`, those
    whose devices hold different tokens (each device's experts take every device's tokens),
    and `copied`, those whose devices hold the same tokens. Marking the copies as varying
    over `copied` makes their gradient the sum of every device's share: without it, JAX
    0.10's shard_map returned a wrong gradient for the tokens (18 tokens on fsdp = 4: off by
    up to 13.8 where the largest entry is 15.4; test_moe checks it)."""
    experts = config.num_experts
    logits = jnp.dot(tokens.astype(jnp.float32), params["router"].astype(jnp.float32))  # f32[n, X]
    probabilities = jax.nn.softmax(logits, axis=-1)  # f32[n, X]
    weights, chosen = jax.lax.top_k(probabilities, config.experts_per_token)  # [n, k]
    if config.norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    stats = RouterStats(
        counts=jnp.zeros((experts,), jnp.float32).at[chosen].add(weight[:, None]),
        probabilities=(probabilities * weight[:, None]).sum(axis=0),  # the loss's gradient
        tokens=weight.sum(),
    )
    if gathered:
        tokens, weights, chosen = (
            jax.lax.all_gather(a, gathered, axis=0, tiled=True) for a in (tokens, weights, chosen)
        )
    if copied:  # each device takes its experts' share of the same tokens
        tokens, weights = (jax.lax.pcast(a, copied, to="varying") for a in (tokens, weights))
    out = routed_mlp(config, params, tokens, weights, chosen, first)
    if gathered:
        out = jax.lax.psum_scatter(out, gathered, scatter_dimension=0, tiled=True)
    return out, stats


def routed_mlp(
    config: ModelConfig,
    kernels: dict,
    tokens: jax.Array,
    weights: jax.Array,
    chosen: jax.Array,
    first: jax.Array | int = 0,
) -> jax.Array:
    """sum over k of weights [N, k] x the gated MLP of expert chosen [N, k] on tokens [N, E],
    for the experts `first` .. `first` + C that `kernels` holds ([C, E, M] and [C, M, E]);
    the other experts' terms are left out (another device adds them). [N, E]

    The N * k assignments are sorted by expert (the others' last), so that each expert
    multiplies one contiguous block of rows: `jax.lax.ragged_dot`. On GPU and TPU JAX emits
    XLA's ragged-dot instruction (each block times its expert alone); on CPU it lowers it to
    a masked product with every expert (C times the work: fine for tests, slow for real
    models)."""
    count = kernels["expert_gate_kernel"].shape[0]
    k = chosen.shape[-1]
    local = chosen.reshape(-1) - first  # [N * k]: the expert's index among these kernels
    held = (local >= 0) & (local < count)
    slot = jnp.where(held, local, count)  # others after the last group, in no group
    order = jnp.argsort(slot, stable=True)  # [N * k]: assignments by expert
    token_of = order // k
    group_sizes = jnp.bincount(slot, length=count + 1)[:count].astype(jnp.int32)  # [C]
    rows = jnp.take(tokens, token_of, axis=0)  # [N * k, E]
    gate = expert_products(rows, kernels["expert_gate_kernel"], group_sizes)  # [N * k, M]
    up = expert_products(rows, kernels["expert_up_kernel"], group_sizes)
    hidden = activate(gate, config.hidden_act) * up
    out = expert_products(hidden, kernels["expert_down_kernel"], group_sizes)  # [N * k, E]
    scale = jnp.take(jnp.where(held, weights.reshape(-1), 0.0), order)  # [N * k]
    return jnp.zeros_like(tokens).at[token_of].add(out * scale[:, None].astype(out.dtype))


def _experts_over_mesh(
    config: ModelConfig, params: dict, tokens: jax.Array, weight: jax.Array, mesh, rules
) -> tuple[jax.Array, RouterStats]:
    """`_experts_of_tokens` per device of `mesh` (the docstring of `mixture_of_experts`)."""
    token_axes = _dividing_mesh_axes("batch", tokens.shape[0], mesh, rules)
    expert_axes = _dividing_mesh_axes("expert", config.num_experts, mesh, rules)
    mlp_axes = _dividing_mesh_axes("mlp", config.moe_intermediate_size, mesh, rules)
    gathered = tuple(axis for axis in expert_axes if axis in token_axes)
    copied = tuple(axis for axis in expert_axes if axis not in token_axes)
    rows, experts, mlp = (_spec_entry(axes) for axes in (token_axes, expert_axes, mlp_axes))
    P = jax.sharding.PartitionSpec

    def per_device(tokens, weight, router, gate, up, down):
        first = jax.lax.axis_index(expert_axes) * gate.shape[0] if expert_axes else 0
        kernels = dict(zip(EXPERT_WEIGHTS, (gate, up, down), strict=True), router=router)
        out, stats = _experts_of_tokens(
            config, kernels, tokens, weight, first, gathered=gathered, copied=copied
        )
        if copied or mlp_axes:  # the experts' and the mlp shards' partial outputs
            out = jax.lax.psum(out, copied + mlp_axes)
        if token_axes:  # each device counted its own tokens
            stats = jax.lax.psum(stats, token_axes)
        return out, stats

    return jax.shard_map(
        per_device,
        in_specs=(
            P(rows, None),
            P(rows),
            P(),
            P(experts, None, mlp),
            P(experts, None, mlp),
            P(experts, mlp, None),
        ),
        out_specs=(P(rows, None), RouterStats(P(), P(), P())),
    )(tokens, weight, params["router"], *(params[name] for name in EXPERT_WEIGHTS))


def _dividing_mesh_axes(logical: str, size: int, mesh, rules) -> tuple[str, ...]:
    """The mesh axes the rules give a dimension named `logical` of `size`, less those of
    size 1 and those that do not divide it (as `jgrpo.sharding.logical_spec` fits them)."""
    assigned = nn.logical_to_mesh_axes((logical,), rules)[0]
    kept, split = [], 1
    for axis in (assigned,) if isinstance(assigned, str) else tuple(assigned or ()):
        if mesh.shape.get(axis, 1) > 1 and size % (split * mesh.shape[axis]) == 0:
            kept.append(axis)
            split *= mesh.shape[axis]
    return tuple(kept)


def _spec_entry(axes: tuple[str, ...]):
    """A PartitionSpec entry for a dimension split over `axes`."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


def expert_products(rows: jax.Array, kernels: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """rows [R, I] (grouped by expert, `group_sizes` [X] of them each) times their expert's
    kernel of `kernels` [X, I, O]: [R, O] in the rows' dtype, products in the kernels' dtype
    (bf16 weights, `with_matmul_weights`) summed in f32."""
    product = jax.lax.ragged_dot(
        rows.astype(kernels.dtype), kernels, group_sizes, preferred_element_type=jnp.float32
    )
    return product.astype(rows.dtype)
