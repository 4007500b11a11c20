"""The GRPO objective: clipped importance ratio times advantage, plus a KL penalty.

Pure `jax.numpy` on arrays: no model, no config objects, so any JAX codebase can use it.
Shapes: B sequences (completions), T completion positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jgrpo._checks import check_choice, check_shape

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
KL_ESTIMATORS = ("k1", "k2", "k3")
RATIO_LEVELS = ("token", "sequence")
POLICY_LOSSES = ("clip", "cispo", "sapo")
SAMPLER_CORRECTION_LEVELS = ("token", "sequence")
SAMPLER_CORRECTION_MODES = ("truncate", "mask")
# Log-ratios above this count as this before any exp (verl clamps to +-20): exp(20) = 4.9e8
# keeps the ratio, k3 and their product finite in f32, where exp overflows past 88.7.
MAX_LOG_RATIO = 20.0


def _capped(log_ratio: jax.Array) -> jax.Array:
    """log_ratio, or MAX_LOG_RATIO (with no gradient) where it is larger: bit for bit the
    input up to the cap, and exp of it is finite."""
    return jnp.where(log_ratio > MAX_LOG_RATIO, MAX_LOG_RATIO, log_ratio)


def token_kl(
    logprobs: jax.Array,  # f32[B, T]
    ref_logprobs: jax.Array,  # f32[B, T]
    *,
    kl_estimator: str = "k3",
) -> jax.Array:  # f32[B, T]
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs.

    With d = ref_logprobs - logprobs:
        k1 = -d               (unbiased, high variance, can be negative)
        k2 = d**2 / 2         (biased, low variance)
        k3 = exp(d) - d - 1   (unbiased, low variance, always >= 0; Schulman's estimator)

    k3 takes d = min(d, 20) (MAX_LOG_RATIO, as verl's clamp): finite for any finite input,
    unchanged up to 20, constant with no gradient beyond.
    """
    check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
    delta = ref_logprobs.astype(jnp.float32) - logprobs.astype(jnp.float32)
    if kl_estimator == "k1":
        return -delta
    if kl_estimator == "k2":
        return 0.5 * jnp.square(delta)
    delta = _capped(delta)
    return jnp.exp(delta) - delta - 1.0


def sequence_kl(
    logprobs: jax.Array,  # f32[B, T]
    ref_logprobs: jax.Array,  # f32[B, T]
    mask: jax.Array,  # [B, T], nonzero on completion tokens
    *,
    kl_estimator: str = "k3",
) -> jax.Array:  # f32[B]
    """Sum over each sequence's completion tokens of the per-token KL estimate.

    For the KL penalty placed in the reward (r_i - beta * KL_i) instead of the loss.
    """
    check_shape("logprobs", logprobs, ndim=2)
    check_shape("ref_logprobs", ref_logprobs, like=("logprobs", logprobs))
    check_shape("mask", mask, like=("logprobs", logprobs))
    kl = token_kl(logprobs, ref_logprobs, kl_estimator=kl_estimator)
    return jnp.where(mask.astype(bool), kl, 0.0).sum(axis=-1)


