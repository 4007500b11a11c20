"""grpo_loss, token_kl and sequence_kl against hand-computed values."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jgrpo

# Two sequences of three positions. Log-ratios (logprobs - old): row 0 [0.5, 0.0, pad],
# row 1 [-0.3, 0.1, 0.25]. With clip_eps 0.2: exp(0.5)=1.65 is above 1.2 (clipped for A>0),
# exp(-0.3)=0.74 is below 0.8 (clipped for A<0), exp(0.25)=1.28 is above 1.2 but A<0.
LOGPROBS = [[-1.0, -0.5, -2.0], [-0.6, -1.1, -0.7]]
OLD = [[-1.5, -0.5, -1.0], [-0.3, -1.2, -0.95]]
REF = [[-0.9, -0.8, -2.0], [-0.5, -1.2, -0.4]]
MASK = [[1, 1, 0], [1, 1, 1]]
ADVANTAGES = [1.0, -0.5]


def kl_value(logprob, ref, estimator):
    d = ref - logprob
    return {"k1": -d, "k2": d * d / 2, "k3": math.exp(d) - d - 1}[estimator]


def reference_loss(
    loss_type, ratio_level, kl_estimator, *, beta, clip_eps_high=0.2, kl_bias_correction=False
):
    """Element by element in plain Python floats."""
    clip_eps = 0.2
    per_token = [[0.0] * 3 for _ in range(2)]
    for i in range(2):
        n_tokens = sum(MASK[i])
        seq_log_ratio = sum((LOGPROBS[i][t] - OLD[i][t]) * MASK[i][t] for t in range(3)) / n_tokens
        for t in range(3):
            log_ratio = seq_log_ratio if ratio_level == "sequence" else LOGPROBS[i][t] - OLD[i][t]
            r = math.exp(log_ratio)
            a = ADVANTAGES[i]
            clipped = min(max(r, 1 - clip_eps), 1 + clip_eps_high)
            loss = -min(r * a, clipped * a)
            kl = kl_value(LOGPROBS[i][t], REF[i][t], kl_estimator)
            loss += beta * (r * kl if kl_bias_correction else kl)
            per_token[i][t] = loss * MASK[i][t]
    sums = [sum(row) for row in per_token]
    if loss_type == "grpo":
        return sum(s / sum(m) for s, m in zip(sums, MASK, strict=True)) / 2
    if loss_type in ("bnpo", "dapo"):
        return sum(sums) / 5
    return sum(sums) / (2 * 3)  # dr_grpo: B * T


def arrays():
    return (
        jnp.array(LOGPROBS),
        jnp.array(OLD),
        jnp.array(ADVANTAGES),
        jnp.array(MASK),
    )


@pytest.mark.parametrize(
    ("loss_type", "ratio_level", "kl_estimator"),
    list(
        itertools.product(
            ["grpo", "bnpo", "dapo", "dr_grpo"], ["token", "sequence"], ["k1", "k2", "k3"]
        )
    ),
)
def test_every_combination_against_hand_computation(loss_type, ratio_level, kl_estimator):
    logprobs, old, advantages, mask = arrays()
    settings = itertools.product([(0.04, None), (0.5, 0.28)], [False, True])
    for (beta, clip_eps_high), kl_bias_correction in settings:
        loss, metrics = jgrpo.grpo_loss(
            logprobs,
            old,
            advantages,
            mask,
            ref_logprobs=jnp.array(REF),
            loss_type=loss_type,
            ratio_level=ratio_level,
            kl_estimator=kl_estimator,
            beta=beta,
            clip_eps_high=clip_eps_high,
            kl_bias_correction=kl_bias_correction,
        )
        expected = reference_loss(
            loss_type,
            ratio_level,
            kl_estimator,
            beta=beta,
            clip_eps_high=clip_eps_high or 0.2,
            kl_bias_correction=kl_bias_correction,
        )
        np.testing.assert_allclose(loss, expected, rtol=1e-6)
        kl_tokens = [
            kl_value(LOGPROBS[i][t], REF[i][t], kl_estimator)
            for i in range(2)
            for t in range(3)
            if MASK[i][t]
        ]
        np.testing.assert_allclose(metrics["kl_mean"], sum(kl_tokens) / 5, rtol=1e-6)


def test_literal_values():
    """A few numbers worked out by hand, independent of the reference function."""
    logprobs, old, advantages, mask = arrays()
    # beta = 0, grpo, token ratios:
    # row 0: A=1, r=(e^0.5, 1) -> clipped (1.2, 1): token losses (-1.2, -1), mean -1.1
    # row 1: A=-0.5, r=(e^-0.3, e^0.1, e^0.25): min(rA, clip(r)A) = (-0.4, -0.5*e^0.1, -0.5*e^0.25)
    #        losses (0.4, 0.552585, 0.642013), mean 0.531533
    loss, metrics = jgrpo.grpo_loss(logprobs, old, advantages, mask, beta=0.0)
    np.testing.assert_allclose(loss, (-1.1 + 0.531533) / 2, rtol=1e-5)
    np.testing.assert_allclose(metrics["clip_frac_high"], 1 / 5)  # row 0 token 0
    np.testing.assert_allclose(metrics["clip_frac_low"], 1 / 5)  # row 1 token 0
    ratios = [math.exp(0.5), 1.0, math.exp(-0.3), math.exp(0.1), math.exp(0.25)]
    np.testing.assert_allclose(metrics["ratio_mean"], sum(ratios) / 5, rtol=1e-6)
    assert "kl_mean" not in metrics
    # dr_grpo divides the masked sum (-2.2 + 1.594598) by B * max_completion_length = 2 * 10.
    loss, _ = jgrpo.grpo_loss(
        logprobs, old, advantages, mask, beta=0.0, loss_type="dr_grpo", max_completion_length=10
    )
    np.testing.assert_allclose(loss, (-2.2 + 1.594598) / 20, rtol=1e-5)


def test_on_policy_gradient_is_the_policy_gradient():
    """With old = stop_gradient(logprobs), r = 1 and dL/dlogprob_t = -A_i / n_i for grpo."""
    logprobs, _, advantages, mask = arrays()

    def loss(lp):
        return jgrpo.grpo_loss(lp, jax.lax.stop_gradient(lp), advantages, mask, beta=0.0)[0]

    np.testing.assert_allclose(loss(logprobs), -(1.0 - 0.5) / 2, rtol=1e-6)
    grad = jax.grad(loss)(logprobs)
    expected = -np.array(ADVANTAGES)[:, None] * np.array(MASK) / np.array([[2], [3]]) / 2
    np.testing.assert_allclose(grad, expected, rtol=1e-6)


def test_kl_bias_correction_gives_the_reverse_kl_gradient_on_policy():
    """With k3, dL/dlogprob_t is beta (logprob_t - ref_t) / n with the ratio weight and
    beta (1 - exp(ref_t - logprob_t)) / n without; on-policy the loss values agree (r = 1)."""
    logprobs, _, _, mask = arrays()
    ref = jnp.array(REF)
    no_advantage = jnp.zeros(2)

    def loss(lp, corrected):
        return jgrpo.grpo_loss(
            lp,
            jax.lax.stop_gradient(lp),
            no_advantage,
            mask,
            ref_logprobs=ref,
            loss_type="bnpo",
            beta=0.5,
            kl_bias_correction=corrected,
        )[0]

    np.testing.assert_allclose(loss(logprobs, True), loss(logprobs, False), rtol=1e-6)
    lp, rf, m = np.array(LOGPROBS), np.array(REF), np.array(MASK)
    np.testing.assert_allclose(
        jax.grad(loss)(logprobs, True), 0.5 * (lp - rf) * m / 5, rtol=1e-5, atol=1e-7
    )
    np.testing.assert_allclose(
        jax.grad(loss)(logprobs, False), 0.5 * (1 - np.exp(rf - lp)) * m / 5, rtol=1e-5, atol=1e-7
    )


def policy_term(policy_loss, logprobs, old, advantages, **kwargs):
    """bnpo loss of the policy term alone (beta 0), and its gradient in the logprobs."""
    mask = jnp.ones_like(logprobs)

    def loss(lp):
        return jgrpo.grpo_loss(
            lp, old, advantages, mask, beta=0.0, loss_type="bnpo", policy_loss=policy_loss, **kwargs
        )[0]

    return loss(logprobs), jax.grad(loss)(logprobs)


def test_cispo_clips_the_ratio_as_a_weight_without_gradient():
    logprobs = jnp.array([[-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5]])
    ratios = np.array([2.0, 6.0, 1.0])  # the middle one above cispo_max_ratio = 5
    old = logprobs - jnp.log(jnp.asarray(ratios))
    advantages = jnp.array([1.0, -0.5])
    value, grad = policy_term("cispo", logprobs, old, advantages)
    # -min(r, 5) A logprob per token: row 0 2 + 10 + 0.5 = 12.5, row 1 -0.5 x that.
    np.testing.assert_allclose(value, (12.5 - 6.25) / 6, rtol=1e-6)
    # d/dlogprob = -min(r, 5) A / 6: the weight carries no gradient, no token is cut off.
    np.testing.assert_allclose(grad, np.array([[-2.0, -5.0, -1.0], [1.0, 2.5, 0.5]]) / 6, rtol=1e-5)


def test_sapo_gates_the_ratio_smoothly():
    logprobs = jnp.array([[-1.0, -2.0], [-1.0, -2.0]])
    ratios = np.array([1.5, 0.5])
    old = logprobs - jnp.log(jnp.asarray(ratios))
    advantages = np.array([1.0, -0.5])
    value, grad = policy_term(
        "sapo", logprobs, old, jnp.asarray(advantages), sapo_temperature_neg=2.0
    )
    tau = np.array([[1.0], [2.0]])  # A > 0: the positive temperature; else the negative one
    gate = 1 / (1 + np.exp(-tau * (ratios - 1)))  # [2, 2]
    a = advantages[:, None]
    np.testing.assert_allclose(value, (-gate * 4 / tau * a).sum() / 4, rtol=1e-6)
    # d/dlogprob of -sigmoid(tau (r - 1)) 4 / tau A = -4 A sigmoid (1 - sigmoid) r
    np.testing.assert_allclose(grad, -4 * a * gate * (1 - gate) * ratios / 4, rtol=1e-5)


@pytest.mark.parametrize("policy_loss", ["clip", "cispo", "sapo"])
def test_every_policy_loss_has_the_policy_gradient_on_policy(policy_loss):
    logprobs, _, advantages, mask = arrays()
    grad = jax.grad(
        lambda lp: jgrpo.grpo_loss(
            lp, jax.lax.stop_gradient(lp), advantages, mask, beta=0.0, policy_loss=policy_loss
        )[0]
    )(logprobs)
    expected = -np.array(ADVANTAGES)[:, None] * np.array(MASK) / np.array([[2], [3]]) / 2
    np.testing.assert_allclose(grad, expected, rtol=1e-6)


def test_dual_clip_stops_negative_advantage_tokens_above_c():
    """A < 0: the token loss is -A max(r, clip(r)) up to c, then -A c with no gradient;
    A > 0 keeps its clip at 1 + clip_eps_high."""
    ratios = jnp.array([[4.0, 2.0, 0.5], [4.0, 2.0, 0.5]])
    advantages = jnp.array([-1.0, 1.0])
    mask = jnp.ones((2, 3))

    def per_token(lp):  # each token alone in its row, so grpo's mean is the token's loss
        loss = lambda x: jgrpo.grpo_loss(
            x.reshape(6, 1),
            jnp.zeros((6, 1)),
            jnp.repeat(advantages, 3),
            mask.reshape(6, 1),
            beta=0.0,
            dual_clip=3.0,
        )
        return loss(lp)[0] * 6, jax.grad(lambda x: loss(x)[0] * 6)(lp).reshape(2, 3)

    total, grad = per_token(jnp.log(ratios))
    # row 0 (A=-1): 4 -> 3 (capped), 2 -> 2, 0.5 -> clip 0.8; row 1 (A=1): -1.2, -1.2, -0.5
    np.testing.assert_allclose(total, 3 + 2 + 0.8 - 1.2 - 1.2 - 0.5, rtol=1e-6)
    # d(-A r)/dlog r = -A r where unclipped: row 0 token 1 (r=2), row 1 token 2 (r=0.5)
    np.testing.assert_allclose(grad, [[0.0, 2.0, 0.0], [0.0, 0.0, -0.5]], atol=1e-6)
    _, metrics = jgrpo.grpo_loss(jnp.log(ratios), jnp.zeros((2, 3)), advantages, mask, beta=0.0)
    assert "clip_frac_dual" not in metrics
    _, metrics = jgrpo.grpo_loss(
        jnp.log(ratios), jnp.zeros((2, 3)), advantages, mask, beta=0.0, dual_clip=3.0
    )
    np.testing.assert_allclose(metrics["clip_frac_dual"], 1 / 6)


def test_dual_clip_is_trls_delta_and_verls_dual_clip():
    """The same loss as TRL's two-sided clipping (r capped at delta before the min) and as
    verl's dual-clip (the A < 0 loss bounded by -A c), written from their formulas."""
    rng = np.random.default_rng(3)
    log_ratio = rng.normal(scale=1.0, size=(6, 5))
    advantages = rng.normal(size=6)
    r, a, c, low, high = np.exp(log_ratio), advantages[:, None], 2.5, 0.2, 0.28
    clipped = np.clip(r, 1 - low, 1 + high)
    trl = -np.minimum(np.minimum(r, c) * a, clipped * a)
    ppo = -np.minimum(r * a, clipped * a)
    verl = np.where(a < 0, np.minimum(ppo, -a * c), ppo)
    np.testing.assert_allclose(trl, verl, rtol=1e-12)
    loss, _ = jgrpo.grpo_loss(
        jnp.asarray(log_ratio, jnp.float32),
        jnp.zeros((6, 5)),
        jnp.asarray(advantages, jnp.float32),
        jnp.ones((6, 5)),
        beta=0.0,
        loss_type="bnpo",
        clip_eps=low,
        clip_eps_high=high,
        dual_clip=c,
    )
    np.testing.assert_allclose(loss, trl.mean(), rtol=1e-5)
    assert np.any((r > c) & (a < 0)) and not np.isclose(trl.mean(), ppo.mean())


