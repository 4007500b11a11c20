"""Decoding G rows per prompt against one shared copy of each prompt's KV cache.

A group rollout's G rows continue the same prompt. The prompt's keys and values are computed
once per prompt ([P, K, Lp, D] per layer) and never copied G times: each row's query attends
to its prompt's cache and to its own completion cache ([P*G, K, N, D] per layer; the keys
stored transposed, [P*G, K, D, N]), with one softmax over both. Prefill time and memory
therefore do not grow with G, and a decode step reads each prompt's cache once for its whole
group.

The decode step unrolls the layers over one cache buffer per layer, so each layer writes its
slot in place. (Scanning the layers over a stacked [L, ...] cache in the scan carry made XLA on
CPU copy the whole cache for each layer: 5x slower per step at 125M parameters.) Its residual
stream runs feature-major, [E, B], with the weights transposed once per rollout
(`decode_layers`): the decode's thin products are fastest that way on CPU.

The unembedding follows the same rule: `decode_logits` multiplies the [V, E] table by the
feature-major hidden states (on a 2-core AMD host 13-14 ms a step for 32 rows of a 49152-token
vocabulary, against 18-23 ms with the table as the right operand).

Rows are prompt-major (row p * G + g answers prompt p). Dimension letters as in
`jgrpo.models.transformer`, plus P prompts, Lp prompt slots, N completion slots.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jgrpo.models.attention import _MASKED, apply_rope, rope_tables
from jgrpo.models.config import ModelConfig
from jgrpo.models.embedding import input_embeddings
from jgrpo.models.mlp import activate, mixture_of_experts
from jgrpo.models.precision import row_major, write_slice
from jgrpo.models.primitives import constrain, norm_scale, rms_norm, soft_cap
from jgrpo.models.projection import LoraKernel
from jgrpo.models.transformer import forward

_CACHE_AXES = ("batch", "kv_heads", "length", "head_dim")
_KEYS_T_AXES = ("batch", "kv_heads", "head_dim", "length")  # completion keys, [B, K, D, N]


class GroupCache(NamedTuple):
    """Per-layer tuples: each prompt's keys/values once, each row's completion keys/values."""

    prompt_k: tuple[jax.Array, ...]  # L x [P, K, Lp, D]
    prompt_v: tuple[jax.Array, ...]  # L x [P, K, Lp, D]
    completion_k: tuple[jax.Array, ...]  # L x [P*G, K, D, N]: slots minor (`decode_step`)
    completion_v: tuple[jax.Array, ...]  # L x [P*G, K, N, D]


def cache_bytes_per_slot(config: ModelConfig, dtype) -> int:
    """Bytes of one token slot of a row's KV cache: keys and values of every layer."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * jnp.dtype(dtype).itemsize


def completion_slots(config: ModelConfig, layer: int, tokens: int) -> int:
    """The slots of `layer`'s completion buffers for `tokens` completion tokens: a sliding
    layer keeps its window's only, a ring in which token t sits at slot t mod W."""
    if config.sliding_layers[layer]:
        return min(tokens, config.sliding_window)
    return tokens


def completion_cache_bytes(config: ModelConfig, tokens: int, dtype) -> int:
    """Bytes of one row's completion caches for `tokens` tokens: every layer's keys and
    values, a sliding layer's for its window at most (`completion_slots`)."""
    per_slot = cache_bytes_per_slot(config, dtype) // config.num_layers  # one layer's
    return per_slot * sum(completion_slots(config, i, tokens) for i in range(config.num_layers))