def sampler_weights(
    logprobs: jax.Array,  # f32[B, T] sampled tokens under the policy before the update
    sampler_logprobs: jax.Array,  # f32[B, T] the same tokens under the sampler that drew them
    mask: jax.Array,  # [B, T], nonzero on completion tokens
    *,
    level: str = "token",
    cap: float = 2.0,
    mode: str = "truncate",
    floor: float = 0.0,
) -> jax.Array:  # f32[B, T], 0 off the mask, no gradient
    """Importance weights from the ratio r = pi / pi_sampler, bounded to [floor, cap], for a
    mismatched sampler.

    When the completions come from a sampler that is not exactly the policy being trained
    (bf16 weights, another inference engine), the loss's expectations over the policy are
    estimated from the sampler's tokens; weighting each token's loss by w corrects that,
    and the bounds limit the variance (truncated or masked importance sampling, as TRL's
    `vllm_importance_sampling_mode` and verl's rollout correction offer):

        level="token":    r_t = exp(logprobs_t - sampler_logprobs_t)
        level="sequence": r_t = exp(sum over the row's tokens of that difference)
        mode="truncate":  w_t = min(max(r_t, floor), cap)
        mode="mask":      w_t = r_t if floor <= r_t <= cap, else 0 (at the sequence level
                          the whole row drops out of the loss)

    Pass the result as `grpo_loss(..., sampler_weights=w)`. `logprobs` are the policy's
    before this update (the `old_logprobs` of `grpo_loss`).
    """
    check_choice("level", level, SAMPLER_CORRECTION_LEVELS)
    check_choice("mode", mode, SAMPLER_CORRECTION_MODES)
    check_shape("logprobs", logprobs, ndim=2)
    check_shape("sampler_logprobs", sampler_logprobs, like=("logprobs", logprobs))
    check_shape("mask", mask, like=("logprobs", logprobs))
    if not cap >= 1:
        raise ValueError(f"cap must be >= 1 (the largest weight), got {cap}.")
    if not 0 <= floor <= 1:
        raise ValueError(f"floor must be in [0, 1] (the smallest weight kept), got {floor}.")
    on = mask.astype(bool)
    log_ratio = jnp.where(
        on, logprobs.astype(jnp.float32) - sampler_logprobs.astype(jnp.float32), 0.0
    )  # [B, T]
    if level == "sequence":
        log_ratio = jnp.broadcast_to(log_ratio.sum(axis=-1, keepdims=True), log_ratio.shape)
    ratio = jnp.exp(log_ratio)  # its overflow to inf is above any cap
    if mode == "truncate":
        weight = jnp.clip(ratio, floor, cap)
    else:
        weight = jnp.where((ratio >= floor) & (ratio <= cap), ratio, 0.0)
    return jax.lax.stop_gradient(jnp.where(on, weight, 0.0))


def high_entropy_mask(
    entropy: jax.Array,  # f32[B, T] each position's entropy under the policy
    mask: jax.Array,  # [B, T], nonzero on completion tokens
    *,
    quantile: float,
) -> jax.Array:  # f32[B, T], 1 on the kept tokens, no gradient
    """1 on the completion tokens whose entropy is at least the (1 - quantile) quantile of
    all completion tokens' entropies here (linear interpolation), 0 elsewhere.

    Pass it as `grpo_loss(..., policy_mask=...)` to train the policy term on the `quantile`
    share of highest-entropy tokens only, the "forking" tokens where the policy is unsure
    (Wang et al. 2025 keep 0.2; TRL's `top_entropy_quantile`). No tokens: all 0.
    """
    check_shape("entropy", entropy, ndim=2)
    check_shape("mask", mask, like=("entropy", entropy))
    if not 0 < quantile <= 1:
        raise ValueError(f"quantile must be in (0, 1] (the share of tokens kept), got {quantile}.")
    on = mask.astype(bool)
    entropy = jax.lax.stop_gradient(entropy.astype(jnp.float32))
    threshold = jnp.nanquantile(jnp.where(on, entropy, jnp.nan), 1.0 - quantile)
    return (on & (entropy >= threshold)).astype(jnp.float32)


def off_policy_mask(
    advantages: jax.Array,  # f32[B]
    logprobs: jax.Array,  # f32[B, T] sampled tokens under the current policy
    sampler_logprobs: jax.Array,  # f32[B, T] the same tokens under the sampler that drew them
    mask: jax.Array,  # [B, T], nonzero on completion tokens
    *,
    threshold: float,
) -> jax.Array:  # f32[B, T], each row's 0 or 1 on every position, no gradient
    """0 on the rows with a negative advantage whose mean per-token
    log(pi_sampler / pi) over the completion exceeds `threshold`, 1 on every other row.

    DeepSeek-V3.2's off-policy sequence masking (TRL's `off_policy_mask_threshold`): a
    completion the policy has drifted far from, and which would be pushed down, is left out
    rather than trusted. Pass it as `grpo_loss(..., policy_mask=...)` (times any other mask).
    """
    check_shape("logprobs", logprobs, ndim=2)
    check_shape("sampler_logprobs", sampler_logprobs, like=("logprobs", logprobs))
    check_shape("mask", mask, like=("logprobs", logprobs))
    check_shape("advantages", advantages, shape=logprobs.shape[:1])
    if not threshold >= 0:
        raise ValueError(f"threshold must be >= 0 (a mean log-ratio), got {threshold}.")
    weights = mask.astype(jnp.float32)  # [B, T]
    gap = sampler_logprobs.astype(jnp.float32) - jax.lax.stop_gradient(logprobs).astype(jnp.float32)
    mean_gap = (gap * weights).sum(-1) / jnp.maximum(weights.sum(-1), 1.0)  # [B]
    keep = (advantages >= 0) | (mean_gap <= threshold)  # [B]
    return jnp.broadcast_to(keep[:, None], weights.shape).astype(jnp.float32)