def test_high_entropy_mask_keeps_the_top_quantile_of_completion_tokens():
    entropy = jnp.array([[0.1, 0.5, 0.9, 5.0], [0.3, 0.7, 0.2, 0.8]])
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 1, 1]])  # the 5.0 is padding: never kept or counted
    # The median of the 7 real values (0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9) is 0.5.
    np.testing.assert_array_equal(
        jgrpo.high_entropy_mask(entropy, mask, quantile=0.5), [[0, 1, 1, 0], [0, 1, 0, 1]]
    )
    # quantile 0.2: the 0.8 quantile, at position 0.8 x 6 = 4.8 of the sorted values,
    # 0.7 + 0.8 x (0.8 - 0.7) = 0.78: 0.8 and 0.9 are kept.
    np.testing.assert_array_equal(
        jgrpo.high_entropy_mask(entropy, mask, quantile=0.2), [[0, 0, 1, 0], [0, 0, 0, 1]]
    )
    np.testing.assert_array_equal(jgrpo.high_entropy_mask(entropy, mask, quantile=1.0), mask)
    empty = jgrpo.high_entropy_mask(entropy, jnp.zeros_like(mask), quantile=0.5)
    np.testing.assert_array_equal(empty, 0.0)
    with pytest.raises(ValueError, match=r"quantile must be in \(0, 1\]"):
        jgrpo.high_entropy_mask(entropy, mask, quantile=0.0)


