"""The jitted GRPO update: mu passes, minibatches, accumulation, reference, no recompiles."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jgrpo
from jgrpo.models.config import preset
from jgrpo.models.precision import with_rounded_weights
from jgrpo.models.transformer import Transformer
from jgrpo.rollout import SamplingConfig, rollout
from jgrpo.update import (
    Batch,
    UpdateConfig,
    completion_logprobs,
    init_state,
    keeps_logits,
    make_optimizer,
    train_step,
)

CONFIG = preset("tiny")
PROMPTS, GENERATIONS, PROMPT_LENGTH, NEW_TOKENS = 2, 4, 6, 5


def rollout_batch(params, seed=0):
    """A real rollout of the tiny model, with advantages from a toy reward (even tokens)."""
    rng = np.random.default_rng(seed)
    prompt_ids = rng.integers(3, CONFIG.vocab_size, (PROMPTS, PROMPT_LENGTH))
    prompt_ids = jnp.asarray(prompt_ids, jnp.int32)
    prompt_mask = jnp.ones_like(prompt_ids).at[1, :2].set(0)  # second prompt left-padded
    out = rollout(
        params,
        prompt_ids,
        prompt_mask,
        jax.random.key(seed),
        model_config=CONFIG,
        num_generations=GENERATIONS,
        sampling=SamplingConfig(max_new_tokens=NEW_TOKENS, stop_token_ids=(7,)),
    )
    rewards = ((out.tokens % 2 == 0) & out.mask).sum(-1).astype(jnp.float32)
    advantages = jgrpo.group_advantages(rewards, out.group_ids, PROMPTS)
    prompt_rows = jnp.repeat(prompt_ids, GENERATIONS, axis=0)
    mask_rows = jnp.repeat(prompt_mask, GENERATIONS, axis=0)
    batch = Batch(
        input_ids=jnp.concatenate([prompt_rows, out.tokens], axis=1),
        attention_mask=jnp.concatenate([mask_rows, out.mask.astype(jnp.int32)], axis=1),
        completion_mask=out.mask,
        advantages=advantages,
    )
    return batch, out


@pytest.fixture(scope="module")
def params():
    return Transformer(CONFIG, rngs=nnx.Rngs(0)).params()


def logprobs_under(params, batch):
    logprobs, _ = completion_logprobs(
        params, batch, model_config=CONFIG, temperature=1.0, chunk_size=64
    )
    return np.asarray(logprobs)


def step(params, batch, ref=None, optimizer=None, **update):
    optimizer = optimizer or make_optimizer(1e-2, total_steps=10)
    state = init_state(jax.tree.map(jnp.copy, params), optimizer)
    return train_step(
        state,
        batch,
        ref,
        model_config=CONFIG,
        update_config=UpdateConfig(**update),
        optimizer=optimizer,
    )


def test_completion_logprobs_match_the_sampler(params):
    batch, out = rollout_batch(params)
    real = np.asarray(out.mask)
    np.testing.assert_allclose(
        logprobs_under(params, batch)[real], np.asarray(out.logprobs)[real], atol=1e-4
    )


def test_update_moves_logprobs_in_the_direction_of_the_advantage(params):
    batch, _ = rollout_batch(params)
    state, metrics = step(params, batch)
    mask = np.asarray(batch.completion_mask)
    change = ((logprobs_under(state.params, batch) - logprobs_under(params, batch)) * mask).sum(-1)
    advantages = np.asarray(batch.advantages)
    signal = advantages != 0
    assert signal.sum() >= 4
    assert np.corrcoef(change[signal], advantages[signal])[0, 1] > 0.5
    assert int(state.step) == 1 and metrics["loss"].shape == (1, 1)
    np.testing.assert_allclose(metrics["ratio_mean"], 1.0)  # on-policy: nothing moved yet


def test_second_pass_sees_ratios_away_from_one(params):
    batch, _ = rollout_batch(params)
    state, metrics = step(params, batch, num_iterations=2, num_minibatches=2)
    assert int(state.step) == 4 and metrics["ratio_mean"].shape == (2, 2)
    ratio = np.asarray(metrics["ratio_mean"])
    np.testing.assert_allclose(ratio[0, 0], 1.0, atol=1e-6)  # first minibatch: old == current
    assert np.all(np.abs(ratio[1] - 1.0) > 1e-4)  # the policy moved: clipping can act


def test_dapo_gradient_accumulation_is_exact(params):
    batch, _ = rollout_batch(params)
    sgd = optax.sgd(1.0)  # params move by exactly the gradient (Adam would amplify rounding)
    whole, whole_metrics = step(params, batch, optimizer=sgd, loss_type="dapo")
    accumulated, accumulated_metrics = step(
        params, batch, optimizer=sgd, loss_type="dapo", grad_accumulation=4
    )
    leaves = zip(jax.tree.leaves(whole.params), jax.tree.leaves(accumulated.params), strict=True)
    for a, b in leaves:
        np.testing.assert_allclose(a, b, atol=1e-7)
    # On-policy the loss value is ~0 (advantages are centred); compare it absolutely.
    np.testing.assert_allclose(accumulated_metrics["loss"], whole_metrics["loss"], atol=1e-6)
    np.testing.assert_allclose(
        accumulated_metrics["grad_norm"], whole_metrics["grad_norm"], rtol=1e-4
    )


def test_grpo_gradient_accumulation_is_exact_with_empty_rows(params):
    """Rows 1-3 empty (mask_truncated, padding rows): the first micro-batch holds one
    non-empty row, which still weighs 1/5 of the minibatch's loss, not 1/2."""
    batch, _ = rollout_batch(params)
    empty = (jnp.arange(8) >= 1) & (jnp.arange(8) <= 3)  # [B]
    batch = batch._replace(completion_mask=batch.completion_mask & ~empty[:, None])
    assert batch.advantages[0] != 0
    sgd = optax.sgd(1.0)  # params move by exactly the gradient (Adam would amplify rounding)
    whole, whole_metrics = step(params, batch, optimizer=sgd, loss_type="grpo")
    accumulated, accumulated_metrics = step(
        params, batch, optimizer=sgd, loss_type="grpo", grad_accumulation=2
    )
    moved = max(
        float(jnp.abs(a - b).max())
        for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(params), strict=True)
    )
    assert moved > 0.1
    leaves = zip(jax.tree.leaves(whole.params), jax.tree.leaves(accumulated.params), strict=True)
    for a, b in leaves:
        np.testing.assert_allclose(a, b, atol=1e-7)
    np.testing.assert_allclose(accumulated_metrics["loss"], whole_metrics["loss"], rtol=1e-6)
    np.testing.assert_allclose(
        accumulated_metrics["grad_norm"], whole_metrics["grad_norm"], rtol=1e-5
    )


