"""token_logprobs against torch, and the vocab-chunked twin against token_logprobs."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jgrpo
from jgrpo.logprobs import _vocab_layout


def random_logits(shape, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype) * 3.0


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_token_logprobs_match_torch(temperature):
    logits = random_logits((3, 5, 50))
    targets = jax.random.randint(jax.random.key(1), (3, 5), 0, 50)
    logprobs, entropy = jgrpo.token_logprobs(logits, targets, temperature=temperature)

    scaled = torch.from_numpy(np.array(logits)) / temperature
    log_softmax = torch.log_softmax(scaled, dim=-1)
    expected = log_softmax.gather(-1, torch.from_numpy(np.array(targets)).long()[..., None])
    expected_entropy = torch.distributions.Categorical(logits=scaled).entropy()
    assert logprobs.dtype == entropy.dtype == jnp.float32
    np.testing.assert_allclose(logprobs, expected[..., 0].numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(entropy, expected_entropy.numpy(), rtol=1e-6, atol=1e-6)


def test_bf16_logits_are_scored_in_f32():
    logits = random_logits((2, 4, 33), dtype=jnp.bfloat16)
    targets = jnp.zeros((2, 4), jnp.int32)
    logprobs, entropy = jgrpo.token_logprobs(logits, targets)
    reference = jgrpo.token_logprobs(logits.astype(jnp.float32), targets)
    assert logprobs.dtype == entropy.dtype == jnp.float32
    np.testing.assert_array_equal(logprobs, reference[0])
    np.testing.assert_array_equal(entropy, reference[1])


def hidden_and_unembedding(batch, length, dim, vocab, seed=0, dtype=jnp.float32):
    """Realistic scales: unit hidden states, unembedding ~ 1/sqrt(dim)."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    hidden = jax.random.normal(k1, (batch, length, dim)).astype(dtype)
    unembedding = (jax.random.normal(k2, (dim, vocab)) * 2.0 / dim**0.5).astype(dtype)
    targets = jax.random.randint(k3, (batch, length), 0, vocab)
    return hidden, unembedding, targets


def weighted_objective(weights, fn):
    """A scalar of fn's (log-probs, entropies): each weighted by its own [2, ...] weights."""

    def scalar(*args):
        logprobs, entropy = fn(*args)
        return (weights[0] * logprobs).sum() + (weights[1] * entropy).sum()

    return scalar