def test_off_policy_mask_drops_negative_rows_the_policy_drifted_from():
    logprobs = jnp.array([[-1.0, -1.0, -1.0], [-1.0, -2.0, -1.0], [-1.0, -1.0, -1.0]])
    sampled = jnp.array([[0.0, 0.0, 0.0], [-0.5, -1.2, 9.0], [-0.8, -0.8, -1.2]])
    mask = jnp.array([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    # Mean log(pi_sampler / pi): row 0 1.0 (A > 0: kept), row 1 (0.5 + 0.8) / 2 = 0.65 over
    # its two tokens (A < 0: dropped at 0.5, kept at 0.7), row 2 (0.2 + 0.2 - 0.2) / 3.
    advantages = jnp.array([1.0, -0.5, -1.0])
    got = jgrpo.off_policy_mask(advantages, logprobs, sampled, mask, threshold=0.5)
    np.testing.assert_array_equal(got, [[1, 1, 1], [0, 0, 0], [1, 1, 1]])
    got = jgrpo.off_policy_mask(advantages, logprobs, sampled, mask, threshold=0.7)
    np.testing.assert_array_equal(got, np.ones((3, 3)))
    with pytest.raises(ValueError, match="threshold must be >= 0"):
        jgrpo.off_policy_mask(advantages, logprobs, sampled, mask, threshold=-1.0)


def test_policy_mask_drops_only_the_policy_term():
    """Masked tokens keep their KL term and their place in the normaliser (as TRL)."""
    logprobs, old, advantages, mask = arrays()
    ref = jnp.array(REF)
    loss = lambda **kw: jgrpo.grpo_loss(
        logprobs, old, kw.pop("a", advantages), mask, ref_logprobs=ref, beta=0.5, **kw
    )[0]
    np.testing.assert_allclose(loss(policy_mask=jnp.ones((2, 3))), loss(), rtol=1e-6)
    kl_only = loss(a=jnp.zeros(2))
    np.testing.assert_allclose(loss(policy_mask=jnp.zeros((2, 3))), kl_only, rtol=1e-6)
    # Row 0's first token alone keeps its policy term: grpo's row mean adds -1.2 / 2 (its
    # clipped r A, as in test_literal_values), and the mean over the 2 rows halves that.
    first = jnp.zeros((2, 3)).at[0, 0].set(1.0)
    np.testing.assert_allclose(loss(policy_mask=first), kl_only - 1.2 / 2 / 2, rtol=1e-5)


@pytest.mark.parametrize("clip_eps_high", [None, 0.28])
def test_clipped_tokens_get_zero_gradient(clip_eps_high):
    high = 0.2 if clip_eps_high is None else clip_eps_high
    log_ratios = jnp.log(jnp.array([[1.5, 1.0 + high + 0.01, 1.1, 0.5], [0.5, 0.79, 0.9, 1.5]]))
    old = jnp.zeros((2, 4))
    advantages = jnp.array([1.0, -1.0])
    mask = jnp.ones((2, 4))

    grad = jax.grad(
        lambda lp: jgrpo.grpo_loss(
            lp, old, advantages, mask, beta=0.0, clip_eps_high=clip_eps_high
        )[0]
    )(log_ratios)
    # A > 0: ratios above 1 + clip_eps_high get no gradient; below 1 - clip_eps still do.
    np.testing.assert_array_equal(np.asarray(grad)[0] == 0, [True, True, False, False])
    # A < 0: ratios below 1 - clip_eps get no gradient; above 1 + clip_eps still do.
    np.testing.assert_array_equal(np.asarray(grad)[1] == 0, [True, True, False, False])


@pytest.mark.parametrize(
    ("loss_type", "normaliser", "lengths"),
    [
        ("dapo", "total_tokens", [6, 2, 4, 1]),  # the whole batch's completion tokens: 13
        ("grpo", "total_sequences", [6, 0, 4, 1]),  # its non-empty rows: 3 (row 1 is empty)
    ],
)
def test_microbatch_gradients_sum_to_full_batch(loss_type, normaliser, lengths):
    """With the whole batch's normaliser, dapo's and grpo's micro-batch losses and gradients
    add up to the full batch's, however the empty rows fall."""
    rng = np.random.default_rng(0)
    logprobs = jnp.asarray(rng.normal(size=(4, 6)) - 1.0, jnp.float32)
    old = logprobs + jnp.asarray(rng.normal(scale=0.3, size=(4, 6)), jnp.float32)
    ref = logprobs + jnp.asarray(rng.normal(scale=0.3, size=(4, 6)), jnp.float32)
    advantages = jnp.asarray(rng.normal(size=4), jnp.float32)
    mask = jnp.asarray(np.arange(6)[None, :] < np.array(lengths)[:, None], jnp.float32)
    whole = mask.sum() if loss_type == "dapo" else (mask.sum(-1) > 0).sum()

    def loss(lp, rows, total=whole):
        return jgrpo.grpo_loss(
            lp,
            old[rows],
            advantages[rows],
            mask[rows],
            ref_logprobs=ref[rows],
            loss_type=loss_type,
            **{normaliser: total},
        )[0]

    full_loss, full_grad = jax.value_and_grad(loss)(logprobs, slice(0, 4))
    first_loss, first_grad = jax.value_and_grad(loss)(logprobs[:2], slice(0, 2))
    second_loss, second_grad = jax.value_and_grad(loss)(logprobs[2:], slice(2, 4))
    np.testing.assert_allclose(first_loss + second_loss, full_loss, rtol=1e-6)
    np.testing.assert_allclose(
        np.concatenate([first_grad, second_grad]), full_grad, rtol=1e-6, atol=1e-9
    )
    # The default is this batch's own count: the whole batch's for the full batch.
    np.testing.assert_array_equal(loss(logprobs, slice(0, 4), None), full_loss)
    # Without it each micro-batch normalises by its own count: not the same.
    assert not np.isclose(loss(logprobs[:2], slice(0, 2), None), first_loss)


def test_grpo_ignores_rows_without_completion_tokens():
    logprobs, old, advantages, mask = arrays()
    base, _ = jgrpo.grpo_loss(logprobs, old, advantages, mask, beta=0.0)
    padded, _ = jgrpo.grpo_loss(
        jnp.concatenate([logprobs, jnp.full((1, 3), -3.0)]),
        jnp.concatenate([old, jnp.zeros((1, 3))]),
        jnp.concatenate([advantages, jnp.array([5.0])]),
        jnp.concatenate([mask, jnp.zeros((1, 3), int)]),
        beta=0.0,
    )
    np.testing.assert_allclose(padded, base, rtol=1e-6)


@pytest.mark.parametrize("kl_estimator", ["k1", "k2", "k3"])
def test_sequence_kl(kl_estimator):
    logprobs, _, _, mask = arrays()
    got = jgrpo.sequence_kl(logprobs, jnp.array(REF), mask, kl_estimator=kl_estimator)
    expected = [
        sum(kl_value(LOGPROBS[i][t], REF[i][t], kl_estimator) * MASK[i][t] for t in range(3))
        for i in range(2)
    ]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def test_k3_is_nonnegative_and_zero_at_reference():
    lp = jnp.linspace(-5.0, 0.0, 11)
    np.testing.assert_array_equal(jgrpo.token_kl(lp, lp), 0.0)
    assert np.all(np.asarray(jgrpo.token_kl(lp, lp[::-1])) >= 0)


def test_jit_and_vmap_agree_with_eager():
    logprobs, old, advantages, mask = arrays()
    ref = jnp.array(REF)
    fn = lambda lp, o, a, m, r: jgrpo.grpo_loss(lp, o, a, m, ref_logprobs=r, loss_type="bnpo")
    eager_loss, eager_metrics = fn(logprobs, old, advantages, mask, ref)
    jit_loss, jit_metrics = jax.jit(fn)(logprobs, old, advantages, mask, ref)
    np.testing.assert_allclose(jit_loss, eager_loss, rtol=1e-6)
    for key in eager_metrics:
        np.testing.assert_allclose(jit_metrics[key], eager_metrics[key], rtol=1e-6)
    stacked = [jnp.stack([x, x * 0.5]) for x in (logprobs, old, advantages, mask, ref)]
    vmapped, _ = jax.vmap(fn)(*stacked)
    for k in range(2):
        single, _ = fn(*(x[k] for x in stacked))
        np.testing.assert_allclose(vmapped[k], single, rtol=1e-6)


def test_total_tokens_may_be_a_traced_array():
    logprobs, old, advantages, mask = arrays()
    loss = jax.jit(
        lambda n: jgrpo.grpo_loss(
            logprobs, old, advantages, mask, beta=0.0, loss_type="dapo", total_tokens=n
        )[0]
    )
    np.testing.assert_allclose(loss(10) * 2, loss(5), rtol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(loss_type="ppo"), "loss_type must be one of 'grpo', 'bnpo', 'dapo', 'dr_grpo'"),
        (dict(kl_estimator="k4"), "kl_estimator must be one of 'k1', 'k2', 'k3'"),
        (dict(ratio_level="group"), "ratio_level must be one of 'token', 'sequence'"),
        (dict(ref_logprobs=None), r"beta=0.04 > 0 needs ref_logprobs"),
        (dict(beta=-0.1), "beta must be >= 0"),
        (dict(clip_eps=0.0), r"clip_eps must be in \(0, 1\)"),
        (dict(clip_eps_high=-0.1), "clip_eps_high must be > 0"),
        (dict(dual_clip=1.2), r"dual_clip must be > 1 \+ clip_eps_high = 1.2"),
        (dict(policy_mask=jnp.ones((2, 4))), "policy_mask must have the same shape as logprobs"),
        (dict(policy_loss="ppo"), "policy_loss must be one of 'clip', 'cispo', 'sapo'"),
        (dict(policy_loss="sapo", dual_clip=3.0), "dual_clip bounds the clipped term"),
        (dict(cispo_max_ratio=0.5), "cispo_max_ratio must be >= 1"),
        (dict(sapo_temperature_neg=0.0), "sapo_temperature_pos and sapo_temperature_neg"),
        (
            dict(old_logprobs=jnp.zeros((2, 4))),
            r"old_logprobs must have the same shape as logprobs",
        ),
        (dict(mask=jnp.ones((3, 3))), "mask must have the same shape as logprobs"),
        (dict(advantages=jnp.zeros((2, 1))), r"advantages must have shape \(2,\)"),
        (dict(ref_logprobs=jnp.zeros((2,))), "ref_logprobs must have the same shape as logprobs"),
        (dict(logprobs=jnp.zeros((2, 3, 1))), "logprobs must have 2 dimensions"),
        (dict(max_completion_length=0), "max_completion_length must be >= 1"),
        (
            dict(sampler_weights=jnp.ones((2, 4))),
            "sampler_weights must have the same shape as logprobs",
        ),
    ],
)
def test_bad_input_names_the_argument(kwargs, message):
    logprobs, old, advantages, mask = arrays()
    args = dict(logprobs=logprobs, old_logprobs=old, advantages=advantages, mask=mask)
    args["ref_logprobs"] = jnp.array(REF)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        jgrpo.grpo_loss(
            args.pop("logprobs"),
            args.pop("old_logprobs"),
            args.pop("advantages"),
            args.pop("mask"),
            **args,
        )