@pytest.mark.parametrize(
    ("loss_type", "shared_prompt_rows"), [("dapo", 4), ("grpo", 1), ("dr_grpo", 4)]
)
def test_completion_columns_that_no_row_uses_change_nothing(params, loss_type, shared_prompt_rows):
    """What `algorithm.completion_buckets` relies on: the update of a batch trimmed to its
    used completion columns equals the wider batch's, dr_grpo's divisor held fixed."""
    batch, _ = rollout_batch(params)
    extra = ((0, 0), (0, 3))  # three more completion columns, all padding
    wide = Batch(
        input_ids=jnp.pad(batch.input_ids, extra),
        attention_mask=jnp.pad(batch.attention_mask, extra),
        completion_mask=jnp.pad(batch.completion_mask, extra),
        advantages=batch.advantages,
    )
    settings = dict(
        loss_type=loss_type,
        beta=0.04,
        shared_prompt_rows=shared_prompt_rows,
        max_completion_length=NEW_TOKENS + 3,
    )
    sgd = optax.sgd(1.0)  # params move by exactly the gradient (Adam would amplify rounding)
    narrow_state, narrow_metrics = step(params, batch, params, optimizer=sgd, **settings)
    wide_state, wide_metrics = step(params, wide, params, optimizer=sgd, **settings)
    assert wide_metrics["grad_norm"] > 0
    for name in ("loss", "grad_norm", "entropy", "kl_mean", "ratio_mean"):
        np.testing.assert_allclose(narrow_metrics[name], wide_metrics[name], rtol=1e-5, atol=1e-7)
    leaves = zip(
        jax.tree.leaves(narrow_state.params), jax.tree.leaves(wide_state.params), strict=True
    )
    for a, b in leaves:
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_kl_to_the_reference(params):
    batch, _ = rollout_batch(params)
    _, metrics = step(params, batch, params, beta=0.1, num_iterations=2)
    kl = np.asarray(metrics["kl_mean"])
    np.testing.assert_allclose(kl[0], 0.0, atol=1e-6)  # still the reference policy
    assert kl[1, 0] > 0  # after one step it has moved away
    with pytest.raises(ValueError, match=r"beta=0.1 > 0 needs ref_params"):
        step(params, batch, beta=0.1)