def decode_layers(params: dict, config: ModelConfig, matmul_dtype=None) -> list[dict]:
    """Each layer's parameters as `decode_step` reads them: weight matrices as [out, in]
    (row-major on CPU, `row_major`), q/k/v stacked into one and gate/up into another, norm
    scales and biases as [out, 1] columns.

    The decode step multiplies W^T [out, in] by activations stored feature-major, x^T [in, B]:
    its thin products (B = P * G rows) then read the weights as the left operand, which
    XLA:CPU multiplies without first repacking them (the right operand is repacked on every
    call; for a [576, 1536] weight that took longer than the product itself). Stacked weights
    make one product whose row blocks are q, k, v (or gate, up). Made once per rollout,
    outside the decode loop: on CPU a transposed copy of the weights, elsewhere a transpose
    that XLA folds into the products. `matmul_dtype` (bf16 sampling weights) casts the weight
    matrices in that same pass; norm scales and biases keep their dtype. LoRA kernels
    (`LoraKernel`) are merged in that pass too, W + s A B summed in f32: decoding then runs
    the full model's products, and no merged copy of the weights exists besides this layout.
    """

    def rows_of(*kernels: jax.Array) -> jax.Array:  # [in, *out] each -> [sum(out), in]
        columns = [kernel.reshape(kernel.shape[0], -1) for kernel in kernels]
        stacked = jnp.concatenate(columns, axis=1).T
        return row_major(stacked if matmul_dtype is None else stacked.astype(matmul_dtype))

    def layer_value(value, i):  # a LoRA kernel merged, W + s A B, in this same pass
        return value[i].merged() if isinstance(value, LoraKernel) else value[i]

    def column(norm):  # [E] -> [E, 1]: the factor it stands for (`norm_scale`), as a column
        return norm_scale(config, norm)[:, None]

    layers = []
    for i in range(config.num_layers):
        p = {name: layer_value(value, i) for name, value in params["layers"].items()}
        layer = {
            "attn_norm": column(p["attn_norm"]),  # [E, 1]
            "qkv": rows_of(p["q_kernel"], p["k_kernel"], p["v_kernel"]),  # [(H + 2K) * D, E]
            "o": rows_of(p["o_kernel"].reshape(-1, config.hidden_size)),  # [E, H*D]
            "mlp_norm": column(p["mlp_norm"]),
        }
        if config.num_experts:  # the experts' stacked weights as they are (`decode_step`)
            for name in ("expert_gate_kernel", "expert_up_kernel", "expert_down_kernel"):
                layer[name] = p[name] if matmul_dtype is None else p[name].astype(matmul_dtype)
            layer["router"] = p["router"]
        else:
            layer["gate_up"] = rows_of(p["gate_kernel"], p["up_kernel"])  # [2M, E]
            layer["down"] = rows_of(p["down_kernel"])  # [E, M]
        if config.qkv_bias:
            biases = [p[name].reshape(-1) for name in ("q_bias", "k_bias", "v_bias")]
            layer["qkv_bias"] = jnp.concatenate(biases)[:, None]  # [(H + 2K) * D, 1]
        if config.qk_norm:
            layer["q_norm"] = norm_scale(config, p["q_norm"])  # [D]
            layer["k_norm"] = norm_scale(config, p["k_norm"])
        if config.post_norms:
            layer["post_attn_norm"] = column(p["post_attn_norm"])
            layer["post_mlp_norm"] = column(p["post_mlp_norm"])
        layers.append(layer)
    return layers


def unembedding_rows(params: dict) -> jax.Array:  # [V, E]
    """The unembedding as `decode_logits` reads it, [V, E]: a tied table as it is, an untied
    lm_head [E, V] transposed once per rollout (on CPU a copy, elsewhere folded)."""
    if "lm_head" in params:
        return row_major(params["lm_head"].T)
    return params.get("tied_unembedding", params["embed"])


def decode_logits(
    unembedding: jax.Array,  # [V, E], `unembedding_rows(params)`
    hidden: jax.Array,  # [E, B], `decode_step`'s feature-major final hidden states
    softcap: float | None = None,  # `config.final_logit_softcapping`
) -> jax.Array:  # f32[B, V]
    """f32 logits of one decode step: the table as the left operand (`decode_layers` says
    why), the [V, B] product then transposed to row-major [B, V] for sampling (and
    soft-capped, Gemma 2)."""
    return soft_cap(row_major(_times(unembedding, hidden.astype(jnp.float32)).T), softcap)


def decode_rope_tables(config: ModelConfig, length: int) -> dict[bool, tuple[jax.Array, jax.Array]]:
    """The RoPE tables `decode_step` reads, of positions 0..length-1, by layer kind: {False:
    (cos, sin) f32[length, D/2] of the full-attention layers, True: the sliding layers'}
    (the same arrays unless the sliding layers have their own base, Gemma 3)."""
    positions = jnp.arange(length)
    full = rope_tables(config, positions)
    if config.rope_local_theta is None:
        return {False: full, True: full}
    return {False: full, True: rope_tables(config, positions, sliding=True)}


