"""A decoder-only transformer in Flax NNX: RMSNorm, RoPE, grouped-query attention, a gated MLP.

One module set covers Llama, Qwen2/2.5, Qwen3, Mistral and Gemma 2/3 through `ModelConfig`
switches. The layer parameters are stacked along a leading `layers` axis and the layer
function is a pure function scanned over them, so compile time does not grow with depth and
one sharding spec covers all layers (and the stacked KV cache). Models of up to
`MAX_UNROLLED_LAYERS` layers loop over them in Python instead (compiles and runs faster at
that depth) unless the mesh splits their weights.

Layers of two kinds (Gemma's sliding-window layers between full-attention ones) scan too: the
scan carries each layer's kind as a flag, which selects its attention mask and RoPE table
(`choose`), so one layer function still serves every layer.

This module holds the model and its parameters, the KV cache, `forward`, the layer loop and
the block (`decoder_layer`); the parts of a layer live beside it in `jgrpo.models`:
`attention` (RoPE, masks, grouped-query attention), `mlp` (the gated MLP, the mixture of
experts), `projection` (activations times kernels, LoRA kernels), `precision` (bf16 weights
and products), `embedding` (embeddings, logits) and `primitives` (sharding constraints,
RMSNorm, soft-capping).

Dimension letters in shape comments: B batch, T new tokens, S cache slots (keys), E embed,
H heads, K kv heads, G heads per kv head, D head_dim, M mlp, V vocab, L layers.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jgrpo.models.attention import attention_inputs, grouped_query_attention, layer_variants
from jgrpo.models.config import ModelConfig
from jgrpo.models.embedding import input_embeddings, logits_from_hidden, unembedding
from jgrpo.models.mlp import gated_projection, mixture_of_experts
from jgrpo.models.precision import matmul_kernels, with_matmul_unembedding, write_slice
from jgrpo.models.primitives import constrain, norm_scale, rms_norm
from jgrpo.models.projection import normed_projections, project


class KVCache(NamedTuple):
    """Keys and values of every layer, and the next slot to write (shared by all rows).

    Rows of a batch are left-padded to a common length, so every row writes the same slot.
    """

    k: jax.Array  # [L, B, K, S, D]: slots next to head_dim, as attention reads them
    v: jax.Array  # [L, B, K, S, D]
    index: jax.Array  # int32 scalar

    @property
    def max_length(self) -> int:
        """S, the number of slots."""
        return self.k.shape[3]


CACHE_AXES = ("layers", "batch", "kv_heads", "length", "head_dim")


def init_cache(config: ModelConfig, batch: int, max_length: int, dtype=jnp.float32) -> KVCache:
    """An empty cache of `max_length` slots for `batch` rows: zeros in `dtype`, index 0."""
    shape = (config.num_layers, batch, config.num_kv_heads, max_length, config.head_dim)
    # Two buffers, not one shared: a cache passed with donation must not alias itself.
    return KVCache(
        k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), index=jnp.zeros((), jnp.int32)
    )


# --- parameters ----------------------------------------------------------------------------


def layer_param_specs(c: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """name -> (shape, logical axes) of one layer's parameters; stacking adds a leading L."""
    e, m, h, k, d = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
    specs = {
        "attn_norm": ((e,), ("embed",)),
        "q_kernel": ((e, h, d), ("embed", "heads", "head_dim")),
        "k_kernel": ((e, k, d), ("embed", "kv_heads", "head_dim")),
        "v_kernel": ((e, k, d), ("embed", "kv_heads", "head_dim")),
        "o_kernel": ((h, d, e), ("heads", "head_dim", "embed")),
        "mlp_norm": ((e,), ("embed",)),
    }
    if c.num_experts:  # the router, and each projection of every expert as one weight
        x, m = c.num_experts, c.moe_intermediate_size
        specs["router"] = ((e, x), ("embed", "expert"))
        specs["expert_gate_kernel"] = ((x, e, m), ("expert", "embed", "mlp"))
        specs["expert_up_kernel"] = ((x, e, m), ("expert", "embed", "mlp"))
        specs["expert_down_kernel"] = ((x, m, e), ("expert", "mlp", "embed"))
    else:
        specs["gate_kernel"] = ((e, m), ("embed", "mlp"))
        specs["up_kernel"] = ((e, m), ("embed", "mlp"))
        specs["down_kernel"] = ((m, e), ("mlp", "embed"))
    if c.qkv_bias:
        specs["q_bias"] = ((h, d), ("heads", "head_dim"))
        specs["k_bias"] = ((k, d), ("kv_heads", "head_dim"))
        specs["v_bias"] = ((k, d), ("kv_heads", "head_dim"))
    if c.qk_norm:
        specs["q_norm"] = ((d,), ("head_dim",))
        specs["k_norm"] = ((d,), ("head_dim",))
    if c.post_norms:
        specs["post_attn_norm"] = ((e,), ("embed",))
        specs["post_mlp_norm"] = ((e,), ("embed",))
    return specs