def update_matches_gradient(params, batch, weights, ref=None, **update):
    """Asserts the update's gradient is that of sum(weights x logprobs): the loss's per-token
    coefficients, derived by hand in `weights` [B, N]. Read through one SGD step of 1000 x
    the gradient, so the move stands above the parameters' f32 rounding; returns the metrics."""

    def surrogate(p):
        logprobs, _ = completion_logprobs(
            p, batch, model_config=CONFIG, temperature=1.0, chunk_size=64
        )
        return (weights * logprobs).sum()

    expected = jax.grad(surrogate)(params)
    state, metrics = step(params, batch, ref, optax.sgd(1e3), **update)
    moved = jax.tree.map(lambda old, new: (old - new) / 1e3, params, state.params)
    for got, want in zip(jax.tree.leaves(moved), jax.tree.leaves(expected), strict=True):
        scale = float(jnp.abs(want).max())
        assert scale > 0
        np.testing.assert_allclose(got, want, atol=1e-4 * scale)
    return metrics


def test_kl_bias_correction_reaches_the_update(params):
    """With zero advantages the update's gradient is the KL term's alone: beta / n times
    sum_t c_t grad logprob_t, c_t = logprob_t - ref_t with the ratio weight (the reverse-KL
    gradient) and 1 - exp(ref_t - logprob_t) without."""
    batch, _ = rollout_batch(params)
    batch = batch._replace(advantages=jnp.zeros_like(batch.advantages))
    ref = jax.tree.map(lambda leaf: leaf * 0.9, params)
    policy, reference = logprobs_under(params, batch), logprobs_under(ref, batch)
    mask = np.asarray(batch.completion_mask, np.float32)
    coefficients = {
        True: policy - reference,
        False: 1.0 - np.exp(reference - policy),
    }
    for corrected, coefficient in coefficients.items():
        weights = jnp.asarray(0.1 * coefficient * mask / mask.sum())  # [B, N]
        update_matches_gradient(params, batch, weights, ref, beta=0.1, kl_bias_correction=corrected)


def test_top_entropy_quantile_trains_on_the_high_entropy_tokens(params):
    """On-policy with beta 0 the update's gradient is -sum_t A_i k_t grad logprob_t / n, k_t
    1 on the tokens `high_entropy_mask` keeps (from the policy's own entropies), 0 else."""
    batch, _ = rollout_batch(params)
    _, entropy = completion_logprobs(
        params, batch, model_config=CONFIG, temperature=1.0, chunk_size=64
    )
    kept = jgrpo.high_entropy_mask(entropy, batch.completion_mask, quantile=0.5)
    mask = np.asarray(batch.completion_mask, np.float32)
    assert 0 < kept.sum() < mask.sum()
    weights = -batch.advantages[:, None] * kept / mask.sum()  # [B, N]
    update_matches_gradient(params, batch, weights, top_entropy_quantile=0.5)


def test_off_policy_mask_threshold_leaves_out_drifted_negative_rows(params):
    """A sampler whose log-probs sit 1 above the policy's on the negative-advantage rows:
    with threshold 0.5 those rows leave the policy term, and the gradient is the remaining
    rows' -sum_t A_i grad logprob_t / n (n still counts every completion token)."""
    batch, _ = rollout_batch(params)
    logprobs = jnp.asarray(logprobs_under(params, batch))
    negative = batch.advantages < 0  # [B]
    assert 0 < negative.sum() < len(negative)
    batch = batch._replace(sampler_logprobs=logprobs + 1.0 * negative[:, None])
    mask = np.asarray(batch.completion_mask, np.float32)
    weights = -batch.advantages[:, None] * ~negative[:, None] * mask / mask.sum()  # [B, N]
    metrics = update_matches_gradient(params, batch, weights, off_policy_mask_threshold=0.5)
    nonempty = np.asarray(batch.completion_mask).any(-1)
    np.testing.assert_allclose(
        metrics["off_policy_masked_frac"], (nonempty & np.asarray(negative)).sum() / nonempty.sum()
    )


