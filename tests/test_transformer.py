"""The NNX decoder: logit parity with transformers, KV-cache decoding, dtypes, remat."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals
from tiny_hf import FAMILIES, VOCAB

import jgrpo
from jgrpo.models.attention import (
    _MASKED,
    attention_inputs,
    inverse_frequencies,
    rope_tables,
    softmax,
)
from jgrpo.models.config import preset
from jgrpo.models.hf import from_pretrained
from jgrpo.models.mlp import gated_projection
from jgrpo.models.primitives import rms_norm
from jgrpo.models.projection import normed_projections, project_each
from jgrpo.models.transformer import Transformer, forward, init_cache


def batch(seed=0, length=11):
    """Token ids [2, T] and a mask whose second row is left-padded by 4."""
    ids = np.random.default_rng(seed).integers(3, VOCAB, size=(2, length))
    mask = np.ones((2, length), np.int64)
    mask[1, :4] = 0
    return ids, mask


def torch_logits(torch_model, ids, mask=None):
    kwargs = {}
    if mask is not None:  # HF needs the positions of a left-padded row spelled out
        kwargs = dict(
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(np.maximum(mask.cumsum(-1) - 1, 0)),
        )
    with torch.no_grad():
        return torch_model(torch.tensor(ids), **kwargs).logits.numpy()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(family, hf_checkpoint):
    directory, torch_model = hf_checkpoint(family)
    model = from_pretrained(directory)
    ids, mask = batch()

    expected = torch_logits(torch_model, ids)
    assert np.abs(expected).max() > 1.0  # logits large enough for the tolerance to mean much
    np.testing.assert_allclose(model(jnp.asarray(ids)), expected, atol=1e-4, rtol=0)

    expected = torch_logits(torch_model, ids, mask)
    got = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    real = mask.astype(bool)  # padding positions' outputs are meaningless on both sides
    np.testing.assert_allclose(got[real], expected[real], atol=1e-4, rtol=0)
    # The padded row equals the same tokens run alone, unpadded.
    alone = np.asarray(model(jnp.asarray(ids[1:, 4:])))
    np.testing.assert_allclose(got[1, 4:], alone[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("family", "switches"),
    [
        ("mistral", {"sliding_window": None}),
        ("gemma2", {"sliding_window": None, "layer_types": None}),
        ("gemma2", {"attn_logit_softcapping": None}),
        ("gemma2", {"final_logit_softcapping": None}),
        ("gemma3", {"sliding_window": None, "layer_types": None}),
        ("gemma3", {"rope_local_theta": None}),
        ("gemma3", {"query_pre_attn_scalar": None}),
        ("qwen3_moe", {"norm_topk_prob": False}),
        ("qwen3_moe", {"experts_per_token": 1}),
    ],
)
def test_the_parity_tests_exercise_each_switch(family, switches, hf_checkpoint):
    """Turning a switch off changes the tiny checkpoints' logits well past the parity
    tolerance: the windows are shorter than the tests' rows, the caps small enough to bite."""
    model = from_pretrained(hf_checkpoint(family)[0])
    ids, _ = batch()
    params = model.params()
    on = forward(params, jnp.asarray(ids), config=model.config)
    off = forward(params, jnp.asarray(ids), config=model.config.replace(**switches))
    assert np.abs(np.asarray(on) - np.asarray(off)).max() > 1e-2


