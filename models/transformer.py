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

Dimension letters in shape comments: B batch, T new tokens, S cache slots (keys), E embed,
H heads, K kv heads, G heads per kv head, D head_dim, M mlp, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental.layout import Layout, with_layout_constraint

from jgrpo.models.config import LinearRopeScaling, ModelConfig

_MASKED = float(np.finfo(np.float32).min)  # finite: a fully masked row gives no NaN


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


def input_embeddings(params: dict, ids: jax.Array, config: ModelConfig) -> jax.Array:
    """The embedding rows of `ids` [...] as [..., E] in the activations' dtype, the norms': a
    table rounded to bf16 beside f32 norms (`with_rounded_weights`) is read back as f32.
    Gemma multiplies them by sqrt(E), a factor rounded to that dtype as transformers does."""
    rows = embed_tokens(params["embed"], ids).astype(params["final_norm"].dtype)
    if config.scale_embeddings:
        rows = rows * jnp.asarray(config.hidden_size**0.5, rows.dtype)
    return rows


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """Sharding constraint by logical axis names; a no-op outside a mesh with rules."""
    rules = nn.get_logical_axis_rules()
    if not rules or jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, nn.logical_to_mesh_axes(axes, rules))


def embed_tokens(table: jax.Array, ids: jax.Array) -> jax.Array:  # [V, E], [B, T] -> [B, T, E]
    """Embedding rows of `ids`, split by batch rows on a mesh.

    The table's `embed` shards are gathered first, as FSDP gathers every weight where it is
    used: a lookup straight from an embed-split table gives rows split along `embed`, which
    XLA cannot re-split by batch without replicating them.
    """
    table = constrain(table, ("vocab", None))
    rows = jnp.take(table, ids, axis=0)
    return constrain(rows, ("batch",) + (None,) * (ids.ndim - 1) + ("embed",))


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


class LayerVariant(NamedTuple):
    """What a layer's kind decides: its attention mask and its RoPE tables."""

    mask: jax.Array  # bool[..., T, S]
    cos: jax.Array  # f32[..., T, D/2]
    sin: jax.Array


def layer_variants(
    config: ModelConfig, mask: jax.Array, distance: jax.Array, positions: jax.Array
) -> tuple[LayerVariant, LayerVariant]:
    """(full, sliding): the inputs of a full-attention layer and of a sliding-window one.

    `mask` bool[..., T, S] is the causal mask; `distance` [..., T, S] how many positions
    each key lies before its query (the sliding mask keeps distance < W); `positions`
    [..., T] the queries' RoPE positions. A sliding layer of Gemma 3 rotates by its own RoPE
    base (`rope_local_theta`). Without a window both are the full layer's.
    """
    full = LayerVariant(mask, *rope_tables(config, positions))
    if config.sliding_window is None:
        return full, full
    window_mask = mask & (distance < config.sliding_window)
    local = config.rope_local_theta is not None
    tables = rope_tables(config, positions, sliding=True) if local else (full.cos, full.sin)
    return full, LayerVariant(window_mask, *tables)


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


def unembedding(params: dict) -> jax.Array:  # [E, V]
    """The output projection: lm_head, or the transposed embedding table when tied (its
    lower-precision copy `tied_unembedding` when `with_matmul_weights` made one)."""
    if "lm_head" in params:
        return params["lm_head"]
    return params.get("tied_unembedding", params["embed"]).T


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


def logits_from_hidden(params: dict, hidden: jax.Array, softcap: float | None = None) -> jax.Array:
    """f32 logits [..., V] from final hidden states [..., E], multiplied in the table's dtype,
    soft-capped to (-softcap, softcap) when given (`config.final_logit_softcapping`).

    A tied table is read as its [V, E] rows, never transposed: XLA:CPU ran a transposed bf16
    copy made inside the program 2-3x slower.
    """
    if "lm_head" in params:
        table, spec = params["lm_head"], "...e,ev->...v"  # [E, V]
    else:
        table = params.get("tied_unembedding", params["embed"])  # [V, E]
        spec = "...e,ve->...v"
    logits = jnp.einsum(spec, hidden.astype(table.dtype), table, preferred_element_type=jnp.float32)
    logits = soft_cap(logits, softcap)
    if logits.ndim == 3:
        logits = constrain(logits, ("batch", "length", "vocab"))
    return logits


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (Gemma 2's soft-capping of attention scores and logits); x if None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def norm_scale(config: ModelConfig, weight: jax.Array) -> jax.Array:
    """The factor an RMSNorm weight stands for: the weight, or Gemma's 1 + weight in f32 (as
    transformers computes it, so a bf16 weight keeps its precision)."""
    if not config.norm_weight_offset:
        return weight
    return weight.astype(jnp.float32) + config.norm_weight_offset


# --- the pure layer ----------------------------------------------------------------------


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, axis: int = -1) -> jax.Array:
    """x / rms(x) * scale over `axis` (scale broadcast against x), in f32, in x's dtype.

    Recomputed from x in the backward pass: plain autodiff keeps the normalised x and
    more of the same size, beside x and the output that the next product keeps anyway.
    """

    @jax.checkpoint
    def normalise(x, scale):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=axis, keepdims=True) + eps)
        return (normed * scale.astype(jnp.float32)).astype(x.dtype)

    return normalise(x, scale)