# (vocab, chunk_size): a divisor exists; a prime vocabulary (padded); chunk larger than V.
@pytest.mark.parametrize(("vocab", "chunk_size"), [(96, 16), (97, 16), (40, 4096)])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_matches_values_and_gradients(vocab, chunk_size, temperature):
    hidden, unembedding, targets = hidden_and_unembedding(3, 7, 16, vocab)
    weights = jax.random.normal(jax.random.key(5), (2, 3, 7))

    def full(h, w):
        return jgrpo.token_logprobs(h @ w, targets, temperature=temperature)

    def chunked(h, w):
        return jgrpo.chunked_token_logprobs(
            h, w, targets, temperature=temperature, chunk_size=chunk_size
        )

    values = jax.jit(chunked)(hidden, unembedding), jax.jit(full)(hidden, unembedding)
    for got, expected in zip(*values, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    got_grads = jax.jit(jax.grad(weighted_objective(weights, chunked), argnums=(0, 1)))(
        hidden, unembedding
    )
    expected_grads = jax.jit(jax.grad(weighted_objective(weights, full), argnums=(0, 1)))(
        hidden, unembedding
    )
    for got, expected in zip(got_grads, expected_grads, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("keep_logits", [False, True])
@pytest.mark.parametrize(("vocab", "temperature"), [(96, 1.0), (97, 0.6)])  # 97: padded
def test_chunked_soft_capped_logits(vocab, temperature, keep_logits):
    """`softcap` c (Gemma 2): the log-probs, entropies and gradients of token_logprobs on
    c tanh(logits / c), the cap before the temperature, with and without kept chunks."""
    hidden, unembedding, targets = hidden_and_unembedding(3, 7, 16, vocab, seed=2)
    unembedding = unembedding * 4.0  # logits up to ~30: a cap of 5 bends them
    weights = jax.random.normal(jax.random.key(5), (2, 3, 7))
    cap = 5.0

    def full(h, w):
        capped = cap * jnp.tanh(h @ w / cap)
        return jgrpo.token_logprobs(capped, targets, temperature=temperature)

    def chunked(h, w):
        return jgrpo.chunked_token_logprobs(
            h,
            w,
            targets,
            temperature=temperature,
            chunk_size=16,
            keep_logits=keep_logits,
            softcap=cap,
        )

    assert np.abs(np.asarray(hidden @ unembedding)).max() > 2 * cap
    for got, expected in zip(chunked(hidden, unembedding), full(hidden, unembedding), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    got_grads = jax.jit(jax.grad(weighted_objective(weights, chunked), argnums=(0, 1)))(
        hidden, unembedding
    )
    expected_grads = jax.jit(jax.grad(weighted_objective(weights, full), argnums=(0, 1)))(
        hidden, unembedding
    )
    for got, expected in zip(got_grads, expected_grads, strict=True):
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="soft-capped head"):
        jgrpo.chunked_token_logprobs(
            hidden, unembedding, targets, temperature=jnp.float32(0.6), softcap=cap
        )


def test_chunked_takes_a_traced_temperature_as_token_logprobs_does():
    """A temperature that is an array (traced under jit, or differentiated) gives the values
    and gradients, its own included, of token_logprobs on the full logits."""
    hidden, unembedding, targets = hidden_and_unembedding(3, 7, 16, 97)
    weights = jax.random.normal(jax.random.key(5), (2, 3, 7))

    def full(h, w, temperature):
        return jgrpo.token_logprobs(h @ w, targets, temperature=temperature)

    def chunked(h, w, temperature):
        return jgrpo.chunked_token_logprobs(h, w, targets, temperature=temperature, chunk_size=16)

    temperature = jnp.float32(0.6)
    got = jax.jit(chunked)(hidden, unembedding, temperature)
    at_python_float = chunked(hidden, unembedding, 0.6)
    for got_one, expected, python_float in zip(
        got, full(hidden, unembedding, temperature), at_python_float, strict=True
    ):
        np.testing.assert_allclose(got_one, expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got_one, python_float, rtol=1e-5, atol=1e-5)
    grads = jax.jit(jax.grad(weighted_objective(weights, chunked), argnums=(0, 1, 2)))
    expected_grads = jax.jit(jax.grad(weighted_objective(weights, full), argnums=(0, 1, 2)))
    got_grads = grads(hidden, unembedding, temperature)
    for got_one, expected in zip(
        got_grads, expected_grads(hidden, unembedding, temperature), strict=True
    ):
        np.testing.assert_allclose(got_one, expected, rtol=1e-5, atol=1e-5)
    assert got_grads[2] != 0.0


def test_chunked_under_jit_and_vmap():
    hidden, unembedding, targets = hidden_and_unembedding(4, 5, 8, 64, seed=3)
    fn = lambda h, t: jgrpo.chunked_token_logprobs(h, unembedding, t, chunk_size=16)
    eager = fn(hidden, targets)
    jitted = jax.jit(fn)(hidden, targets)
    vmapped = jax.jit(jax.vmap(fn))(hidden[:, None], targets[:, None])  # vmapped [1, T] rows
    for a, b, c in zip(eager, jitted, vmapped, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(c[:, 0], a, rtol=1e-6, atol=1e-6)


def test_chunked_keeps_parameter_dtypes_for_bf16():
    hidden, unembedding, targets = hidden_and_unembedding(2, 3, 8, 32, dtype=jnp.bfloat16)
    logprobs, entropy = jax.jit(
        lambda h, w: jgrpo.chunked_token_logprobs(h, w, targets, chunk_size=8)
    )(hidden, unembedding)
    assert logprobs.dtype == entropy.dtype == jnp.float32
    grads = jax.jit(
        jax.grad(
            lambda h, w: jgrpo.chunked_token_logprobs(h, w, targets, chunk_size=8)[0].sum(),
            argnums=(0, 1),
        )
    )(hidden, unembedding)
    assert grads[0].dtype == grads[1].dtype == jnp.bfloat16
    # Same values as scoring the bf16 product accumulated in f32.
    logits = jnp.dot(hidden, unembedding, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(logprobs, jgrpo.token_logprobs(logits, targets)[0], atol=1e-5)


def test_chunked_with_a_bf16_table_for_f32_hidden_states():
    """Mixed precision (`jgrpo.models.precision.with_matmul_weights`): the hidden states are
    rounded to the table's bf16 and the logits summed in f32, forward and backward. Values
    equal scoring the rounded product; the gradients differ from the rounded problem's exact
    ones only by the bf16 rounding of the logits' cotangent (bound below)."""
    hidden, unembedding, targets = hidden_and_unembedding(2, 5, 16, 96, seed=4)
    table = unembedding.astype(jnp.bfloat16)  # [D, V]
    rounded_hidden = hidden.astype(jnp.bfloat16).astype(jnp.float32)
    rounded_table = table.astype(jnp.float32)

    def objective(fn):
        return lambda h, w: sum(x.sum() for x in fn(h, w))  # log-probs + entropies

    def chunked(h, w):
        return jgrpo.chunked_token_logprobs(h, w, targets, temperature=0.7, chunk_size=16)

    def exact(h, w):  # the rounded operands, all in f32
        return jgrpo.token_logprobs(h @ w, targets, temperature=0.7)

    got = jax.jit(chunked)(hidden, table)
    expected = jax.jit(exact)(rounded_hidden, rounded_table)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)
    grad_hidden, grad_table = jax.jit(jax.grad(objective(chunked), argnums=(0, 1)))(hidden, table)
    assert (grad_hidden.dtype, grad_table.dtype) == (jnp.float32, jnp.bfloat16)
    exact_hidden, exact_table = jax.grad(objective(exact), argnums=(0, 1))(
        rounded_hidden, rounded_table
    )
    # A cotangent rounded to bf16 is off by at most 2^-8 of itself; summed over a row of V
    # logits times the table (or the hidden states), that bounds each gradient's error.
    cotangent = jax.vmap(jax.grad(lambda z, t: sum(x.sum() for x in exact_row(z, t))))(
        (rounded_hidden @ rounded_table).reshape(-1, 96), targets.reshape(-1)
    )  # [N, V]
    bound_hidden = 2**-8 * np.abs(cotangent) @ np.abs(rounded_table).T  # [N, D]
    bound_table = 2**-8 * np.abs(rounded_hidden.reshape(-1, 16)).T @ np.abs(cotangent)
    assert np.all(
        np.abs(grad_hidden.reshape(-1, 16) - exact_hidden.reshape(-1, 16)) <= bound_hidden + 1e-5
    )
    table_error = np.abs(grad_table.astype(jnp.float32) - exact_table)
    assert np.all(table_error <= bound_table + 2**-8 * np.abs(exact_table) + 1e-5)
    assert np.abs(grad_hidden - exact_hidden).max() > 0  # the cotangent was rounded


def exact_row(logits, target):  # one row's (log-prob, entropy) at temperature 0.7
    return jgrpo.token_logprobs(logits[None], target[None], temperature=0.7)


def test_chunked_memory_is_under_a_quarter_of_full_logits():
    """B=4, T=512, V=65536: f32 logits would take 512 MiB."""
    batch, length, dim, vocab = 4, 512, 64, 65536
    hidden = jax.ShapeDtypeStruct((batch, length, dim), jnp.float32)
    unembedding = jax.ShapeDtypeStruct((dim, vocab), jnp.float32)
    targets = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    logits_bytes = batch * length * vocab * 4

    def forward(h, w, t):
        return jgrpo.chunked_token_logprobs(h, w, t)

    def loss(h, w, t):
        logprobs, entropy = jgrpo.chunked_token_logprobs(h, w, t)
        return logprobs.sum() + 0.01 * entropy.sum()

    for fn in (forward, jax.grad(loss, argnums=(0, 1))):
        compiled = jax.jit(fn).lower(hidden, unembedding, targets).compile()
        temp_bytes = compiled.memory_analysis().temp_size_in_bytes
        assert temp_bytes < logits_bytes / 4, (fn, temp_bytes / 2**20)

    # And the unchunked function really does materialise them (the comparison is meaningful).
    full = jax.jit(lambda h, w, t: jgrpo.token_logprobs(h @ w, t))
    temp_bytes = full.lower(hidden, unembedding, targets).compile().memory_analysis()
    assert temp_bytes.temp_size_in_bytes >= logits_bytes


@pytest.mark.parametrize(
    ("vocab", "table_dtype"), [(96, jnp.float32), (97, jnp.float32), (96, jnp.bfloat16)]
)
def test_kept_logits_give_equal_values_and_gradients(vocab, table_dtype):
    """keep_logits=True stores the forward's chunk logits instead of recomputing them: the
    same arithmetic, so results agree to float rounding (XLA may fuse the division by the
    temperature into the recomputed product differently); a padded vocabulary and a bf16
    table for f32 hidden states included."""
    hidden, unembedding, targets = hidden_and_unembedding(3, 7, 16, vocab, seed=6)
    unembedding = unembedding.astype(table_dtype)
    weights = jax.random.normal(jax.random.key(7), (2, 3, 7))

    def objective(keep):
        def scalar(h, w):
            logprobs, entropy = jgrpo.chunked_token_logprobs(
                h, w, targets, temperature=0.8, chunk_size=16, keep_logits=keep
            )
            return (weights[0] * logprobs).sum() + (weights[1] * entropy).sum()

        return jax.jit(jax.value_and_grad(scalar, argnums=(0, 1)))

    recomputed, kept = objective(False)(hidden, unembedding), objective(True)(hidden, unembedding)
    for got, expected in zip(jax.tree.leaves(kept), jax.tree.leaves(recomputed), strict=True):
        assert got.dtype == expected.dtype
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def count_products(jaxpr) -> int:
    """dot_general equations, inside loops and custom rules included (each counted once)."""
    count = sum(eqn.primitive.name == "dot_general" for eqn in jaxpr.eqns)
    return count + sum(count_products(sub) for sub in jax.extend.core.subjaxprs(jaxpr))


def test_kept_logits_skip_the_backward_product_and_hold_the_logits():
    """The backward pass without kept logits repeats each chunk's product; with them it does
    not, and the compiled program holds the B*T*V f32 logits instead."""
    batch, length, dim, vocab = 2, 256, 32, 8192
    hidden = jax.ShapeDtypeStruct((batch, length, dim), jnp.float32)
    unembedding = jax.ShapeDtypeStruct((dim, vocab), jnp.float32)
    targets = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    logits_bytes = batch * length * vocab * 4  # 16 MiB

    def gradient(keep):
        def loss(h, w, t):
            logprobs, entropy = jgrpo.chunked_token_logprobs(
                h, w, t, chunk_size=1024, keep_logits=keep
            )
            return logprobs.sum() + 0.01 * entropy.sum()

        return jax.grad(loss, argnums=(0, 1))

    products = {
        keep: count_products(jax.make_jaxpr(gradient(keep))(hidden, unembedding, targets).jaxpr)
        for keep in (False, True)
    }
    # forward: the target logits (1) and a chunk's logits (1); backward: the target logits'
    # two gradients (2) and a chunk's two (2), plus the chunk's logits again unless kept (1)
    assert products == {False: 7, True: 6}, products
    temp = {
        keep: jax.jit(gradient(keep))
        .lower(hidden, unembedding, targets)
        .compile()
        .memory_analysis()
        .temp_size_in_bytes
        for keep in (False, True)
    }
    assert temp[False] < logits_bytes / 2 < logits_bytes <= temp[True], temp


def test_vocab_layout():
    # Qwen2.5 / Qwen3 vocabulary: 151936 = 64 chunks of 2374, no padding.
    assert _vocab_layout(151936, 4096) == (151936, 64, 2374)
    assert _vocab_layout(128256, 4096) == (128256, 32, 4008)  # Llama 3
    assert _vocab_layout(97, 16) == (97, 7, 14)  # prime: padded to 98
    assert _vocab_layout(40, 4096) == (40, 1, 40)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: jgrpo.token_logprobs(
                jnp.zeros((2, 3, 5)), jnp.zeros((2, 3), int), temperature=0.0
            ),
            "temperature must be > 0",
        ),
        (
            lambda: jgrpo.token_logprobs(jnp.zeros((2, 3, 5)), jnp.zeros((2, 4), int)),
            r"targets must have shape \(2, 3\)",
        ),
        (
            lambda: jgrpo.token_logprobs(jnp.zeros((2, 3, 5)), jnp.zeros((2, 3))),
            "targets must hold integer token ids",
        ),
        (
            lambda: jgrpo.chunked_token_logprobs(
                jnp.zeros((2, 3, 4)), jnp.zeros((5, 4)), jnp.zeros((2, 3), int)
            ),
            r"unembedding is \[D, V\]",
        ),
        (
            lambda: jgrpo.chunked_token_logprobs(
                jnp.zeros((2, 3, 4)), jnp.zeros((4, 9)), jnp.zeros((2, 3), int), chunk_size=0
            ),
            "chunk_size must be a positive int",
        ),
    ],
)
def test_bad_input_names_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()