def test_llama3_rope_scaling_changes_frequencies():
    config = preset("llama3.2-1b")
    scaled = inverse_frequencies(config)
    plain = inverse_frequencies(config.replace(rope_scaling=None))
    np.testing.assert_array_equal(scaled[:8], plain[:8])  # short wavelengths kept
    np.testing.assert_allclose(scaled[-4:], plain[-4:] / 32.0, rtol=1e-6)  # long ones slowed


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_then_decode_equals_full_forward(family, hf_checkpoint):
    model = from_pretrained(hf_checkpoint(family)[0])
    ids, mask = batch(seed=1)
    full = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))

    slots = 16  # more slots than tokens: the unused ones stay masked
    slot_mask = np.zeros((2, slots), np.int32)
    slot_mask[:, : ids.shape[1]] = mask
    graphdef, state = nnx.split(model)

    traces = []

    @jax.jit
    def step(state, ids, cache):
        traces.append(ids.shape)
        return nnx.merge(graphdef, state)(ids, attention_mask=jnp.asarray(slot_mask), cache=cache)

    cache = init_cache(model.config, 2, slots)
    logits, cache = step(state, jnp.asarray(ids[:, :7]), cache)
    pieces = [logits]
    for t in range(7, ids.shape[1]):
        logits, cache = step(state, jnp.asarray(ids[:, t : t + 1]), cache)
        pieces.append(logits)
    assert int(cache.index) == ids.shape[1]
    assert traces == [(2, 7), (2, 1)]  # one program for the prefill, one for every decode step
    incremental = np.concatenate(pieces, axis=1)
    real = mask.astype(bool)
    np.testing.assert_allclose(incremental[real], full[real], atol=1e-5, rtol=0)


def test_bf16_parameters_stay_close_to_f32(hf_checkpoint):
    directory, _ = hf_checkpoint("qwen2")
    ids, mask = batch()
    f32 = np.asarray(from_pretrained(directory)(jnp.asarray(ids)))
    model = from_pretrained(directory, dtype=jnp.bfloat16)
    assert model.layers.q_kernel[...].dtype == jnp.bfloat16
    bf16 = model(jnp.asarray(ids))
    assert bf16.dtype == jnp.float32  # logits are computed in f32
    # Measured max |bf16 - f32| on these tiny checkpoints, logits up to ~3: qwen2 0.037,
    # llama3 0.048, qwen3 0.034 (bf16 keeps 8 mantissa bits). The bound leaves 2x headroom.
    np.testing.assert_allclose(bf16, f32, atol=0.08, rtol=0)


def test_hidden_states_feed_the_chunked_logprobs(hf_checkpoint):
    """Training never builds [B, T, V]: hidden states + unembedding give the same log-probs."""
    for family in ("llama3", "qwen2", "gemma2"):  # untied, tied embeddings; capped logits
        model = from_pretrained(hf_checkpoint(family)[0])
        ids, mask = batch()
        targets = jnp.asarray(np.roll(ids, -1, axis=1))
        hidden = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask), return_hidden=True)
        logits = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask))
        softcap = model.config.final_logit_softcapping
        chunked = jgrpo.chunked_token_logprobs(
            hidden, model.unembedding, targets, chunk_size=32, softcap=softcap
        )
        full = jgrpo.token_logprobs(logits, targets)
        np.testing.assert_allclose(chunked[0], full[0], atol=1e-5)


def test_remat_gives_the_same_gradients():
    config = preset("tiny")
    params = Transformer(config, rngs=nnx.Rngs(0)).params()
    ids = jnp.asarray(batch()[0] % config.vocab_size)

    def grads(remat):
        def loss(params):
            logits = forward(params, ids, config=config.replace(remat=remat))
            return jgrpo.token_logprobs(logits[:, :-1], ids[:, 1:])[0].mean()

        return jax.jit(jax.grad(loss))(params)

    plain, rematerialised = grads(False), grads(True)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(rematerialised), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


def saved_shapes(capsys, fn, *args) -> list[str]:
    """Shapes of what `fn`'s backward pass keeps from its forward pass, sorted."""
    capsys.readouterr()
    print_saved_residuals(fn, *args)
    return sorted(line.split()[0] for line in capsys.readouterr().out.splitlines())