def prefill(
    params: dict,
    prompt_ids: jax.Array,  # int32[P, Lp], left-padded
    prompt_mask: jax.Array,  # [P, Lp], 1 on real tokens
    *,
    config: ModelConfig,
    num_generations: int,
    max_new_tokens: int,
    matmul_dtype=None,
    completion_rows: int | None = None,
) -> tuple[jax.Array, GroupCache]:
    """Runs the P prompts once; returns their last hidden states [P, E] and a `GroupCache`
    with the prompts' keys/values and empty completion buffers for P * G rows (or
    `completion_rows`: the slots of a slot rollout). With `matmul_dtype` the products take
    weights cast to it (`forward`'s argument)."""
    hidden, (k, v) = forward(
        params,
        prompt_ids,
        attention_mask=prompt_mask,
        config=config,
        return_hidden=True,
        return_kv=True,
        matmul_dtype=matmul_dtype,
    )  # k, v [L, P, K, Lp, D]
    dtype = params["embed"].dtype
    prompts = prompt_ids.shape[0]
    rows, kv_heads, dim = prompts * num_generations, config.num_kv_heads, config.head_dim
    rows = rows if completion_rows is None else completion_rows
    layers = range(config.num_layers)

    def empty_keys(i):  # [B, K, D, N_i]: transposed, slots minor
        shape = (rows, kv_heads, dim, completion_slots(config, i, max_new_tokens))
        return constrain(jnp.zeros(shape, dtype), _KEYS_T_AXES)

    def empty_values(i):  # [B, K, N_i, D]
        shape = (rows, kv_heads, completion_slots(config, i, max_new_tokens), dim)
        return constrain(jnp.zeros(shape, dtype), _CACHE_AXES)

    cache = GroupCache(
        prompt_k=tuple(constrain(k[i].astype(dtype), _CACHE_AXES) for i in layers),
        prompt_v=tuple(constrain(v[i].astype(dtype), _CACHE_AXES) for i in layers),
        completion_k=tuple(map(empty_keys, layers)),
        completion_v=tuple(map(empty_values, layers)),
    )
    return hidden[:, -1], cache


def grow_completion_cache(cache: GroupCache, tokens: int, config: ModelConfig) -> GroupCache:
    """`cache` with each layer's completion buffers zero-padded to hold `tokens` tokens
    (`completion_slots`: a sliding layer's never beyond its window).

    A decode loop in phases starts with a few slots and grows the buffers between phases, so
    that attention reads only the slots a phase can have written. (Reading a slice of a buffer
    that the loop also updates in place made XLA:CPU copy the buffer twice a step.)
    """

    def grow_keys(x: jax.Array, slots: int) -> jax.Array:  # [B, K, D, N] -> [B, K, D, slots]
        padding = ((0, 0), (0, 0), (0, 0), (0, slots - x.shape[3]))
        return constrain(jnp.pad(x, padding), _KEYS_T_AXES)

    def grow_values(x: jax.Array, slots: int) -> jax.Array:  # [B, K, N, D] -> [B, K, slots, D]
        padding = ((0, 0), (0, 0), (0, slots - x.shape[2]), (0, 0))
        return constrain(jnp.pad(x, padding), _CACHE_AXES)

    slots = [completion_slots(config, i, tokens) for i in range(config.num_layers)]
    return cache._replace(
        completion_k=tuple(map(grow_keys, cache.completion_k, slots)),
        completion_v=tuple(map(grow_values, cache.completion_v, slots)),
    )