def inverse_frequencies(config: ModelConfig, sliding: bool = False) -> np.ndarray:  # f32[D/2]
    """RoPE inverse frequencies theta^(-2i/D), with Llama 3 or linear scaling when configured;
    for a sliding layer with its own base (Gemma 3's `rope_local_theta`), that base unscaled."""
    exponents = np.arange(0, config.head_dim, 2, dtype=np.float32) / config.head_dim
    local = sliding and config.rope_local_theta is not None
    theta = config.rope_local_theta if local else config.rope_theta
    inv_freq = (1.0 / (theta**exponents)).astype(np.float32)
    scaling = None if local else config.rope_scaling
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearRopeScaling):
        return (inv_freq / scaling.factor).astype(np.float32)
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope_tables(
    config: ModelConfig, positions: jax.Array, sliding: bool = False
) -> tuple[jax.Array, jax.Array]:
    """cos and sin f32[..., D/2] of positions [...] * inverse frequencies (a sliding layer's
    when `sliding`)."""
    inv_freq = inverse_frequencies(config, sliding)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates [B, T, N, D] by position; halves layout (HF's rotate_half), computed in f32."""
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)


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


def attention_inputs(config, params, x, cos, sin):
    """Queries [B, T, H, D] and keys, values [B, K, T, D] of one layer for x [B, T, E]:
    pre-norm, projections, optional biases and qk-norm, RoPE."""
    q, k, v = token_major_attention_inputs(config, params, x, cos, sin)
    return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def token_major_attention_inputs(config, params, x, cos, sin):
    """`attention_inputs` with keys and values left token-major, [B, T, K, D], for callers
    that split the tokens before attention (`jgrpo.models.group_forward`)."""
    eps = config.rms_norm_eps
    kernels = (params["q_kernel"], params["k_kernel"], params["v_kernel"])
    q, k, v = normed_projections(x, norm_scale(config, params["attn_norm"]), kernels, eps)
    # q [B, T, H, D]; k, v [B, T, K, D]
    if config.qkv_bias:
        q, k, v = q + params["q_bias"], k + params["k_bias"], v + params["v_bias"]
    if config.qk_norm:
        q = rms_norm(q, norm_scale(config, params["q_norm"]), eps)
        k = rms_norm(k, norm_scale(config, params["k_norm"]), eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


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


def activate(x: jax.Array, activation: str) -> jax.Array:
    """The gated MLP's activation: silu, or GELU with the tanh approximation (Gemma)."""
    if activation == "silu":
        return jax.nn.silu(x)
    if activation == "gelu_pytorch_tanh":
        return jax.nn.gelu(x, approximate=True)
    raise ValueError(f"activation {activation!r} is not supported.")


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


def grouped_query_attention(q, k, v, mask, scale=None, softcap=None):
    """softmax(softcap(q k^T * scale)) v with H = K * G query heads sharing each kv head.

    q [B, T, H, D]; k, v [B, K, S, D]; mask bool[B, T, S]. Scores and softmax in f32; the
    scale defaults to D^-1/2 (`config.attention_scale`), `softcap` (Gemma 2) bounds the
    scores (`soft_cap`). The G query heads of a kv head are laid out as G x T rows of one
    matrix, so scores and output are plain batched matmuls over (B, K) with the key axis
    contiguous.
    """
    batch, length, heads, dim = q.shape
    kv_heads = k.shape[1]
    per_kv = heads // kv_heads
    q = q.reshape(batch, length, kv_heads, per_kv, dim).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, D]
    scores = jnp.einsum("bkgtd,bksd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = soft_cap(scores * (dim**-0.5 if scale is None else scale), softcap)
    scores = jnp.where(mask[:, None, None], scores, _MASKED)  # [B, K, G, T, S]
    probs = softmax(scores)
    out = jnp.einsum("bkgts,bksd->bkgtd", probs.astype(v.dtype), v)  # [B, K, G, T, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, heads, dim)


@jax.custom_jvp
def softmax(x: jax.Array) -> jax.Array:
    """Softmax over the last axis whose derivative needs only its output.

    `jax.nn.softmax` differentiates through its exp and division by default and so keeps
    both the unnormalised exponentials and the probabilities for the backward pass: two
    [B, K, G, T, S] tensors per attention layer where one suffices.
    """
    shifted = x - jax.lax.stop_gradient(x.max(axis=-1, keepdims=True))
    weights = jnp.exp(shifted)
    return weights / weights.sum(axis=-1, keepdims=True)


@softmax.defjvp
def _softmax_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    y = softmax(x)
    return y, y * (x_dot - (y * x_dot).sum(axis=-1, keepdims=True))


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