def test_attention_softmax_matches_jax_and_keeps_only_its_output(capsys):
    rng = np.random.default_rng(0)
    scores = jnp.asarray(rng.normal(size=(3, 5)) * 4, jnp.float32)
    scores = scores.at[0, 3:].set(_MASKED).at[2].set(_MASKED)  # masked keys; a masked row
    values = jnp.asarray(rng.normal(size=(5, 4)), jnp.float32)

    def loss(fn):
        return lambda s, v: (fn(s) @ v).sum()

    np.testing.assert_allclose(softmax(scores), jax.nn.softmax(scores), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(softmax(scores)[2], np.full(5, 0.2), rtol=1e-6)
    ours = jax.grad(loss(softmax), argnums=(0, 1))(scores, values)
    reference = jax.grad(loss(jax.nn.softmax), argnums=(0, 1))(scores, values)
    for a, b in zip(ours, reference, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # The probabilities and the values, nothing else (jax.nn.softmax, by default, also keeps
    # the exponentials and their sums).
    assert saved_shapes(capsys, loss(softmax), scores, values) == ["f32[3,5]", "f32[5,4]"]


@pytest.mark.parametrize(
    ("activation", "reference"),
    [("silu", jax.nn.silu), ("gelu_pytorch_tanh", lambda x: jax.nn.gelu(x, approximate=True))],
)
def test_gated_projection_recomputes_its_input_in_the_backward_pass(activation, reference, capsys):
    """SwiGLU and GeGLU (Gemma's tanh GELU, the same as torch's, below)."""
    rng = np.random.default_rng(1)
    gate, up = (jnp.asarray(rng.normal(size=(3, 6)) * 3, jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)

    def ours_fn(g, u, w):
        return gated_projection(g, u, w, activation)

    def loss(fn):
        return lambda g, u, w: fn(g, u, w).sum()

    def plain(g, u, w):
        return (reference(g) * u) @ w

    np.testing.assert_allclose(ours_fn(gate, up, down), plain(gate, up, down), rtol=1e-6, atol=1e-6)
    ours = jax.grad(loss(ours_fn), argnums=(0, 1, 2))(gate, up, down)
    expected = jax.grad(loss(plain), argnums=(0, 1, 2))(gate, up, down)
    for a, b in zip(ours, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # gate, up and the kernel: neither the activation's intermediates nor the product's input.
    assert saved_shapes(capsys, loss(ours_fn), gate, up, down) == [
        "f32[3,6]",
        "f32[3,6]",
        "f32[6,4]",
    ]
    assert saved_shapes(capsys, loss(plain), gate, up, down).count("f32[3,6]") > 3
    torch_gate = torch.nn.functional.gelu(torch.tensor(np.asarray(gate)), approximate="tanh")
    if activation == "gelu_pytorch_tanh":
        np.testing.assert_allclose(reference(gate), torch_gate.numpy(), rtol=1e-6, atol=1e-6)


def test_rms_norm_recomputes_the_normalised_input_in_the_backward_pass(capsys):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(3, 6)) * 2, jnp.float32)
    scale = jnp.asarray(rng.normal(size=(6,)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
    expected = x / np.sqrt((np.asarray(x) ** 2).mean(-1, keepdims=True) + 1e-6) * scale
    np.testing.assert_allclose(rms_norm(x, scale, 1e-6), expected, rtol=1e-6, atol=1e-6)

    def loss(x, scale, weight):
        return (rms_norm(x, scale, 1e-6) @ weight).sum()

    def projected_loss(x, scale, weight):  # the norm and the product as one unit
        (product,) = normed_projections(x, scale, (weight,), 1e-6)
        return product.sum()

    def unnormalised_loss(x, scale, weight):  # the same function, written out
        rms = jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        return (x / rms * scale @ weight).sum()

    reference = jax.grad(unnormalised_loss, argnums=(0, 1, 2))(x, scale, weight)
    for fn in (loss, projected_loss):
        ours = jax.grad(fn, argnums=(0, 1, 2))(x, scale, weight)
        for a, b in zip(ours, reference, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # x, the scale, the weight and the product's input: nothing of the normalisation itself.
    assert saved_shapes(capsys, loss, x, scale, weight) == [
        "f32[3,6]",
        "f32[3,6]",
        "f32[6,4]",
        "f32[6]",
    ]
    # With the product in the unit, not even its input: x is what the backward pass starts from.
    assert saved_shapes(capsys, projected_loss, x, scale, weight) == [
        "f32[3,6]",
        "f32[6,4]",
        "f32[6]",
    ]


def test_projections_share_one_reshape_of_their_input_and_keep_kernels_as_they_are(capsys):
    config = preset("tiny")  # E = 64, H = 4, K = 2, D = 16
    params = Transformer(config, rngs=nnx.Rngs(0)).params()
    layer = {name: value[0] for name, value in params["layers"].items()}
    x = jax.random.normal(jax.random.key(0), (2, 7, config.hidden_size))
    q, o = layer["q_kernel"], layer["o_kernel"]  # [E, H, D], [H, D, E]
    (projected,) = project_each(x, (q,))
    np.testing.assert_allclose(projected, jnp.einsum("bte,ehd->bthd", x, q), rtol=1e-5, atol=1e-5)
    (back,) = project_each(projected, (o,), contract=2)
    np.testing.assert_allclose(
        back, jnp.einsum("bthd,hde->bte", projected, o), rtol=1e-5, atol=1e-5
    )

    cos, sin = rope_tables(config, jnp.broadcast_to(jnp.arange(7), (2, 7)))

    def loss(layer, x):
        return sum(a.sum() for a in attention_inputs(config, layer, x, cos, sin))

    saved = saved_shapes(capsys, loss, layer, x)
    # x, once for q, k and v; no normed copy of it (recomputed) and no reshaped one
    assert saved.count("f32[2,7,64]") == 1 and "f32[14,64]" not in saved
    assert saved.count("f32[64,4,16]") == 1 and saved.count("f32[64,2,16]") == 2  # the kernels
    assert "f32[64,64]" not in saved and "f32[64,32]" not in saved  # no reshaped kernels


def test_scanned_and_unrolled_layers_agree(monkeypatch, request):
    """Shallow models loop over their layers in Python, deeper ones scan: same results."""
    from jgrpo import models
    from jgrpo.models.group_forward import group_completion_hidden

    config = preset("tiny")
    assert config.num_layers <= models.transformer.MAX_UNROLLED_LAYERS  # tiny: unrolled
    params = Transformer(config, rngs=nnx.Rngs(0)).params()
    ids = jnp.asarray(batch()[0] % config.vocab_size)  # [2, T]; rows 0 and 1 as two groups
    prompt_length = ids.shape[1] // 2

    def loss(params):
        logits = forward(params, ids, config=config)
        plain = jgrpo.token_logprobs(logits[:, :-1], ids[:, 1:])[0].mean()
        hidden = group_completion_hidden(
            params,
            ids,
            jnp.ones_like(ids),
            config=config,
            group_size=1,
            completion_length=ids.shape[1] - prompt_length,
        )
        return plain + jnp.mean(hidden**2)

    def value_and_grads():
        jax.clear_caches()  # `forward` is jitted: trace it again under the current setting
        assert ("scan" in str(jax.make_jaxpr(loss)(params))) == (
            config.num_layers > models.transformer.MAX_UNROLLED_LAYERS
        )
        return jax.jit(jax.value_and_grad(loss))(params)

    unrolled = value_and_grads()
    monkeypatch.setattr(models.transformer, "MAX_UNROLLED_LAYERS", 0)
    request.addfinalizer(jax.clear_caches)  # leave no scanned trace to later tests
    scanned = value_and_grads()
    for a, b in zip(jax.tree.leaves(unrolled), jax.tree.leaves(scanned), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("mesh_shape", "scans"), [((8, 1, 1), False), ((4, 2, 1), True), ((4, 1, 2), True)]
)
def test_shallow_models_scan_when_the_mesh_splits_their_weights(mesh_shape, scans):
    """Split weights are gathered one layer at a time by a scan; an unrolled loop would hold
    every layer's gathered weights at once."""
    from jgrpo.sharding import make_mesh, rules_context

    config = preset("tiny")
    params = Transformer(config, rngs=nnx.Rngs(0)).params()
    ids = jnp.zeros((8, 4), jnp.int32)
    jax.clear_caches()  # `forward` is jitted and reads the mesh and rules while it traces
    with rules_context(make_mesh(mesh_shape)):
        program = str(jax.make_jaxpr(lambda p: forward(p, ids, config=config))(params))
    assert ("scan" in program) == scans


def test_bf16_weight_matrices_multiply_rounded_inputs_and_sum_in_f32():
    from jgrpo.models.embedding import logits_from_hidden
    from jgrpo.models.precision import with_matmul_weights
    from jgrpo.models.projection import project

    config = preset("tiny").replace(tie_word_embeddings=True)
    params = Transformer(config, rngs=nnx.Rngs(0)).params()
    assert "lm_head" not in params  # tied: the bf16 copy of the table is for the logits only
    low = with_matmul_weights(params, jnp.bfloat16)
    assert {k: v.dtype for k, v in low["layers"].items()} == {
        k: jnp.bfloat16 if k.endswith("_kernel") else jnp.float32 for k in params["layers"]
    }
    assert low["embed"].dtype == jnp.float32 and low["final_norm"].dtype == jnp.float32
    np.testing.assert_array_equal(low["tied_unembedding"], params["embed"].astype(jnp.bfloat16))
    assert "lm_head" not in low

    def rounded(a):  # bf16 values, exactly, in f64
        return np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32), np.float64)

    x = jax.random.normal(jax.random.key(1), (2, 3, config.hidden_size))  # f32 activations
    kernel = low["layers"]["up_kernel"][0]  # [E, M] in bf16
    out = project(x, kernel)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, rounded(x) @ rounded(kernel), rtol=1e-5, atol=1e-6)
    logits = logits_from_hidden(low, x)
    expected = rounded(x) @ rounded(params["embed"]).T
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scanned", [False, True])
def test_forward_matmul_dtype_equals_forward_over_cast_weights(scanned, monkeypatch, request):
    """`forward(..., matmul_dtype=bf16)` casts each layer's kernels inside the layer loop; it
    computes exactly what a forward over `with_matmul_weights(params, bf16)` computes, with
    and without a KV cache, scanned or unrolled."""
    from jgrpo import models
    from jgrpo.models.precision import with_matmul_weights

    if scanned:
        monkeypatch.setattr(models.transformer, "MAX_UNROLLED_LAYERS", 0)
    jax.clear_caches()  # `forward` is jitted: trace it again under the current setting
    request.addfinalizer(jax.clear_caches)  # and leave no scanned trace to later tests
    config = preset("tiny")
    params = Transformer(config, rngs=nnx.Rngs(0)).params()
    cast = with_matmul_weights(params, jnp.bfloat16)
    ids = jnp.asarray(batch()[0] % config.vocab_size)  # [2, T]
    got = forward(params, ids, config=config, matmul_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(got, forward(cast, ids, config=config))
    assert not np.array_equal(got, forward(params, ids, config=config))  # bf16 did round

    cache = init_cache(config, ids.shape[0], ids.shape[1] + 2)
    got, got_cache = forward(params, ids, config=config, cache=cache, matmul_dtype=jnp.bfloat16)
    expected, expected_cache = forward(cast, ids, config=config, cache=cache)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got_cache.k, expected_cache.k)


def test_a_bf16_kv_cache_is_written_in_place():
    """A cached forward of a bf16 model writes its new slots into the bf16 [L, B, K, S, D]
    cache without widening it to f32 around the dynamic-update-slice (`write_slice`; the
    group decode has its own check in test_sampling)."""
    config = preset("tiny")
    params = Transformer(config, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16).params()
    cache = init_cache(config, 2, 16, jnp.bfloat16)

    def step(params, ids, cache):
        return forward(params, ids, config=config, cache=cache, attention_mask=jnp.ones((2, 16)))

    ids = jnp.ones((2, 1), jnp.int32)
    hlo = jax.jit(step).lower(params, ids, cache).compile().as_text()
    shape = ",".join(map(str, cache.k.shape)) + "]"
    writes = re.findall(r"= (\w+)\[" + re.escape(shape) + r"\S* dynamic-update-slice\(", hlo)
    assert len(writes) >= 2  # keys and values
    assert "f32" not in writes, writes  # 16 bits wide (bf16, or its bits)


def test_mixed_matmul_rounds_operands_and_cotangent_and_sums_in_f32():
    """Forward and backward are bf16 products of the rounded operands (the cotangent rounded
    too), summed in f32; the f32 operand's gradient stays f32."""
    from jgrpo.models.precision import mixed_matmul

    def rounded(a):  # bf16 values, exactly, in f64
        return np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32), np.float64)

    keys = jax.random.split(jax.random.key(0), 3)
    a = jax.random.normal(keys[0], (24, 40))  # f32 activations [N, I]
    b = jax.random.normal(keys[1], (40, 56)).astype(jnp.bfloat16)  # bf16 kernel [I, O]
    cotangent = jax.random.normal(keys[2], (24, 56))
    out, pullback = jax.vjp(mixed_matmul, a, b)
    grad_a, grad_b = jax.jit(pullback)(cotangent)
    assert (out.dtype, grad_a.dtype, grad_b.dtype) == (jnp.float32, jnp.float32, jnp.bfloat16)
    np.testing.assert_allclose(out, rounded(a) @ rounded(b), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad_a, rounded(cotangent) @ rounded(b).T, rtol=1e-5, atol=1e-5)
    # grad_b is summed in f32, then rounded to b's dtype: within half a bf16 step of exact.
    exact_b = rounded(a).T @ rounded(cotangent)
    np.testing.assert_allclose(grad_b.astype(jnp.float32), exact_b, rtol=2**-8, atol=1e-6)