def test_bad_sampler_weights_input_names_the_argument():
    old, sampler, mask = jnp.array(OLD), jnp.array(SAMPLER), jnp.array(MASK)
    with pytest.raises(ValueError, match="level must be one of 'token', 'sequence'"):
        jgrpo.sampler_weights(old, sampler, mask, level="group")
    with pytest.raises(ValueError, match="cap must be >= 1"):
        jgrpo.sampler_weights(old, sampler, mask, cap=0.5)
    with pytest.raises(ValueError, match="mode must be one of 'truncate', 'mask'"):
        jgrpo.sampler_weights(old, sampler, mask, mode="clip")
    with pytest.raises(ValueError, match=r"floor must be in \[0, 1\]"):
        jgrpo.sampler_weights(old, sampler, mask, floor=1.5)
    with pytest.raises(ValueError, match="sampler_logprobs must have the same shape"):
        jgrpo.sampler_weights(old, sampler[:, :2], mask)


def test_aggregation_example_in_docs():
    """docs/objective.md: row 0 has loss 1 on 2 tokens, row 1 has 0.5 on 4, row 2 is padding."""
    mask = jnp.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    advantages = jnp.array([-1.0, -0.5, 0.0])  # on-policy ratio 1: per-token loss is -A
    zeros = jnp.zeros((3, 4))
    expected = {"grpo": 0.75, "bnpo": 4 / 6, "dapo": 4 / 12, "dr_grpo": 4 / 12}
    for loss_type, value in expected.items():
        loss, _ = jgrpo.grpo_loss(
            zeros, zeros, advantages, mask, beta=0.0, loss_type=loss_type, total_tokens=12
        )
        np.testing.assert_allclose(loss, value, rtol=1e-6)


