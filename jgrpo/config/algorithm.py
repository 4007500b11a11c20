"""The `algorithm` section: the GRPO objective and update schedule."""

from __future__ import annotations

import dataclasses

from jgrpo._checks import check_choice
from jgrpo.advantages import SCALES, STD_DDOFS
from jgrpo.config.fields import ConfigError, option
from jgrpo.losses import (
    KL_ESTIMATORS,
    LOSS_TYPES,
    POLICY_LOSSES,
    RATIO_LEVELS,
    SAMPLER_CORRECTION_LEVELS,
    SAMPLER_CORRECTION_MODES,
)
from jgrpo.update import check_update_settings


@dataclasses.dataclass(frozen=True)
class AlgorithmSection:
    """The GRPO objective and update schedule; the formulas are in docs/objective.md."""

    scale: str = option("group", "advantage scaling: group, batch or none (Dr. GRPO)")
    std_ddof: int = option(0, "0: population std; 1: sample std (TRL, verl)")
    advantage_eps: float = option(1e-4, "added to the std before dividing")
    advantage_clip: float | None = option(None, "clip advantages to [-c, c]; None = off")
    loss_type: str = option("dapo", "aggregation: grpo, bnpo, dapo or dr_grpo")
    clip_eps: float = option(0.2, "PPO clip range below 1")
    clip_eps_high: float | None = option(None, "clip range above 1 (DAPO); None = clip_eps")
    policy_loss: str = option(
        "clip",
        "the policy term: clip (PPO's clipped ratio), cispo (the ratio clipped as a weight "
        "without gradient; MiniMax-M1) or sapo (a smooth gate; SAPO)",
    )
    cispo_max_ratio: float = option(5.0, "cispo: the largest ratio weight (ScaleRL's 5.0)")
    sapo_temperature_pos: float = option(1.0, "sapo: the gate's temperature where A > 0")
    sapo_temperature_neg: float = option(1.05, "sapo: the gate's temperature where A <= 0")
    dual_clip: float | None = option(
        None,
        "negative-advantage tokens stop at ratio c (> 1 + clip_eps_high): verl's dual-clip "
        "clip_ratio_c (3.0 there), TRL's delta; None = off",
    )
    beta: float = option(0.0, "KL penalty weight; 0 = no reference model is loaded")
    kl_estimator: str = option("k3", "KL estimator: k1, k2 or k3")
    kl_in_reward: bool = option(False, "subtract beta x sequence KL from the reward, not the loss")
    kl_bias_correction: bool = option(
        False,
        "weight the loss's KL term by the ratio pi / pi_old (with its gradient): the unbiased "
        "reverse-KL gradient (DeepSeek-V3.2; TRL's use_bias_correction_kl, on by default there)",
    )
    ref_sync_steps: int = option(
        0,
        "every N training steps move the KL reference toward the policy, ref = alpha x policy "
        "+ (1 - alpha) x ref (TR-DPO; TRL's sync_ref_model); 0 = a frozen reference",
    )
    ref_sync_alpha: float = option(0.6, "the reference sync's alpha, in (0, 1]; 1 = a copy")
    ratio_level: str = option("token", "importance ratio per token, or per sequence (GSPO)")
    off_policy_mask_threshold: float | None = option(
        None,
        "leave out completions with a negative advantage whose mean log(pi_sampler / pi) per "
        "token exceeds this (DeepSeek-V3.2; TRL's off_policy_mask_threshold, e.g. 0.5); "
        "None = off",
    )
    top_entropy_quantile: float = option(
        1.0,
        "train the policy term on this share of each micro-batch's completion tokens, those of "
        "highest entropy (1 = all; Wang et al. 2025 keep 0.2; TRL's top_entropy_quantile)",
    )
    sampler_correction: str = option(
        "auto",
        "weight each token's loss by pi / pi_sampler per token or sequence, bounded to "
        "[floor, cap], for a sampler that differs from the policy; none = off; auto = token "
        "when rollout.weights_dtype=bfloat16 (a rounded sampler), else none",
    )
    sampler_correction_cap: float = option(2.0, "the sampler correction's largest weight")
    sampler_correction_mode: str = option(
        "truncate",
        "weights outside [floor, cap]: truncate (moved to the bound) or mask (0: the token, or "
        "with sampler_correction=sequence the completion, leaves the loss)",
    )
    sampler_correction_floor: float = option(
        0.0, "the sampler correction's smallest weight, in [0, 1]; 0 = no lower bound"
    )
    router_aux_loss_coef: float = option(
        0.0,
        "mixture of experts: weight of the routers' load-balancing loss in the update "
        "(transformers' router_aux_loss_coef; 0 = off, 0.001 as Qwen3-MoE was trained)",
    )
    num_iterations: int = option(1, "mu: update passes over each rollout")
    num_minibatches: int = option(1, "optimizer steps per pass")
    grad_accumulation: int = option(1, "micro-batches per minibatch")
    shared_prompt_forward: bool = option(
        True,
        "update: run each prompt once per group, not G times (equal results, less work)",
    )
    completion_buckets: int = option(
        1,
        "update on the narrowest of this many completion widths that holds the longest "
        "completion (1 = always max_new_tokens)",
    )
    pack_completions: bool = option(
        False,
        "update: pack each group's completions into fewer rows, skipping their padding "
        "(equal results; only with the shared-prompt update, else off with a warning)",
    )
    dynamic_sampling: bool = option(False, "DAPO: replace groups with equal rewards by new ones")
    max_extra_rollouts: int = option(2, "dynamic sampling: extra rollouts allowed per step")
    overlong_buffer: int = option(0, "DAPO soft overlong penalty over the last N tokens (0 = off)")
    overlong_penalty: float = option(1.0, "overlong penalty at the length limit")
    mask_truncated: bool = option(False, "leave completions that hit the limit out of the loss")

    def check(self):
        choices = {
            "scale": SCALES,
            "loss_type": LOSS_TYPES,
            "kl_estimator": KL_ESTIMATORS,
            "ratio_level": RATIO_LEVELS,
            "policy_loss": POLICY_LOSSES,
            "sampler_correction": ("auto", "none", *SAMPLER_CORRECTION_LEVELS),
            "sampler_correction_mode": SAMPLER_CORRECTION_MODES,
            "std_ddof": STD_DDOFS,
        }
        for name, accepted in choices.items():
            check_choice(f"algorithm.{name}", getattr(self, name), accepted, ConfigError)
        if self.beta < 0:
            raise ConfigError(f"algorithm.beta must be >= 0 (0 = off), got {self.beta}.")
        if not 0 < self.clip_eps < 1:
            raise ConfigError(f"algorithm.clip_eps must be in (0, 1), got {self.clip_eps}.")
        # The settings the update checks too: its rules, named as this section's fields.
        check_update_settings(self, prefix="algorithm.", none="null", error=ConfigError)
        if self.completion_buckets < 1:
            raise ConfigError(
                f"algorithm.completion_buckets must be >= 1, got {self.completion_buckets}."
            )
        if not self.router_aux_loss_coef >= 0:
            raise ConfigError(
                f"algorithm.router_aux_loss_coef must be >= 0 (0 = off), got "
                f"{self.router_aux_loss_coef}."
            )
        for name in ("max_extra_rollouts", "overlong_buffer"):
            if getattr(self, name) < 0:
                raise ConfigError(f"algorithm.{name} must be >= 0, got {getattr(self, name)}.")
        if not self.cispo_max_ratio >= 1:
            raise ConfigError(
                f"algorithm.cispo_max_ratio must be >= 1 (the largest weight), got "
                f"{self.cispo_max_ratio}."
            )
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"algorithm.{name} must be > 0, got {getattr(self, name)}.")
        if self.ref_sync_steps < 0:
            raise ConfigError(
                f"algorithm.ref_sync_steps must be >= 0 (0 = off), got {self.ref_sync_steps}."
            )
        if self.ref_sync_steps and self.beta == 0:
            raise ConfigError(
                "algorithm.ref_sync_steps moves the KL reference, which exists only with "
                "algorithm.beta > 0: set beta, or algorithm.ref_sync_steps=0."
            )
        if not 0 < self.ref_sync_alpha <= 1:
            raise ConfigError(
                f"algorithm.ref_sync_alpha must be in (0, 1], got {self.ref_sync_alpha}."
            )
        if self.kl_in_reward and self.beta == 0:
            raise ConfigError("algorithm.kl_in_reward needs algorithm.beta > 0 (its weight).")
        if self.kl_bias_correction and (self.kl_in_reward or self.beta == 0):
            raise ConfigError(
                "algorithm.kl_bias_correction weights the KL term in the loss, so it needs "
                "algorithm.beta > 0 and algorithm.kl_in_reward=false: set those, or "
                "algorithm.kl_bias_correction=false."
            )