def param_axes(config: ModelConfig) -> dict:
    """The logical axis names of every parameter, a pytree shaped like `Transformer.params()`
    (a mesh's rules table maps them to mesh axes; see `jgrpo.sharding`)."""
    axes = {
        "embed": ("vocab", "embed"),
        "layers": {
            name: ("layers", *names) for name, (_, names) in layer_param_specs(config).items()
        },
        "final_norm": ("embed",),
    }
    if not config.tie_word_embeddings:
        axes["lm_head"] = ("embed", "vocab")
    return axes


def _init_value(name: str, shape, key, dtype, norm_offset: float = 0.0):
    """Norm scales start at 1 (their weight at 1 - `norm_offset`: Gemma's at 0), biases at 0,
    kernels ~ N(0, 0.02) (HF's initializer_range)."""
    if name.endswith("norm"):
        return jnp.full(shape, 1.0 - norm_offset, dtype)
    if name.endswith("bias"):
        return jnp.zeros(shape, dtype)
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


class DecoderLayers(nnx.Module):
    """The parameters of all layers, stacked: each attribute is [L, ...]."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        for name, (shape, axes) in layer_param_specs(config).items():
            value = _init_value(
                name,
                (config.num_layers, *shape),
                rngs.params(),
                param_dtype,
                config.norm_weight_offset,
            )
            setattr(self, name, nnx.Param(value, out_sharding=("layers", *axes)))

    def arrays(self) -> dict[str, jax.Array]:
        return {
            name: value[...] for name, value in vars(self).items() if isinstance(value, nnx.Param)
        }


class Transformer(nnx.Module):
    """Token ids in, logits (or final hidden states) out, with an optional KV cache.

    `rngs` seeds the random initialisation and `param_dtype` is the parameters' dtype;
    `jgrpo.models.from_pretrained` builds one from a checkpoint instead. Parameters carry logical
    axis names as Flax `out_sharding` metadata; they are created unsharded and a mesh's rules
    table decides their placement (see jgrpo's sharding).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.config = config
        e, v = config.hidden_size, config.vocab_size
        with nnx.use_eager_sharding(False):
            self.embed = nnx.Param(
                _init_value("embed", (v, e), rngs.params(), param_dtype),
                out_sharding=("vocab", "embed"),
            )
            self.layers = DecoderLayers(config, rngs=rngs, param_dtype=param_dtype)
            self.final_norm = nnx.Param(
                _init_value("final_norm", (e,), None, param_dtype, config.norm_weight_offset),
                out_sharding=("embed",),
            )
            self.lm_head = (
                None
                if config.tie_word_embeddings
                else nnx.Param(
                    _init_value("lm_head", (e, v), rngs.params(), param_dtype),
                    out_sharding=("embed", "vocab"),
                )
            )

    @property
    def unembedding(self) -> jax.Array:  # [E, V]
        """The output projection, for `jgrpo.chunked_token_logprobs(hidden, unembedding, ...)`."""
        return unembedding(self.params())

    def params(self) -> dict:
        """The parameter arrays as the pytree `forward` takes."""
        params = {
            "embed": self.embed[...],
            "layers": self.layers.arrays(),
            "final_norm": self.final_norm[...],
        }
        if self.lm_head is not None:
            params["lm_head"] = self.lm_head[...]
        return params

    def load_params(self, params: dict) -> None:
        """Sets the parameters from a pytree shaped like `params()` (e.g. after training)."""
        self.embed.set_value(params["embed"])
        self.final_norm.set_value(params["final_norm"])
        if self.lm_head is not None:
            self.lm_head.set_value(params["lm_head"])
        for name, value in params["layers"].items():
            getattr(self.layers, name).set_value(value)

    def __call__(
        self,
        input_ids: jax.Array,  # int[B, T]
        *,
        attention_mask: jax.Array | None = None,  # [B, T], or [B, S] over cache slots
        positions: jax.Array | None = None,  # int[B, T]
        cache: KVCache | None = None,
        return_hidden: bool = False,
    ):
        """Logits f32[B, T, V] (or final hidden states [B, T, E]); see `forward`."""
        return forward(
            self.params(),
            input_ids,
            attention_mask=attention_mask,
            positions=positions,
            cache=cache,
            config=self.config,
            return_hidden=return_hidden,
        )


@functools.partial(
    jax.jit,
    static_argnames=("config", "return_hidden", "return_kv", "matmul_dtype", "return_router_stats"),
)
def forward(
    params: dict,
    input_ids: jax.Array,  # int[B, T]
    *,
    config: ModelConfig,
    attention_mask: jax.Array | None = None,  # [B, T], or [B, S] over cache slots
    positions: jax.Array | None = None,  # int[B, T]
    cache: KVCache | None = None,
    return_hidden: bool = False,
    return_kv: bool = False,
    matmul_dtype=None,
    return_router_stats: bool = False,
):
    """The decoder as a pure function of its parameters (jitted; inlined under an outer jit).

    Without a cache, the T tokens attend causally to each other; `attention_mask` [B, T]
    marks real tokens (0 for left padding). With a cache, the new tokens are written at
    slots [cache.index, cache.index + T) and attend to every earlier slot whose
    `attention_mask` [B, S] entry is 1; the call returns `(output, new_cache)`.

    `positions` default to the count of real tokens before each one (so left padding does not
    shift RoPE), or to 0..T-1 (+ cache.index) when there is no mask.

    `return_kv` (no cache only) also returns the keys and values of every layer, k and v
    [L, B, K, T, D], as `(output, (k, v))`: a prefill for `jgrpo.models.group_decode`.

    `return_router_stats` (no cache only) also returns, for a mixture of experts, its
    routers' `RouterStats` summed over the layers (None for a dense model), as
    `(output, stats)`: the update's load-balancing loss and routing metrics.

    `matmul_dtype` (e.g. bf16) multiplies in that dtype with f32 sums, as the parameters of
    `with_matmul_weights(params, matmul_dtype)` would (same values), but casts each layer's
    kernels inside the layer loop: a cast stacked copy scanned over cost XLA:CPU two extra
    passes over the weights (it slices the stack in f32, so it widened the bf16 copy back).
    """
    if (return_kv or return_router_stats) and cache is not None:
        raise ValueError("return_kv and return_router_stats are for a forward without a cache.")
    if return_kv and return_router_stats:
        raise ValueError("return_kv and return_router_stats are not taken together.")
    batch, length = input_ids.shape
    if cache is None:
        key_mask = _default_mask(attention_mask, (batch, length), "[B, T]")
        offset = jnp.zeros((), jnp.int32)
    else:
        key_mask = _default_mask(attention_mask, (batch, cache.max_length), "[B, S]")
        offset = cache.index
    if positions is None:
        positions = _positions_from_mask(key_mask, offset, length)

    slots = key_mask.shape[1]
    query_slot = offset + jnp.arange(length)  # [T]
    distance = query_slot[:, None] - jnp.arange(slots)[None, :]  # [T, S]
    mask = (distance >= 0)[None] & key_mask[:, None, :].astype(bool)  # [B, T, S]
    # A sliding layer's keys are the W latest slots (transformers' rule, on cache slots:
    # the rows' real tokens are contiguous, so slots and positions differ by a constant).
    full, sliding = layer_variants(config, mask, distance, positions)  # (mask, cos, sin) each

    x = input_embeddings(params, input_ids, config)  # [B, T, E]

    def cast(layer_params: dict) -> dict:
        return layer_params if matmul_dtype is None else matmul_kernels(layer_params, matmul_dtype)

    if cache is None:

        def layer(x, scanned):
            layer_params, is_sliding = scanned
            mask, cos, sin = choose(is_sliding, sliding, full)
            x, kv, stats = decoder_layer(
                config, cast(layer_params), x, cos, sin, mask, token_weights=key_mask
            )
            return x, (kv if return_kv else None, stats if return_router_stats else None)

        if config.remat:
            layer = jax.checkpoint(layer, prevent_cse=False)
        scanned = (params["layers"], layer_kinds(config))
        x, (layer_kv, layer_stats) = over_layers(layer, x, scanned, config.num_layers)
    else:
        # The stacked cache rides in the scan carry and each layer updates its slots in place:
        # slicing it as scan input and restacking it as output would copy it every step.
        def layer(carry, scanned):
            x, k, v = carry
            layer_params, index, is_sliding = scanned
            mask, cos, sin = choose(is_sliding, sliding, full)
            x, (k, v), _ = decoder_layer(
                config, cast(layer_params), x, cos, sin, mask, cache=(k, v, index), offset=offset
            )
            return (x, k, v), None

        scanned = (params["layers"], jnp.arange(config.num_layers), layer_kinds(config))
        (x, k, v), _ = jax.lax.scan(layer, (x, cache.k, cache.v), scanned)
        cache = KVCache(k=k, v=v, index=cache.index + length)

    hidden = rms_norm(x, norm_scale(config, params["final_norm"]), config.rms_norm_eps)
    # hidden [B, T, E]
    softcap = config.final_logit_softcapping
    if return_hidden:
        out = hidden
    elif matmul_dtype is None:
        out = logits_from_hidden(params, hidden, softcap)
    else:
        out = logits_from_hidden(with_matmul_unembedding(params, matmul_dtype), hidden, softcap)
    if return_kv:
        return out, layer_kv
    if return_router_stats:  # summed over the layers
        return out, None if layer_stats is None else jax.tree.map(lambda s: s.sum(0), layer_stats)
    return out if cache is None else (out, cache)


def layer_kinds(config: ModelConfig) -> np.ndarray | None:
    """bool[L], each layer's kind (True: sliding window), when layers differ; None when every
    layer is of one kind, which `choose` then reads from the config as a constant."""
    kinds = config.sliding_layers
    if len(set(kinds)) == 1:
        return None
    return np.asarray(kinds)


def choose(is_sliding, sliding, full):
    """`sliding` or `full` (pytrees alike) for one layer whose kind is `is_sliding`: a Python or
    NumPy bool (an unrolled layer), a traced bool (a scanned one: an element-wise select), or
    None (`layer_kinds` found every layer alike: then `sliding` and `full` are the same, or the
    model slides in every layer and `sliding` is taken)."""
    if is_sliding is None:
        return sliding
    if isinstance(is_sliding, (bool, np.bool_)):
        return sliding if is_sliding else full
    return jax.tree.map(lambda a, b: jnp.where(is_sliding, a, b), sliding, full)


# Models up to this deep run their layers as a Python loop instead of a scan. At 2 and 4
# layers the update both compiled and ran faster that way: the scan stacks what the backward
# pass keeps from each layer, which cost more kernels and copies than the extra copies of the
# layer; at 8 the compile times met. Deeper models scan, so compile time does not grow.
MAX_UNROLLED_LAYERS = 4


# The logical axes of the weights (`param_axes`); a mesh that splits any of them gathers each
# layer's weights where the layer runs.
WEIGHT_AXES = ("embed", "heads", "kv_heads", "mlp", "vocab", "expert")


def weights_split_over_devices() -> bool:
    """Whether the current mesh and rules split the weights (FSDP or tensor parallelism)."""
    rules = nn.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return False
    mesh_axes = [nn.logical_to_mesh_axes((axis,), rules)[0] for axis in WEIGHT_AXES]
    names = {name for axes in mesh_axes if axes for name in np.atleast_1d(axes)}
    return any(mesh.shape[name] > 1 for name in names)


def over_layers(layer: Callable, carry, stacked_params: dict, num_layers: int):
    """`jax.lax.scan(layer, carry, stacked_params)`, unrolled for shallow models (above).

    Split weights always scan: the scan gathers one layer's weights at a time, while the
    unrolled program kept every layer's gathered weights and gradients at once (a micro-batch
    of 8 rows took 0.97 MB of update scratch instead of 0.57 MB at fsdp = 8, more than one of 16).
    """
    if num_layers > MAX_UNROLLED_LAYERS or weights_split_over_devices():
        return jax.lax.scan(layer, carry, stacked_params)
    outputs = []
    for index in range(num_layers):
        layer_params = jax.tree.map(operator.itemgetter(index), stacked_params)
        carry, output = layer(carry, layer_params)
        outputs.append(output)
    return carry, jax.tree.map(lambda *per_layer: jnp.stack(per_layer), *outputs)


# --- the pure layer ----------------------------------------------------------------------


def finish_layer(config, params, x, attention, token_weights=None):
    """The rest of a block after attention [B, T, H, D]: output projection and residual, then
    x + MLP(norm(x)); Gemma normalises each branch's output too (`post_norms`). Returns
    (x, the router's `RouterStats` over the tokens weighted by `token_weights` [B, T], or
    None for a dense MLP)."""
    eps = config.rms_norm_eps
    out = project(attention, params["o_kernel"], contract=2)  # [B, T, E]
    if config.post_norms:
        out = rms_norm(out, norm_scale(config, params["post_attn_norm"]), eps)
    x = x + out
    stats = None
    if config.num_experts:
        normed = rms_norm(x, params["mlp_norm"], eps)
        out, stats = mixture_of_experts(config, params, normed, token_weights)
    else:
        mlp_kernels = (params["gate_kernel"], params["up_kernel"])
        gate, up = normed_projections(x, norm_scale(config, params["mlp_norm"]), mlp_kernels, eps)
        out = gated_projection(gate, up, params["down_kernel"], config.hidden_act)  # [B, T, E]
    if config.post_norms:
        out = rms_norm(out, norm_scale(config, params["post_mlp_norm"]), eps)
    return constrain(x + out, ("batch", "length", "embed")), stats


def decoder_layer(config, params, x, cos, sin, mask, cache=None, offset=0, token_weights=None):
    """One pre-norm block: x + attention(norm(x)), then + MLP(norm(x)) (`finish_layer`).

    x [B, T, E]; mask bool[B, T, S]. Without a cache the keys are the T new tokens and the
    call returns (x, (k, v), router stats) with k, v [B, K, T, D]. With `cache=(k, v, layer)`
    (k, v [L, B, K, S, D]) the new keys and values are written at slots [offset, offset + T)
    of that layer, attention reads all S slots, and the call returns (x, (k, v), router
    stats) of the whole cache. The router stats (mixture of experts; None for a dense MLP)
    weigh the tokens by `token_weights` [B, T].
    """
    q, k, v = attention_inputs(config, params, x, cos, sin)  # k, v [B, K, T, D]
    if cache is None:
        keys, values, new_cache = k, v, (k, v)
    else:
        k_all, v_all, layer = cache
        start = (layer, 0, 0, offset, 0)
        k_all = write_slice(k_all, k[None], start)
        v_all = write_slice(v_all, v[None], start)
        keys = jax.lax.dynamic_index_in_dim(k_all, layer, keepdims=False)  # [B, K, S, D]
        values = jax.lax.dynamic_index_in_dim(v_all, layer, keepdims=False)
        new_cache = (k_all, v_all)
    keys = constrain(keys, ("batch", "kv_heads", "length", "head_dim"))
    values = constrain(values, ("batch", "kv_heads", "length", "head_dim"))
    attention = grouped_query_attention(
        q, keys, values, mask, config.attention_scale, config.attn_logit_softcapping
    )  # [B, T, H, D]
    x, stats = finish_layer(config, params, x, attention, token_weights)
    return x, new_cache, stats


def _default_mask(mask, shape, expected):
    if mask is None:
        return jnp.ones(shape, jnp.int32)
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask must have shape {expected} = {shape}, got {mask.shape}.")
    return mask.astype(jnp.int32)


def _positions_from_mask(key_mask, offset, length):
    """RoPE position of each new token: the number of real tokens before it."""
    before = jnp.cumsum(key_mask, axis=1) - 1  # [B, S]
    positions = jax.lax.dynamic_slice_in_dim(before, offset, length, axis=1)  # [B, T]
    return jnp.maximum(positions, 0)