def decode_step(
    params: dict,
    layers: list[dict],  # decode_layers(params, config)
    cache: GroupCache,
    tokens: jax.Array,  # int32[P*G], one new token per row
    positions: jax.Array,  # int32[P*G], their RoPE positions
    slot: jax.Array,  # int32 scalar: the completion slot the tokens are written to
    prompt_mask: jax.Array,  # [P, Lp]
    *,
    rope: dict[bool, tuple[jax.Array, jax.Array]],  # `decode_rope_tables(config, T)`
    config: ModelConfig,
    prompt_rows: jax.Array | None = None,  # int32[B]: each row's prompt (slot rollouts)
) -> tuple[jax.Array, GroupCache]:
    """Feeds one token per row; returns the final hidden states, feature-major [E, P*G] (for
    `decode_logits`), and the cache with completion slot `slot` written. Rows attend to their
    prompt and completion slots <= slot. A sliding layer's token attends to the W - 1 before
    it only, and its completion buffers are rings of at most W slots (`completion_slots`):
    token `slot` is written at slot mod W over the token W before it.

    A slot rollout (`jgrpo.rollout`) passes `slot` per row, int32[B] (each row is at its
    own position), and `prompt_rows`, the prompt each row continues: a row then reads its
    prompt's keys and values from the shared prompt table by that index (a gather per layer),
    instead of the prompt-major groups of G rows.

    `rope` holds the RoPE tables of every position the decode reaches,
    `decode_rope_tables(config, T)`, computed once before the decode loop; the step
    looks its rows' positions up. Computed in the step instead, XLA:CPU fuses the sine and
    cosine into every layer's q and k rotation and evaluates them per head (4% of a decode
    step at the benchmark workload, docs/benchmarks.md).

    The residual stream runs feature-major, x^T [E, B], so that every projection is
    W^T [out, in] @ x^T (`decode_layers` says why); attention runs row-major as in the
    forward pass, and only its [B, H*D] inputs and output are transposed.
    """
    eps = config.rms_norm_eps
    rows = tokens.shape[0]
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    per_row = prompt_rows is not None
    query = slot[:, None] if per_row else slot  # [B, 1] | scalar
    if per_row:
        prompt_mask = jnp.take(prompt_mask, prompt_rows, axis=0)  # [B, Lp]
    # Per layer kind: the prompt's mask, the completion buffers' mask, where `slot` is written.
    masks = {}
    for i, is_sliding in enumerate(config.sliding_layers):
        if is_sliding in masks:
            continue
        buffer = jnp.arange(cache.completion_v[i].shape[2])  # [N_i]
        if not is_sliding:
            masks[False] = (prompt_mask, buffer <= query, slot)  # [B, N] | [N]
            continue
        # A sliding layer keeps keys fewer than W slots back: prompt slot j lies Lp + slot - j
        # before the query (prompts are left-padded, so slots and positions agree); its ring
        # holds the W latest tokens once `slot` reaches W, the slots <= `slot` before.
        window = config.sliding_window
        prompt_slots = prompt_mask.shape[-1]
        prompt_distance = prompt_slots - jnp.arange(prompt_slots) + query  # [B, Lp] | [Lp]
        masks[True] = (
            prompt_mask * (prompt_distance < window),  # [P | B, Lp]
            (buffer <= query) | (query >= window),
            slot % window,
        )
    cos_sin = {
        kind: tuple(jnp.take(table, positions, axis=0)[:, None] for table in tables)
        for kind, tables in rope.items()
    }  # [B, 1, D/2] each
    x = input_embeddings(params, tokens, config)  # [B, E]
    x = _feature_major(row_major(x.T))  # [E, B]
    new_k, new_v = [], []
    for i, layer in enumerate(layers):
        is_sliding = config.sliding_layers[i]
        cos, sin = cos_sin[is_sliding]
        layer_prompt_mask, layer_completion_mask, written = masks[is_sliding]
        h = rms_norm(x, layer["attn_norm"], eps, axis=0)  # [E, B]
        qkv = _times(layer["qkv"], h)  # [(H + 2K) * D, B]
        if config.qkv_bias:
            qkv = qkv + layer["qkv_bias"]
        qkv = row_major(qkv.T)  # [B, (H + 2K) * D]: one transposed copy for all three
        q, k, v = jnp.split(qkv, [heads * dim, (heads + kv_heads) * dim], axis=1)
        q = q.reshape(rows, 1, heads, dim)  # [B, 1, H, D]
        k = k.reshape(rows, 1, kv_heads, dim)
        v = v.reshape(rows, kv_heads, 1, dim)  # [B, K, 1, D]
        if config.qk_norm:
            q, k = rms_norm(q, layer["q_norm"], eps), rms_norm(k, layer["k_norm"], eps)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin).transpose(0, 2, 3, 1)  # [B, K, D, 1]: cached transposed
        if per_row:
            completion_k = write_rows(cache.completion_k[i], k[..., 0], written, axis=3)
            completion_v = write_rows(cache.completion_v[i], v[:, :, 0], written, axis=2)
            prompt_k = jnp.take(cache.prompt_k[i], prompt_rows, axis=0)  # [B, K, Lp, D]
            prompt_v = jnp.take(cache.prompt_v[i], prompt_rows, axis=0)
        else:
            completion_k = write_slice(cache.completion_k[i], k, (0, 0, 0, written))
            completion_v = write_slice(cache.completion_v[i], v, (0, 0, written, 0))
            prompt_k, prompt_v = cache.prompt_k[i], cache.prompt_v[i]
        attention = shared_prefix_attention(
            q,
            prompt_k,
            prompt_v,
            completion_k,
            completion_v,
            layer_prompt_mask,
            layer_completion_mask,
            scale=config.attention_scale,
            softcap=config.attn_logit_softcapping,
        )  # [B, 1, H, D]
        attention = row_major(attention.reshape(rows, heads * dim).T)  # [H*D, B]
        out = _times(layer["o"], attention)  # [E, B]
        if config.post_norms:
            out = rms_norm(out, layer["post_attn_norm"], eps, axis=0)
        x = x + out
        h = rms_norm(x, layer["mlp_norm"], eps, axis=0)
        if config.num_experts:  # the rows' chosen experts, row-major as in the forward pass
            out = row_major(mixture_of_experts(config, layer, row_major(h.T))[0].T)  # [E, B]
        else:
            gate, up = jnp.split(_times(layer["gate_up"], h), 2)  # [M, B] each
            hidden = constrain(activate(gate, config.hidden_act) * up, ("mlp", "batch"))
            out = _times(layer["down"], hidden)  # [E, B]
        if config.post_norms:
            out = rms_norm(out, layer["post_mlp_norm"], eps, axis=0)
        x = _feature_major(x + out)
        new_k.append(completion_k)
        new_v.append(completion_v)
    final_norm = norm_scale(config, params["final_norm"])[:, None]
    hidden = rms_norm(x, final_norm, eps, axis=0)  # [E, B]
    return hidden, cache._replace(completion_k=tuple(new_k), completion_v=tuple(new_v))