def test_mixed_matmul_backward_multiplies_only_bf16_operands():
    """On CPU the backward's transposed operands are written out in row-major order, so no
    product of the compiled program falls back to f32 operands (XLA:CPU's fast bf16
    products take only untransposed operands)."""
    from jgrpo.models.precision import mixed_matmul

    def loss(a, b):
        return (mixed_matmul(a, b) ** 2).sum()

    a, b = jnp.ones((64, 48)), jnp.ones((48, 80), jnp.bfloat16)
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(a, b).compile().as_text()
    shapes = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    dots = re.findall(r"= \w+\[[^\]]*\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)", hlo)
    assert len(dots) == 3, hlo  # forward, and the gradients of a and b
    assert {shapes[name] for dot in dots for name in dot} == {"bf16"}


def test_every_parameter_has_logical_axes():
    model = Transformer(preset("tiny").replace(qkv_bias=True, qk_norm=True), rngs=nnx.Rngs(0))
    known = {"batch", "length", "embed", "vocab", "heads", "kv_heads", "head_dim", "mlp", "layers"}
    params = nnx.state(model, nnx.Param)
    specs = nnx.get_partition_spec(params)
    for spec, value in zip(jax.tree.leaves(specs), jax.tree.leaves(params), strict=True):
        assert len(spec) == value.ndim and set(spec) <= known, spec
    assert nnx.get_partition_spec(params)["layers"]["q_kernel"] == jax.P(
        "layers", "embed", "heads", "head_dim"
    )
    count = sum(v.size for v in jax.tree.leaves(params))
    assert count == model.config.num_params