# The sampler's log-probs of the tokens above: log(pi / pi_sampler) = OLD - SAMPLER is
# row 0 [log 1.5, log 3, (pad)], row 1 [0, -log 2, log 1.25].
SAMPLER = [
    [-1.5 - math.log(1.5), -0.5 - math.log(3.0), 7.0],
    [-0.3, -1.2 + math.log(2.0), -0.95 - math.log(1.25)],
]


@pytest.mark.parametrize(
    ("level", "cap", "mode", "floor", "expected"),
    [
        ("token", 2.0, "truncate", 0.0, [[1.5, 2.0, 0.0], [1.0, 0.5, 1.25]]),
        ("token", 4.0, "truncate", 0.0, [[1.5, 3.0, 0.0], [1.0, 0.5, 1.25]]),
        ("token", 2.0, "truncate", 0.8, [[1.5, 2.0, 0.0], [1.0, 0.8, 1.25]]),
        ("token", 2.0, "mask", 0.0, [[1.5, 0.0, 0.0], [1.0, 0.5, 1.25]]),
        ("token", 2.0, "mask", 0.8, [[1.5, 0.0, 0.0], [1.0, 0.0, 1.25]]),
        # sequences: 1.5 * 3 = 4.5 and 1 * 0.5 * 1.25 = 0.625, on each of their tokens
        ("sequence", 2.0, "truncate", 0.0, [[2.0, 2.0, 0.0], [0.625, 0.625, 0.625]]),
        ("sequence", 5.0, "truncate", 0.0, [[4.5, 4.5, 0.0], [0.625, 0.625, 0.625]]),
        ("sequence", 5.0, "truncate", 0.7, [[4.5, 4.5, 0.0], [0.7, 0.7, 0.7]]),
        ("sequence", 2.0, "mask", 0.0, [[0.0, 0.0, 0.0], [0.625, 0.625, 0.625]]),
        ("sequence", 5.0, "mask", 0.7, [[4.5, 4.5, 0.0], [0.0, 0.0, 0.0]]),
    ],
)
def test_sampler_weights_by_hand(level, cap, mode, floor, expected):
    weights = jgrpo.sampler_weights(
        jnp.array(OLD),
        jnp.array(SAMPLER),
        jnp.array(MASK),
        level=level,
        cap=cap,
        mode=mode,
        floor=floor,
    )
    np.testing.assert_allclose(weights, expected, rtol=1e-6)
    assert weights.dtype == jnp.float32


