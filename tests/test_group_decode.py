"""Shared-prefix decoding: one prompt cache per group, equal to the plain decoder."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_hf import FAMILIES, VOCAB

from jgrpo.models.attention import grouped_query_attention
from jgrpo.models.embedding import logits_from_hidden
from jgrpo.models.group_decode import (
    decode_layers,
    decode_logits,
    decode_rope_tables,
    decode_step,
    prefill,
    shared_prefix_attention,
    unembedding_rows,
)
from jgrpo.models.hf import from_pretrained
from jgrpo.models.precision import with_matmul_weights
from jgrpo.models.transformer import forward


@pytest.mark.parametrize("batched_dots", [False, True])
def test_shared_prefix_attention_equals_attention_over_the_copied_prompt(batched_dots):
    """Both forms of the completion part (multiply-reduce on CPU, batched products on
    accelerators) equal ordinary attention over a copied prompt cache."""
    prompts, groups, kv_heads, per_kv, dim, prompt_slots, slots = 3, 4, 2, 3, 8, 5, 6
    rows = prompts * groups
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (rows, 1, kv_heads * per_kv, dim))
    prompt_k, prompt_v = (
        jax.random.normal(k, (prompts, kv_heads, prompt_slots, dim)) for k in keys[1:3]
    )
    completion_k, completion_v = (
        jax.random.normal(k, (rows, kv_heads, slots, dim)) for k in keys[3:5]
    )
    prompt_mask = np.ones((prompts, prompt_slots), np.int32)
    prompt_mask[1, :2] = 0  # left padding
    prompt_mask[2, :4] = 0
    completion_mask = np.arange(slots) <= 3  # slots 4 and 5 not written yet

    keys_t = completion_k.transpose(0, 1, 3, 2)  # the cache holds keys [B, K, D, N]
    got = shared_prefix_attention(
        q,
        prompt_k,
        prompt_v,
        keys_t,
        completion_v,
        prompt_mask,
        completion_mask,
        batched_dots=batched_dots,
    )
    # Reference: the prompt cache copied to each of its G rows, then ordinary attention.
    copied_k = jnp.concatenate([jnp.repeat(prompt_k, groups, 0), completion_k], axis=2)
    copied_v = jnp.concatenate([jnp.repeat(prompt_v, groups, 0), completion_v], axis=2)
    mask = np.concatenate(
        [np.repeat(prompt_mask, groups, 0), np.tile(completion_mask, (rows, 1))], axis=1
    ).astype(bool)[:, None, :]  # [B, 1, S]
    expected = grouped_query_attention(q, copied_k, copied_v, mask)
    assert got.shape == (rows, 1, kv_heads * per_kv, dim)
    np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("matmul_dtype", [None, "bfloat16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_then_group_decode_equals_full_forward(family, matmul_dtype, hf_checkpoint):
    """G rows continue each prompt with their own tokens; every step's logits equal a full
    forward over prompt + completion (left-padded prompts, biases, qk-norm, tied heads), also
    with bf16 weight matrices: the decode rounds the same operands as the forward pass."""
    model = from_pretrained(hf_checkpoint(family)[0])
    params, config = model.params(), model.config
    f32_params = params
    if matmul_dtype:
        params = with_matmul_weights(params, jnp.dtype(matmul_dtype))
    prompts, groups, length = 2, 3, 8
    # f32: 9 tokens, so the sliding layers' rings (windows of 4 to 6) wrap. bf16: 5, where the
    # bound below was measured (a flipped rounding carries to the row's later steps).
    new_tokens = 9 if matmul_dtype is None else 5
    rng = np.random.default_rng(0)
    prompt_ids = rng.integers(3, VOCAB, (prompts, length)).astype(np.int32)
    prompt_mask = np.ones((prompts, length), np.int32)
    prompt_mask[1, :3] = 0
    prompt_ids[1, :3] = 0
    completions = rng.integers(3, VOCAB, (prompts * groups, new_tokens)).astype(np.int32)

    hidden, cache = prefill(
        params,
        jnp.asarray(prompt_ids),
        jnp.asarray(prompt_mask),
        config=config,
        num_generations=groups,
        max_new_tokens=new_tokens,
    )
    softcap = config.final_logit_softcapping
    steps = [np.repeat(np.asarray(logits_from_hidden(params, hidden, softcap)), groups, axis=0)]
    layers, unembedding = decode_layers(params, config), unembedding_rows(params)
    step = jax.jit(decode_step, static_argnames="config")
    lengths = np.repeat(prompt_mask.sum(-1), groups)
    rope = decode_rope_tables(config, length + new_tokens)  # every position reached
    for slot in range(new_tokens - 1):
        hidden, cache = step(
            params,
            layers,
            cache,
            jnp.asarray(completions[:, slot]),
            jnp.asarray(lengths + slot),
            jnp.int32(slot),
            jnp.asarray(prompt_mask),
            rope=rope,
            config=config,
        )
        steps.append(np.asarray(decode_logits(unembedding, hidden, softcap)))
    incremental = np.stack(steps, axis=1)  # [P*G, N, V]

    sequence = np.concatenate([np.repeat(prompt_ids, groups, 0), completions], axis=1)
    mask = np.concatenate([np.repeat(prompt_mask, groups, 0), np.ones_like(completions)], axis=1)
    sequence, mask = jnp.asarray(sequence), jnp.asarray(mask)
    # The reference forward compiles at XLA's default optimisation level, as users run it: at
    # the suite's level 0 (tests/xla_flags.py) XLA:CPU on a host with avx512_bf16 (AMD EPYC,
    # 2026-12-04) rounded this bf16 forward's products differently (qwen3: a mean gap of
    # 2.3e-4 to the level-1 and level-2 programs, which agree exactly), far above the gap below.

    def full_forward(params):
        program = forward.lower(params, sequence, attention_mask=mask, config=config)
        compiled = program.compile({"xla_backend_optimization_level": 2})
        return np.asarray(compiled(params, sequence, attention_mask=mask))[:, length - 1 : -1]

    full = full_forward(params)
    gap = np.abs(incremental - full)
    if matmul_dtype is None:
        assert gap.max() < 1e-5
    else:
        # Equal but where a last-bit difference between the two programs' f32 sums flips an
        # operand's bf16 rounding, which the row's cache then carries to its later steps. How
        # often depends on the host's kernels: on a Zen 4 host with avx512_bf16 (2026-12-04)
        # qwen3 one step of one row (max 6e-4) and mistral two (max 5.4e-3); on a Zen 3 host
        # without AVX-512 (2026-12-08) qwen3 12 of the 30 (row, step) pairs (max 5.9e-3, mean
        # 3.4e-4), gemma3 2, the others none. Rounding the operands the forward pass rounds
        # keeps the gap a small part of what the bf16 weights themselves move the logits
        # (against the f32 forward: means of 4.6e-3 to 7.5e-3 on these models); a decode that
        # cast anything the forward does not cast (or missed a cast) would be of that size.
        weights_effect = np.abs(full - full_forward(f32_params)).mean()
        assert gap.max() < 1e-2 and gap.mean() < 0.1 * weights_effect, (
            gap.max(),
            gap.mean(),
            weights_effect,
        )


def test_decode_layers_cast_in_their_layout_pass_like_cast_parameters(hf_checkpoint):
    """`decode_layers(params, config, bf16)` (the rollout's: f32 kernels cast as they are laid
    out) gives the same arrays as laying out `with_matmul_weights(params, bf16)`."""
    model = from_pretrained(hf_checkpoint("qwen2")[0])  # q/k/v biases stay f32
    params, config = model.params(), model.config
    got = decode_layers(params, config, jnp.bfloat16)
    expected = decode_layers(with_matmul_weights(params, jnp.bfloat16), config)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    assert got[0]["qkv"].dtype == jnp.bfloat16 and got[0]["qkv_bias"].dtype == jnp.float32


def test_decode_products_read_the_weights_as_their_left_operand(hf_checkpoint):
    """Every weight product of a bf16 decode step and its logits is W^T [out, in] @ x^T [in, B],
    contracting the weight's minor axis and the activations' major one: the form in which
    XLA:CPU does not repack the weights on every call (`decode_layers`). A transposed operand
    would also have no bf16 kernel on CPU. (llama3: an untied lm_head.)"""

    def step_and_logits(params, layers, unembedding, cache, *inputs, rope, config):
        hidden, cache = decode_step(params, layers, cache, *inputs, rope=rope, config=config)
        return decode_logits(unembedding, hidden), cache

    model = from_pretrained(hf_checkpoint("llama3")[0])
    config = model.config
    params = with_matmul_weights(model.params(), jnp.bfloat16)
    prompts, groups, slots = 2, 3, 4
    prompt_mask = jnp.ones((prompts, 6), jnp.int32)
    _, cache = prefill(
        params,
        jnp.ones((prompts, 6), jnp.int32),
        prompt_mask,
        config=config,
        num_generations=groups,
        max_new_tokens=slots,
    )
    rows = prompts * groups
    hlo = (
        jax.jit(step_and_logits, static_argnames="config")
        .lower(
            params,
            decode_layers(params, config),
            unembedding_rows(params),
            cache,
            jnp.ones((rows,), jnp.int32),
            jnp.full((rows,), 6, jnp.int32),
            jnp.int32(0),
            prompt_mask,
            rope=decode_rope_tables(config, 6 + slots),
            config=config,
        )
        .compile()
        .as_text()
    )
    products = [line for line in hlo.splitlines() if " dot(" in line and "batch_dims" not in line]
    e, m, d = config.hidden_size, config.intermediate_size, config.head_dim
    qkv = (config.num_heads + 2 * config.num_kv_heads) * d
    # Per layer: q/k/v, o, gate/up, down; then the unembedding. Each [out, B] in f32.
    expected = sorted(
        [f"f32[{qkv},{rows}]", f"f32[{e},{rows}]", f"f32[{2 * m},{rows}]", f"f32[{e},{rows}]"]
        * config.num_layers
        + [f"f32[{config.vocab_size},{rows}]"]
    )
    assert sorted(line.split(" = ")[1].split("{")[0] for line in products) == expected
    for line in products:
        assert "lhs_contracting_dims={1}, rhs_contracting_dims={0}" in line, line


def test_sliding_layers_keep_a_ring_of_their_window(hf_checkpoint):
    """A sliding layer's completion buffers hold its window (4 slots here), a full layer's
    every token, also once a phase grows them; the plan's bytes are those buffers'."""
    from jgrpo.models.group_decode import completion_cache_bytes, grow_completion_cache

    model = from_pretrained(hf_checkpoint("gemma3")[0])
    params, config = model.params(), model.config
    ones = jnp.ones((2, 6), jnp.int32)
    _, cache = prefill(params, ones, ones, config=config, num_generations=3, max_new_tokens=2)
    expected = [min(2, 4) if sliding else 2 for sliding in config.sliding_layers]
    assert [v.shape[2] for v in cache.completion_v] == expected
    cache = grow_completion_cache(cache, 12, config)
    expected = [4 if sliding else 12 for sliding in config.sliding_layers]
    assert config.sliding_layers == (True, True, False, True, False)
    assert [v.shape[2] for v in cache.completion_v] == expected
    assert [k.shape[3] for k in cache.completion_k] == expected
    held = sum(x.nbytes for x in (*cache.completion_k, *cache.completion_v)) // 6  # per row
    assert completion_cache_bytes(config, 12, jnp.float32) == held