def test_attention_mask_shape_is_checked():
    model = Transformer(preset("tiny"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"attention_mask must have shape \[B, T\]"):
        model(jnp.zeros((2, 5), jnp.int32), attention_mask=jnp.ones((2, 6)))


def test_logical_axes_shard_the_model_over_a_mesh():
    """Under a mesh and a rules table, the same forward runs sharded and gives the same logits."""
    config = preset("tiny")
    model = Transformer(config, rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.concatenate([batch()[0], batch(seed=1)[0]]) % config.vocab_size)  # [4, T]
    expected = model(ids)

    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rules = (
        ("batch", "data"),
        ("heads", "tensor"),
        ("kv_heads", "tensor"),
        ("mlp", "tensor"),
        ("vocab", "tensor"),
    )
    params = model.params()
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        shardings = jax.tree.map(
            lambda spec: jax.NamedSharding(mesh, nn.logical_to_mesh_axes(spec, rules)),
            specs,
            is_leaf=lambda x: isinstance(x, jax.P),
        )
        shardings = nnx.to_pure_dict(shardings)
        sharded = jax.device_put(params, shardings)
        # q_kernel [L, E, H, D]: its 4 heads split over tensor=2.
        assert sharded["layers"]["q_kernel"].addressable_shards[0].data.shape == (2, 64, 2, 16)
        logits = jax.jit(lambda p, i: forward(p, i, config=config))(sharded, ids)
    # Logits [B, T, V] constrained to (batch -> data, vocab -> tensor).
    assert logits.addressable_shards[0].data.shape == (1, ids.shape[1], config.vocab_size // 2)
    np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=0)