def test_sampler_weights_carry_no_gradient_and_never_overflow():
    def total(old):
        return jgrpo.sampler_weights(old, jnp.array(SAMPLER), jnp.array(MASK)).sum()

    np.testing.assert_array_equal(jax.grad(total)(jnp.array(OLD)), np.zeros((2, 3)))
    far = jnp.array([[500.0, 0.0, 0.0]])  # exp(500) overflows f32
    weights = jgrpo.sampler_weights(far, jnp.zeros((1, 3)), jnp.ones((1, 3)), level="sequence")
    np.testing.assert_array_equal(weights, [[2.0, 2.0, 2.0]])
    masked = jgrpo.sampler_weights(
        far, jnp.zeros((1, 3)), jnp.ones((1, 3)), level="sequence", mode="mask"
    )
    np.testing.assert_array_equal(masked, [[0.0, 0.0, 0.0]])  # inf is above the cap


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_sampler_weights_multiply_each_tokens_loss(loss_type):
    """The loss with weights w is the loss whose per-token terms are scaled by w: checked
    through the gradient, token by token, at the on-policy point."""
    logprobs, _, advantages, mask = arrays()
    weights = jgrpo.sampler_weights(jnp.array(OLD), jnp.array(SAMPLER), mask)

    def loss(lp, w=None):
        return jgrpo.grpo_loss(
            lp,
            jax.lax.stop_gradient(lp),
            advantages,
            mask,
            ref_logprobs=jnp.array(REF),
            beta=0.04,
            loss_type=loss_type,
            sampler_weights=w,
        )[0]

    plain = jax.grad(loss)(logprobs)
    weighted = jax.grad(loss)(logprobs, weights)
    np.testing.assert_allclose(weighted, plain * np.asarray(weights), rtol=1e-6, atol=1e-8)
    ones = jnp.where(mask.astype(bool), 1.0, 0.0)
    np.testing.assert_allclose(loss(logprobs, ones), loss(logprobs), rtol=1e-6)