def grpo_loss(
    logprobs: jax.Array,  # f32[B, T] sampled tokens under the current policy
    old_logprobs: jax.Array,  # f32[B, T] under the policy that sampled them
    advantages: jax.Array,  # f32[B]
    mask: jax.Array,  # [B, T], nonzero on completion tokens
    *,
    ref_logprobs: jax.Array | None = None,  # f32[B, T] under the frozen reference policy
    loss_type: str = "grpo",
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    policy_loss: str = "clip",
    cispo_max_ratio: float = 5.0,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    beta: float = 0.04,
    kl_estimator: str = "k3",
    ratio_level: str = "token",
    max_completion_length: int | None = None,
    total_tokens: jax.Array | int | None = None,
    total_sequences: jax.Array | int | None = None,
    sampler_weights: jax.Array | None = None,  # f32[B, T] from `sampler_weights`
    kl_bias_correction: bool = False,
    policy_mask: jax.Array | None = None,  # [B, T] from `high_entropy_mask`, `off_policy_mask`
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped-ratio policy loss with an optional KL penalty; returns (scalar loss, metrics).

    Per completion token t of sequence i, with advantage A_i:

        ratio_level="token":    r_t = exp(logprobs_t - old_logprobs_t)
        ratio_level="sequence": r_t = exp(masked mean over i of (logprobs - old_logprobs)) (GSPO)
        L_t = -min(r_t A_i, clip(r_t, 1 - clip_eps, 1 + clip_eps_high) A_i) + beta * KL_t

    The log-ratio in r_t is taken as 0 off the mask and as min(log-ratio, 20) on it
    (`MAX_LOG_RATIO`, verl's clamp): a token past 20 counts as 20, with no gradient through
    r_t, so loss and gradient are finite for any finite inputs and unchanged below 20.

    `policy_loss` replaces the clipped term (the first part of L_t) with:
        "cispo":  -sg(min(r_t, cispo_max_ratio)) A_i logprobs_t, the ratio clipped as a weight
                  with no gradient, so every token keeps a gradient (MiniMax-M1; ScaleRL)
        "sapo":   -sigmoid(tau (r_t - 1)) 4 / tau A_i, a smooth gate in place of the clip,
                  tau = sapo_temperature_pos where A_i > 0, else sapo_temperature_neg (SAPO)
    Both have the clipped term's gradient on-policy (r = 1): -A_i grad logprobs_t.

    `dual_clip` c (> 1 + clip_eps_high; "clip" only) bounds the policy term of tokens with
    A_i < 0 at -c A_i, so a ratio above c gets no gradient (verl's dual-clip `clip_ratio_c`,
    TRL's `delta`): a token the policy now far prefers no longer pushes the loss without limit.

    KL_t is `token_kl(logprobs, ref_logprobs, kl_estimator=...)` (0 off the mask). On-policy
    (one update per rollout) pass `old_logprobs=jax.lax.stop_gradient(logprobs)`, so r = 1
    with gradient.
    `kl_bias_correction=True` weights the penalty by the unclipped ratio, beta * r_t * KL_t,
    r_t with its gradient: with k3 the KL gradient becomes the unbiased reverse-KL gradient
    (log(pi / pi_ref) grad log pi per token on-policy, not 1 - pi_ref / pi), as in
    DeepSeek-V3.2 and TRL's `use_bias_correction_kl`; `kl_mean` stays the unweighted KL_t.
    `policy_mask` (no gradient), when given, multiplies each token's policy term (the
    clipped-ratio part; the KL term and the normaliser keep `mask`), as TRL applies its
    entropy mask.
    `sampler_weights` w (no gradient), when given, multiply each token's loss: L_t w_t, the
    correction for tokens drawn by a sampler other than the policy (`sampler_weights`).

    Aggregation of L over the mask m:
        "grpo":    sum over sequences with >= 1 completion token of sum_t(L m) / sum_t(m),
                   divided by total_sequences, the number of such sequences in the whole
                   global batch (default: this batch's, making it their mean), so the
                   losses and gradients of micro-batches add up exactly to the full batch's
        "bnpo":    sum(L m) / sum(m) over this batch
        "dapo":    sum(L m) / total_tokens, total_tokens being the completion-token count of
                   the whole global batch (default: this batch's), so the losses and gradients
                   of micro-batches add up exactly to those of the full batch
        "dr_grpo": sum(L m) / (B * max_completion_length), max_completion_length default T

    Metrics (scalars, no gradient): `clip_frac_low` (tokens with A < 0 and r < 1 - clip_eps),
    `clip_frac_high` (A > 0 and r > 1 + clip_eps_high), `clip_frac_dual` (A < 0 and r > c)
    when dual_clip is given, `ratio_mean`, and `kl_mean` when ref_logprobs is given; token
    averages over the mask.
    """
    check_choice("loss_type", loss_type, LOSS_TYPES)
    check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
    check_choice("ratio_level", ratio_level, RATIO_LEVELS)
    check_choice("policy_loss", policy_loss, POLICY_LOSSES)
    check_shape("logprobs", logprobs, ndim=2)
    check_shape("old_logprobs", old_logprobs, like=("logprobs", logprobs))
    check_shape("mask", mask, like=("logprobs", logprobs))
    check_shape("advantages", advantages, shape=logprobs.shape[:1])
    if ref_logprobs is not None:
        check_shape("ref_logprobs", ref_logprobs, like=("logprobs", logprobs))
    if sampler_weights is not None:
        check_shape("sampler_weights", sampler_weights, like=("logprobs", logprobs))
    if policy_mask is not None:
        check_shape("policy_mask", policy_mask, like=("logprobs", logprobs))
    if beta < 0:
        raise ValueError(f"beta must be >= 0 (0 disables the KL penalty), got {beta}.")
    if beta > 0 and ref_logprobs is None:
        raise ValueError(
            f"beta={beta} > 0 needs ref_logprobs (log-probs under the reference policy); "
            "pass them or set beta=0."
        )
    clip_eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if not 0 < clip_eps < 1:
        raise ValueError(f"clip_eps must be in (0, 1), got {clip_eps}.")
    if clip_eps_high <= 0:
        raise ValueError(f"clip_eps_high must be > 0 (None means clip_eps), got {clip_eps_high}.")
    if max_completion_length is not None and max_completion_length < 1:
        raise ValueError(f"max_completion_length must be >= 1, got {max_completion_length}.")
    if dual_clip is not None and policy_loss != "clip":
        raise ValueError(f"dual_clip bounds the clipped term, not policy_loss={policy_loss!r}.")
    if not cispo_max_ratio >= 1:
        raise ValueError(
            f"cispo_max_ratio must be >= 1 (the largest weight), got {cispo_max_ratio}."
        )
    if not (sapo_temperature_pos > 0 and sapo_temperature_neg > 0):
        raise ValueError(
            "sapo_temperature_pos and sapo_temperature_neg must be > 0, got "
            f"{sapo_temperature_pos} and {sapo_temperature_neg}."
        )
    if dual_clip is not None and not dual_clip > 1 + clip_eps_high:
        raise ValueError(
            f"dual_clip must be > 1 + clip_eps_high = {1 + clip_eps_high} (the ratio above which "
            f"negative-advantage tokens stop; None = off), got {dual_clip}."
        )

    batch, length = logprobs.shape
    weights = mask.astype(jnp.float32)  # [B, T]
    on = mask.astype(bool)  # [B, T]
    logprobs = logprobs.astype(jnp.float32)
    # Off the mask the log-ratio (and below the reference gap) is 0 before any exp or product:
    # exp(89) = inf there, or a -inf log-prob, would make inf * 0 = NaN in loss or gradient.
    log_ratio = jnp.where(on, logprobs - old_logprobs.astype(jnp.float32), 0.0)  # [B, T]
    tokens_per_sequence = weights.sum(axis=-1)  # [B]
    if ratio_level == "sequence":
        sequence_log_ratio = (log_ratio * weights).sum(axis=-1) / jnp.maximum(
            tokens_per_sequence, 1.0
        )
        log_ratio = jnp.broadcast_to(sequence_log_ratio[:, None], (batch, length))
    ratio = jnp.exp(_capped(log_ratio))  # [B, T], at most e^20

    adv = advantages.astype(jnp.float32)[:, None]  # [B, 1]
    clipped_ratio = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps_high)
    if policy_loss == "cispo":
        weight = jax.lax.stop_gradient(jnp.minimum(ratio, cispo_max_ratio))
        per_token = -weight * adv * logprobs  # [B, T]
    elif policy_loss == "sapo":
        tau = jnp.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg)  # [B, 1]
        per_token = -jax.nn.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv  # [B, T]
    else:
        per_token = -jnp.minimum(ratio * adv, clipped_ratio * adv)  # [B, T]
    if dual_clip is not None:
        per_token = jnp.where(adv < 0, jnp.minimum(per_token, -dual_clip * adv), per_token)
    if policy_mask is not None:
        per_token = per_token * jax.lax.stop_gradient(policy_mask.astype(jnp.float32))
    if ref_logprobs is not None:
        ref_logprobs = jnp.where(on, ref_logprobs.astype(jnp.float32), logprobs)  # [B, T]
        kl = token_kl(logprobs, ref_logprobs, kl_estimator=kl_estimator)  # [B, T], 0 off the mask
        if beta > 0:
            per_token = per_token + beta * (ratio * kl if kl_bias_correction else kl)
    if sampler_weights is not None:
        per_token = per_token * jax.lax.stop_gradient(sampler_weights.astype(jnp.float32))

    masked_sum = (per_token * weights).sum()
    if loss_type == "grpo":
        sequence_means = (per_token * weights).sum(axis=-1) / jnp.maximum(tokens_per_sequence, 1.0)
        nonempty = (tokens_per_sequence > 0).astype(jnp.float32)  # [B]
        normaliser = nonempty.sum() if total_sequences is None else total_sequences
        loss = (sequence_means * nonempty).sum() / jnp.maximum(
            jnp.asarray(normaliser, jnp.float32), 1.0
        )
    elif loss_type == "bnpo":
        loss = masked_sum / jnp.maximum(weights.sum(), 1.0)
    elif loss_type == "dapo":
        normaliser = weights.sum() if total_tokens is None else total_tokens
        loss = masked_sum / jnp.maximum(jnp.asarray(normaliser, jnp.float32), 1.0)
    else:
        max_length = length if max_completion_length is None else max_completion_length
        loss = masked_sum / (batch * max_length)

    def token_mean(values):
        return jax.lax.stop_gradient((values * weights).sum() / jnp.maximum(weights.sum(), 1.0))

    metrics = {
        "clip_frac_low": token_mean(((ratio < 1.0 - clip_eps) & (adv < 0)).astype(jnp.float32)),
        "clip_frac_high": token_mean(
            ((ratio > 1.0 + clip_eps_high) & (adv > 0)).astype(jnp.float32)
        ),
        "ratio_mean": token_mean(ratio),
    }
    if dual_clip is not None:
        metrics["clip_frac_dual"] = token_mean(
            ((ratio > dual_clip) & (adv < 0)).astype(jnp.float32)
        )
    if ref_logprobs is not None:
        metrics["kl_mean"] = token_mean(kl)
    return loss, metrics