def test_the_policy_loss_reaches_the_update(params):
    """On-policy (r = 1) the three policy terms have one gradient but their own values:
    clip -A, cispo -A logprob, sapo -sigmoid(0) 4 / tau A = -2 A / tau; dapo's token mean."""
    batch, _ = rollout_batch(params)
    logprobs = logprobs_under(params, batch)
    mask = np.asarray(batch.completion_mask, np.float32)
    a = np.asarray(batch.advantages)[:, None]
    tau = np.where(a > 0, 1.0, 2.0)
    expected = {
        "clip": -a * np.ones_like(logprobs),
        "cispo": -a * logprobs,
        "sapo": -2.0 / tau * a * np.ones_like(logprobs),
    }
    for policy_loss, per_token in expected.items():
        _, metrics = step(params, batch, policy_loss=policy_loss, sapo_temperature_neg=2.0)
        want = (per_token * mask).sum() / mask.sum()
        np.testing.assert_allclose(metrics["loss"], want, rtol=1e-5, atol=1e-6)


def test_a_bf16_reference_moves_only_the_kl_term(params):
    """ref_params with bf16 weight matrices and embeddings (`with_rounded_weights`, what
    model.reference_dtype=bfloat16 stores): the reference log-probs move by bf16 rounding, so
    the KL at the start is small but no longer 0, and the update moves by beta x that, far
    below the policy term's size. SGD steps, so the parameter change is the gradient."""
    batch, _ = rollout_batch(params)
    rounded = with_rounded_weights(params, jnp.bfloat16)
    moved = {}
    for name, ref in (("f32", params), ("bf16", rounded)):
        state, metrics = step(params, batch, ref, optax.sgd(1.0), beta=0.1)
        moved[name] = jax.tree.map(lambda new, old: new - old, state.params, params)
        kl = np.asarray(metrics["kl_mean"]).item()
        if name == "f32":
            assert kl == 0.0  # identical log-probs: k3 is exactly 0
        else:
            assert 0.0 < kl < 1e-5  # k3 ~ (rounding gap)^2 / 2; measured 1.5e-7
    gaps = jax.tree.map(  # the largest difference over the leaf's largest change
        lambda low, full: float(jnp.abs(low - full).max() / jnp.abs(full).max()),
        moved["bf16"],
        moved["f32"],
    )
    assert all(0 < gap < 1e-3 for gap in jax.tree.leaves(gaps)), gaps  # measured <= 1.0e-4


def test_bf16_matmuls_stay_close_to_f32(params):
    """matmul_dtype="bfloat16" (mixed precision): log-probs and every parameter's gradient
    within a few bf16 rounding steps (2^-8 relative each) of the f32 update's, and not
    equal to them (the products really ran in bf16). Gradients read through an SGD step."""
    batch, _ = rollout_batch(params)
    logprobs, steps = {}, {}
    for dtype in ("float32", "bfloat16"):
        logprobs[dtype] = np.asarray(
            completion_logprobs(
                params,
                batch,
                model_config=CONFIG,
                temperature=1.0,
                chunk_size=64,
                matmul_dtype=dtype,
            )[0]
        )[np.asarray(batch.completion_mask)]
        state, metrics = step(params, batch, params, optax.sgd(1.0), beta=0.1, matmul_dtype=dtype)
        steps[dtype] = jax.tree.map(lambda new, old: new - old, state.params, params)
        assert np.asarray(metrics["kl_mean"]).item() == pytest.approx(0.0, abs=1e-6)
    gap = np.abs(logprobs["bfloat16"] - logprobs["float32"])
    assert 1e-5 < gap.mean() < 2e-3 and gap.max() < 1e-2  # measured: 3.7e-4, 1.3e-3
    errors = jax.tree.map(
        lambda low, full: float(jnp.linalg.norm(low - full) / jnp.linalg.norm(full)),
        steps["bfloat16"],
        steps["float32"],
    )
    assert all(1e-4 < e < 0.02 for e in jax.tree.leaves(errors)), errors  # measured <= 0.0063