# Every policy term, dual clip, KL estimator, bias correction, ratio level and sampler weighting
# (None, or (level, mode)) that an extreme log-ratio could reach through an exponential.
EXTREME_SETTINGS = [
    dict(
        **policy,
        ratio_level=ratio_level,
        kl_estimator=kl_estimator,
        kl_bias_correction=kl_bias_correction,
        sampler=[None, ("token", "truncate"), ("sequence", "truncate"), ("token", "mask")][k % 4],
    )
    for k, (policy, ratio_level, kl_estimator, kl_bias_correction) in enumerate(
        itertools.product(
            [
                dict(policy_loss="clip"),
                dict(policy_loss="clip", dual_clip=3.0),
                dict(policy_loss="cispo"),
                dict(policy_loss="sapo"),
            ],
            ["token", "sequence"],
            ["k1", "k2", "k3"],
            [False, True],
        )
    )
]


def far_inputs(position, log_ratio, ref_gap):
    """The test arrays with, at `position`, logprobs - old = log_ratio, old - sampler =
    log_ratio and ref - logprobs = ref_gap; (logprobs, old, ref, sampler)."""
    logprobs, old, ref, sampler = (np.array(x, np.float32) for x in (LOGPROBS, OLD, REF, SAMPLER))
    old[position] = logprobs[position] - log_ratio
    sampler[position] = old[position] - log_ratio
    ref[position] = logprobs[position] + ref_gap
    return tuple(jnp.asarray(x) for x in (logprobs, old, ref, sampler))