def write_rows(buffer: jax.Array, update: jax.Array, positions: jax.Array, axis: int) -> jax.Array:
    """`buffer` [B, ...] with row b's `update[b]` written at index `positions[b]` of `axis`
    (a per-row `write_slice`: one scatter, in place). Narrow dtypes go through their bits, as
    in `write_slice`."""
    index = [jnp.arange(buffer.shape[0]), *(slice(None),) * (buffer.ndim - 1)]
    index[axis] = positions
    update = update.astype(buffer.dtype)
    if buffer.dtype.itemsize >= 4:
        return buffer.at[tuple(index)].set(update)
    bits = jnp.dtype(f"uint{8 * buffer.dtype.itemsize}")
    written = (
        jax.lax.bitcast_convert_type(buffer, bits)
        .at[tuple(index)]
        .set(jax.lax.bitcast_convert_type(update, bits))
    )
    return jax.lax.bitcast_convert_type(written, buffer.dtype)


def _times(weight: jax.Array, x: jax.Array) -> jax.Array:
    """weight [out, in] @ x [in, B] in the weight's dtype, summed in f32; in x's dtype.

    The product is pinned row-major (`row_major`): a transpose of it (the queries, keys and
    values go back to row-major [B, ...]) would otherwise be folded into the product as
    transposed operands, which XLA:CPU has no bf16 kernel for.
    """
    product = jnp.dot(weight, x.astype(weight.dtype), preferred_element_type=jnp.float32)
    return row_major(product.astype(x.dtype))


def _feature_major(x: jax.Array) -> jax.Array:  # [E, B]
    """The residual stream's placement on a mesh: rows (tokens) split like the batch."""
    return constrain(x, (None, "batch"))