def test_no_recompile_after_the_first_step(params, count_compiles):
    optimizer = make_optimizer(1e-3, total_steps=10, warmup_steps=2, schedule="cosine")
    config = UpdateConfig(num_iterations=2, num_minibatches=2)
    state = init_state(jax.tree.map(jnp.copy, params), optimizer)
    lrs = []
    for seed in range(3):
        batch, _ = rollout_batch(params, seed)
        if seed == 1:
            compiles = count_compiles()
        state, metrics = train_step(
            state, batch, model_config=CONFIG, update_config=config, optimizer=optimizer
        )
        lrs.extend(np.asarray(metrics["lr"]).ravel().tolist())
    assert count_compiles() == compiles
    assert int(state.step) == 12
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(1e-3)  # linear warmup over 2 steps
    assert lrs[-1] < lrs[2]  # then cosine decay


@pytest.mark.parametrize("total_steps", [1, 4])
def test_cosine_without_warmup_starts_at_the_full_rate(total_steps):
    """lr_t = lr * (1 + cos(pi * t / total)) / 2 from the first step (even a one-step run)."""
    optimizer = make_optimizer(1e-3, total_steps=total_steps, schedule="cosine")
    params = {"w": jnp.zeros(2)}
    state, lrs = optimizer.init(params), []
    for _ in range(total_steps):
        _, state = optimizer.update({"w": jnp.ones(2)}, state, params)
        lrs.append(float(state[1].hyperparams["learning_rate"]))  # (clip, adamw) states
    expected = {1: [1e-3], 4: [1e-3, 0.853553e-3, 0.5e-3, 0.146447e-3]}[total_steps]
    np.testing.assert_allclose(lrs, expected, rtol=1e-5)


def with_sampler(batch, sampler_logprobs):
    return batch._replace(sampler_logprobs=jnp.asarray(sampler_logprobs, jnp.float32))


def test_sampler_gap_is_the_mean_distance_to_the_samplers_logprobs(params):
    batch, out = rollout_batch(params)
    _, metrics = step(params, with_sampler(batch, out.logprobs))
    assert float(metrics["sampler_gap"][0, 0]) < 1e-5  # the f32 sampler is the policy
    assert "sampler_weight_mean" not in metrics  # no correction asked for
    shift = np.where(np.arange(NEW_TOKENS) % 2, 0.3, -0.1)  # [N]: 0.3 on odd columns
    _, metrics = step(params, with_sampler(batch, out.logprobs + shift))
    mask = np.asarray(batch.completion_mask)
    expected = (np.abs(shift) * mask).sum() / mask.sum()
    np.testing.assert_allclose(metrics["sampler_gap"][0, 0], expected, rtol=1e-4)


@pytest.mark.parametrize(
    ("correction", "log_weight", "bounds", "expected_weight", "cut"),
    [
        ("token", np.log(1.5), {}, 1.5, 0.0),  # every token weighs 1.5
        ("token", np.log(3.0), {}, 2.0, 1.0),  # capped at 2
        ("sequence", np.log(1.5), {}, 1.5, 0.0),  # the first token's 1.5 on its whole row
        ("token", np.log(0.5), {"sampler_correction_floor": 0.8}, 0.8, 1.0),  # raised to 0.8
        ("token", np.log(1.5), {"sampler_correction_mode": "mask"}, 1.5, 0.0),
        ("token", np.log(3.0), {"sampler_correction_mode": "mask"}, 0.0, 1.0),  # out of the loss
    ],
)
def test_sampler_correction_scales_the_gradient(
    params, correction, log_weight, bounds, expected_weight, cut
):
    """With pi / pi_sampler the same w on every token the corrected gradient is w times the
    plain one, so plain SGD moves every parameter w times as far (not at all when masked)."""
    batch, _ = rollout_batch(params)
    policy = logprobs_under(params, batch)  # [B, N]
    if correction == "token":
        sampler = policy - log_weight
    else:  # the whole log-ratio on each row's first token
        sampler = policy - np.where(np.arange(NEW_TOKENS) == 0, log_weight, 0.0)
    sgd = optax.sgd(1.0)
    plain, plain_metrics = step(params, batch, optimizer=sgd)
    corrected, metrics = step(
        params,
        with_sampler(batch, sampler),
        optimizer=sgd,
        sampler_correction=correction,
        **bounds,
    )
    np.testing.assert_allclose(metrics["sampler_weight_mean"][0, 0], expected_weight, rtol=1e-4)
    np.testing.assert_allclose(metrics["sampler_capped_frac"][0, 0], cut)
    np.testing.assert_allclose(
        metrics["grad_norm"], expected_weight * plain_metrics["grad_norm"], rtol=1e-4
    )
    moved = zip(
        jax.tree.leaves(params),
        jax.tree.leaves(plain.params),
        jax.tree.leaves(corrected.params),
        strict=True,
    )
    for start, a, b in moved:
        np.testing.assert_allclose(b - start, expected_weight * (a - start), atol=1e-6)