def loss_and_gradient(inputs, settings):
    """grpo_loss and its gradient in logprobs, beta 0.04, sampler weights from `inputs`."""
    logprobs, old, ref, sampler = inputs
    settings = dict(settings)
    weights = None
    if settings.get("sampler") is not None:
        level, mode = settings["sampler"]
        weights = jgrpo.sampler_weights(old, sampler, jnp.array(MASK), level=level, mode=mode)
    settings.pop("sampler")

    def loss(lp):
        return jgrpo.grpo_loss(
            lp,
            old,
            jnp.array(ADVANTAGES),
            jnp.array(MASK),
            ref_logprobs=ref,
            beta=0.04,
            sampler_weights=weights,
            **settings,
        )

    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(logprobs)
    return value, grad, metrics


@pytest.mark.parametrize("settings", EXTREME_SETTINGS)
def test_extreme_log_ratios_off_the_mask_change_nothing(settings):
    """A masked position whose log-ratio (89) or reference gap (94) overflows exp, whose gap
    (1e20) overflows k2, or whose old, sampler and reference log-probs are -inf (a token a
    sampling filter excluded), leaves the loss, its gradient and the metrics exactly as they
    were (no inf * 0 = NaN)."""
    base_value, base_grad, base_metrics = loss_and_gradient(far_inputs((0, 2), 0.0, 0.0), settings)
    for log_ratio, ref_gap in [(89.0, 94.0), (1e20, 1e20), (np.inf, -np.inf)]:
        value, grad, metrics = loss_and_gradient(far_inputs((0, 2), log_ratio, ref_gap), settings)
        assert np.isfinite(value) and np.all(np.isfinite(grad))
        np.testing.assert_array_equal(value, base_value)
        np.testing.assert_array_equal(grad, base_grad)
        for name, metric in metrics.items():
            np.testing.assert_array_equal(metric, base_metrics[name], err_msg=name)


@pytest.mark.parametrize("settings", EXTREME_SETTINGS)
def test_a_log_ratio_beyond_20_counts_as_20(settings):
    """A completion token whose log-ratio (89) or k3 reference gap (94) overflows exp gets a
    finite loss and gradient: both count as 20, as verl clamps them."""
    value, grad, _ = loss_and_gradient(far_inputs((1, 1), 89.0, 94.0), settings)
    assert np.isfinite(value) and np.all(np.isfinite(grad))
    if settings["ratio_level"] == "token" and settings["kl_estimator"] == "k3":
        at_20, _, _ = loss_and_gradient(far_inputs((1, 1), 20.0, 20.0), settings)
        np.testing.assert_array_equal(value, at_20)


def test_k3_is_unchanged_up_to_a_gap_of_20_and_constant_beyond():
    """k3 = exp(d) - d - 1 bit for bit up to d = 20, then the value at 20 with no gradient."""
    logprobs = jnp.full(8, -3.0)
    gap = jnp.array([-300.0, -30.0, -1.0, 0.0, 5.0, 19.99, 20.0, 94.0])  # d = ref - logprobs
    ref = logprobs + gap

    def total_kl(lp):
        return jgrpo.token_kl(lp, ref).sum()

    per_token = jgrpo.token_kl(logprobs, ref)
    d = ref - logprobs
    np.testing.assert_array_equal(per_token[:7], (jnp.exp(d) - d - 1.0)[:7])
    np.testing.assert_array_equal(per_token[7], per_token[6])  # e^20 - 21
    grad = jax.grad(total_kl)(logprobs)
    assert np.all(np.isfinite(grad)) and grad[7] == 0.0 and grad[6] != 0.0
    sequence = jgrpo.sequence_kl(logprobs[None], ref[None], jnp.ones((1, 8)))
    assert np.isfinite(sequence[0])
