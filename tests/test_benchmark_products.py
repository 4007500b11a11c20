"""scripts/benchmark_products.py counts a program's products as the program runs them."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "scripts"))
from benchmark_products import Product, count_products, decode_trips  # noqa: E402


def _product(lhs, rhs, contract, batch=((), ())) -> Product:
    """An f32 product as jnp.matmul writes it (its result type stated)."""
    return Product(lhs, "float32", rhs, "float32", (contract, batch), "float32")


def test_product_flops_are_twice_output_times_contracted_size():
    # [2, 3, 4] . [2, 4, 5] over 4, batched over 2: a [2, 3, 5] output, 4 terms each
    batched = _product((2, 3, 4), (2, 4, 5), ((2,), (1,)), ((0,), (0,)))
    assert batched.flops == 2 * (2 * 3 * 5) * 4
    # x^T y: [7, 3] . [7, 5] over the rows
    assert _product((7, 3), (7, 5), ((0,), (0,))).flops == 2 * (3 * 5) * 7


def test_scan_bodies_count_per_iteration_and_while_bodies_per_trip():
    def program(x, stacked, y, u):  # x [4, 5], stacked [3, 5, 5], y [2, 5], u [5, 5]
        x, _ = jax.lax.scan(lambda carry, w: (carry @ w, None), x, stacked)
        y, _ = jax.lax.while_loop(lambda c: c[1] < 7, lambda c: (c[0] @ u, c[1] + 1), (y, 0))
        return x.sum() + y.sum()

    args = (jnp.ones((4, 5)), jnp.ones((3, 5, 5)), jnp.ones((2, 5)), jnp.ones((5, 5)))
    jaxpr = jax.make_jaxpr(program)(*args).jaxpr
    counts = count_products(jaxpr, [7])
    assert counts == {
        _product((4, 5), (5, 5), ((1,), (0,))): 3,
        _product((2, 5), (5, 5), ((1,), (0,))): 7,
    }
    with pytest.raises(ValueError, match="without a trip count"):
        count_products(jaxpr, [])
    with pytest.raises(ValueError, match="fewer while loops"):
        count_products(jaxpr, [7, 1])


def test_a_scanned_backward_pass_counts_twice_the_forward_flops():
    def loss(x, stacked):  # x [4, 5], stacked [3, 5, 5]
        x, _ = jax.lax.scan(lambda carry, w: (jnp.tanh(carry @ w), None), x, stacked)
        return x.sum()

    args = (jnp.ones((4, 5)), jnp.ones((3, 5, 5)))
    forward = count_products(jax.make_jaxpr(loss)(*args).jaxpr, [])
    both = count_products(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(*args).jaxpr, [])
    forward_flops = sum(n * p.flops for p, n in forward.items())
    assert forward_flops == 3 * 2 * 4 * 5 * 5
    assert sum(n * p.flops for p, n in both.items()) == 3 * forward_flops


def test_a_cond_with_products_is_refused():
    def program(x, w):
        return jax.lax.cond(x.sum() > 0, lambda: x @ w, lambda: x)

    jaxpr = jax.make_jaxpr(program)(jnp.ones((2, 2)), jnp.ones((2, 2))).jaxpr
    with pytest.raises(ValueError, match="cond with products"):
        count_products(jaxpr, [])


def test_decode_trips_cover_every_step_after_the_prefill_token():
    assert decode_trips(64, 4) == [16, 16, 16, 15]  # jgrpo.rollout.attention_phases(64)
    assert decode_trips(64, 1) == [63]
    assert decode_trips(8, 1) == [7]
    with pytest.raises(ValueError, match="2 while loops, attention_phases 4"):
        decode_trips(64, 2)