def test_sampler_weights_use_the_old_logprobs_in_every_pass(params):
    """With mu = 2 the weights compare the sampler with the policy before the update (the
    old log-probs), not with the policy as it moves: 1.5 in both passes."""
    batch, _ = rollout_batch(params)
    sampler = logprobs_under(params, batch) - np.log(1.5)
    _, metrics = step(
        params, with_sampler(batch, sampler), num_iterations=2, sampler_correction="token"
    )
    np.testing.assert_allclose(metrics["sampler_weight_mean"], [[1.5], [1.5]], rtol=1e-4)
    np.testing.assert_allclose(metrics["sampler_gap"], [[np.log(1.5)]] * 2, rtol=1e-4)
    assert abs(float(metrics["ratio_mean"][1, 0]) - 1.0) > 1e-4  # the policy did move


def test_kept_logits_change_only_memory(params):
    """The default keeps the tiny batch's log-prob logits for the backward pass
    (keep_logits_mib=512); 0 recomputes them. Same update either way."""
    batch, _ = rollout_batch(params)
    assert keeps_logits(batch.completion_mask.size, CONFIG.vocab_size, 512.0)
    kept_state, kept_metrics = step(params, batch, beta=0.0)
    state, metrics = step(params, batch, beta=0.0, keep_logits_mib=0.0)
    for got, expected in zip(
        jax.tree.leaves((kept_state.params, kept_metrics)),
        jax.tree.leaves((state.params, metrics)),
        strict=True,
    ):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    assert float(jnp.abs(state.params["lm_head"] - params["lm_head"]).max()) > 0  # it did move


def test_keeps_logits_by_their_f32_size():
    # The compare workload's micro-batch: 32 x 64 tokens x 49152 x 4 bytes = 384 MiB.
    assert keeps_logits(32 * 64, 49152, 384.0)
    assert not keeps_logits(32 * 64, 49152, 383.9)
    assert not keeps_logits(1, 1, 0.0)


def test_bad_update_config(params):
    with pytest.raises(ValueError, match="num_minibatches must be an int >= 1"):
        UpdateConfig(num_minibatches=0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        UpdateConfig(temperature=0.0)
    with pytest.raises(ValueError, match="matmul_dtype must be 'float32' or 'bfloat16'"):
        UpdateConfig(matmul_dtype="float16")
    with pytest.raises(ValueError, match=r"keep_logits_mib must be >= 0 \(0: always recompute"):
        UpdateConfig(keep_logits_mib=-1.0)
    with pytest.raises(ValueError, match="sampler_correction must be 'none', 'token' or"):
        UpdateConfig(sampler_correction="tis")
    with pytest.raises(ValueError, match="sampler_correction_cap must be >= 1"):
        UpdateConfig(sampler_correction_cap=0.5)
    with pytest.raises(ValueError, match="sampler_correction_mode must be 'truncate' or 'mask'"):
        UpdateConfig(sampler_correction_mode="clip")
    with pytest.raises(ValueError, match=r"sampler_correction_floor must be in \[0, 1\]"):
        UpdateConfig(sampler_correction_floor=-0.1)
    with pytest.raises(ValueError, match="schedule must be one of 'constant', 'cosine'"):
        make_optimizer(1e-3, total_steps=1, schedule="linear")
    batch, _ = rollout_batch(params)
    with pytest.raises(
        ValueError, match=r"batch of 8 sequences must divide into num_minibatches=3"
    ):
        step(params, batch, num_minibatches=3)
    with pytest.raises(ValueError, match=r"sampler_correction='token' needs batch.sampler_logp"):
        step(params, batch, sampler_correction="token")