def shared_prefix_attention(
    q: jax.Array,  # [P*G, 1, H, D]
    prompt_k: jax.Array,  # [P, K, Lp, D]
    prompt_v: jax.Array,  # [P, K, Lp, D]
    completion_k: jax.Array,  # [P*G, K, D, N]: transposed, slots minor
    completion_v: jax.Array,  # [P*G, K, N, D]
    prompt_mask: jax.Array,  # [P, Lp]
    completion_mask: jax.Array,  # bool[N], the same for every row, or bool[P*G, N]
    *,
    scale: float | None = None,
    softcap: float | None = None,
    batched_dots: bool | None = None,
) -> jax.Array:  # [P*G, 1, H, D]
    """One query token per row attending to its prompt's slots and its own completion slots:
    softmax over the concatenation of both, computed without building it. Scores in f32,
    scaled by `scale` (D^-1/2 by default) and soft-capped by `softcap` when given.

    A row's own slots are read by batched matrix products where `batched_dots` (the default
    off CPU) and by fused multiply-reduces otherwise (the default on CPU): each is the fast
    form on its backend (docs/benchmarks.md). They agree to rounding.
    """
    if batched_dots is None:
        batched_dots = jax.default_backend() != "cpu"
    rows, _, heads, dim = q.shape
    prompts, kv_heads, prompt_slots, _ = prompt_k.shape
    groups, per_kv = rows // prompts, heads // kv_heads
    scale = dim**-0.5 if scale is None else scale
    q = q.reshape(rows, kv_heads, per_kv, dim).astype(jnp.float32)  # [B, K, G', D]

    # The G rows of a prompt share its keys: one [G*G', D] x [D, Lp] product per prompt and head.
    q_by_prompt = q.reshape(prompts, groups, kv_heads, per_kv, dim)
    prompt_scores = soft_cap(
        jnp.einsum("pgkhd,pkld->pgkhl", q_by_prompt, prompt_k, preferred_element_type=jnp.float32)
        * scale,
        softcap,
    )  # [P, G, K, G', Lp]
    prompt_scores = jnp.where(prompt_mask[:, None, None, None, :] > 0, prompt_scores, _MASKED)
    prompt_scores = prompt_scores.reshape(rows, kv_heads, per_kv, prompt_slots)
    # Each row's own keys. On CPU a multiply-reduce, which XLA fuses (a batched dot of one
    # query row per (row, kv head) is slower there); with the keys stored [B, K, D, N] it sums
    # over a major axis along the contiguous slots: 0.17 against 0.29 ms a layer at the compare
    # workload's decode shapes on a 2-core AMD host. On a GPU the same reduction ran ~5x slower
    # than batched products (docs/benchmarks.md).
    completion_k = completion_k.astype(jnp.float32)
    if batched_dots:
        completion_scores = jnp.einsum("bkhd,bkdn->bkhn", q, completion_k) * scale
    else:
        completion_scores = jnp.sum(q[..., None] * completion_k[:, :, None], axis=-2) * scale
    completion_scores = soft_cap(completion_scores, softcap)
    # completion_scores [B, K, G', N]
    if completion_mask.ndim == 2:  # per row
        completion_mask = completion_mask[:, None, None, :]
    completion_scores = jnp.where(completion_mask, completion_scores, _MASKED)

    top = jnp.maximum(
        prompt_scores.max(-1, keepdims=True), completion_scores.max(-1, keepdims=True)
    )  # [B, K, G', 1]
    prompt_weights = jnp.exp(prompt_scores - top)
    completion_weights = jnp.exp(completion_scores - top)
    total = prompt_weights.sum(-1, keepdims=True) + completion_weights.sum(-1, keepdims=True)

    from_prompt = jnp.einsum(
        "pgkhl,pkld->pgkhd",
        prompt_weights.reshape(prompts, groups, kv_heads, per_kv, prompt_slots),
        prompt_v.astype(jnp.float32),
    ).reshape(rows, kv_heads, per_kv, dim)
    completion_v = completion_v.astype(jnp.float32)
    if batched_dots:
        from_completion = jnp.einsum("bkhn,bknd->bkhd", completion_weights, completion_v)
    else:
        from_completion = jnp.sum(completion_weights[..., None] * completion_v[:, :, None], axis=-2)
    # from_completion [B, K, G', D]
    out = (from_prompt + from_completion) / total
    return out.reshape(rows, 1, heads, dim).astype(prompt_v.dtype)
