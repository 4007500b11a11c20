"""The training config: a tree of frozen dataclasses, read from YAML plus `key=value` overrides.

    config = load_config("configs/demo.yaml", ["rollout.num_generations=16", "optim.lr=1e-6"])

Everything is validated before anything runs: an unknown key names the closest valid ones, a
wrong type or an impossible value names the field and what would be accepted. Each field
carries a one-line description, which `format_help()` lists with the defaults.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import math
import pathlib
import types
import typing
from collections.abc import Sequence
from typing import Any

import yaml

from jgrpo._checks import check_choice
from jgrpo.advantages import SCALES, STD_DDOFS
from jgrpo.distributed import INITIALIZE_CHOICES
from jgrpo.losses import (
    KL_ESTIMATORS,
    LOSS_TYPES,
    POLICY_LOSSES,
    RATIO_LEVELS,
    SAMPLER_CORRECTION_LEVELS,
    SAMPLER_CORRECTION_MODES,
)
from jgrpo.update import KEEP_LOGITS_MIB


class ConfigError(ValueError):
    """A config that cannot run; the message names the field and the fix."""


def check_dtype(field: str, value: str) -> None:
    """A dtype option: float32 or bfloat16."""
    if value not in ("float32", "bfloat16"):
        raise ConfigError(f"{field} must be 'float32' or 'bfloat16', got {value!r}.")


def option(default: Any, help: str) -> Any:  # noqa: A002 (the natural name for a CLI)
    """A dataclass field with its one-line description."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """The policy: a Hugging Face checkpoint, or a `jgrpo.models` preset initialised at random."""

    path: str | None = option(None, "HF checkpoint directory or hub name; None: the preset")
    preset: str = option("tiny", "models preset used when path is None (random init)")
    dtype: str = option("float32", "parameter dtype: float32 or bfloat16")
    remat: bool = option(False, "recompute each layer in the backward pass (less memory)")
    keep_logits_mib: float = option(
        KEEP_LOGITS_MIB,
        "the update keeps a micro-batch's log-prob logits (tokens x vocabulary x 4 bytes, "
        "divided by the devices its rows are split over) for the backward pass up to this many "
        "MiB per device, else recomputes them (0: always recompute)",
    )
    matmul_dtype: str = option(
        "float32",
        "operands of the update's weight-matrix products: float32, or bfloat16 (mixed precision: "
        "bf16 products summed in f32; parameters, optimizer state and activations stay f32)",
    )
    reference_dtype: str = option(
        "float32",
        "weights of the frozen reference (algorithm.beta > 0): float32 (a copy of the initial "
        "parameters), or bfloat16 (matrices and embeddings rounded once: half its memory, bf16 "
        "products summed in f32; its log-probs, and so the KL, move by the rounding)",
    )

    def check(self):
        for name in ("dtype", "matmul_dtype", "reference_dtype"):
            check_dtype(f"model.{name}", getattr(self, name))
        if not self.keep_logits_mib >= 0:
            raise ConfigError(
                f"model.keep_logits_mib must be >= 0 (0: recompute the logits in the backward "
                f"pass), got {self.keep_logits_mib}."
            )


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """Sampling: P = prompts_per_step prompts per step, G completions each, up to N tokens."""

    prompts_per_step: int = option(8, "prompts sampled per training step")
    num_generations: int = option(8, "G: completions per prompt (the group), >= 2")
    max_new_tokens: int = option(128, "N: completion length limit in tokens")
    temperature: float = option(1.0, "sampling temperature, also used to score log-probs")
    top_p: float = option(1.0, "nucleus sampling mass (1 = off)")
    top_k: int = option(0, "sample among the k most likely tokens (0 = off)")
    min_p: float = option(0.0, "drop tokens below min_p x the top probability (0 = off)")
    max_prompt_length: int = option(
        256,
        "the longest prompt allowed (longer is an error); prompts are left-padded to the "
        "task's longest, rounded up to a multiple of 8, at most this",
    )
    weights_dtype: str = option(
        "float32",
        "weight matrices while sampling: float32 (the parameters), or bfloat16 (a copy, f32 "
        "sums: faster decoding, from the policy with its matrices rounded to bf16)",
    )

    def check(self):
        check_dtype("rollout.weights_dtype", self.weights_dtype)
        if self.num_generations < 2:
            raise ConfigError(
                f"rollout.num_generations must be >= 2 (a group needs two completions to "
                f"compare), got {self.num_generations}."
            )
        if self.temperature <= 0:
            raise ConfigError(
                f"rollout.temperature must be > 0 for training (greedy sampling gives no "
                f"exploration and no log-probs), got {self.temperature}."
            )
        for name in ("prompts_per_step", "max_new_tokens", "max_prompt_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rollout.{name} must be >= 1, got {getattr(self, name)}.")
        if not 0 < self.top_p <= 1 or self.top_k < 0 or not 0 <= self.min_p < 1:
            raise ConfigError(
                "rollout.top_p must be in (0, 1], rollout.top_k >= 0, rollout.min_p in [0, 1); "
                f"got top_p={self.top_p}, top_k={self.top_k}, min_p={self.min_p}."
            )


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
        for name in (
            "num_iterations",
            "num_minibatches",
            "grad_accumulation",
            "completion_buckets",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"algorithm.{name} must be >= 1, got {getattr(self, name)}.")
        for name in ("max_extra_rollouts", "overlong_buffer"):
            if getattr(self, name) < 0:
                raise ConfigError(f"algorithm.{name} must be >= 0, got {getattr(self, name)}.")
        if not self.sampler_correction_cap >= 1:
            raise ConfigError(
                "algorithm.sampler_correction_cap must be >= 1 (the largest weight), got "
                f"{self.sampler_correction_cap}."
            )
        if not 0 <= self.sampler_correction_floor <= 1:
            raise ConfigError(
                "algorithm.sampler_correction_floor must be in [0, 1] (0 = no lower bound; "
                "above 1 it would cut the sampler's own tokens), got "
                f"{self.sampler_correction_floor}."
            )
        if self.dual_clip is not None and self.policy_loss != "clip":
            raise ConfigError(
                "algorithm.dual_clip bounds the clipped policy term, so it needs "
                f"algorithm.policy_loss=clip, not {self.policy_loss}; set algorithm.dual_clip=null."
            )
        if not self.cispo_max_ratio >= 1:
            raise ConfigError(
                f"algorithm.cispo_max_ratio must be >= 1 (the largest weight), got "
                f"{self.cispo_max_ratio}."
            )
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"algorithm.{name} must be > 0, got {getattr(self, name)}.")
        high = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        if self.dual_clip is not None and not self.dual_clip > 1 + high:
            raise ConfigError(
                f"algorithm.dual_clip must be > 1 + clip_eps_high = {1 + high} (the ratio above "
                f"which negative-advantage tokens stop), got {self.dual_clip}; set it higher "
                "(verl uses 3.0) or to null."
            )
        if self.off_policy_mask_threshold is not None and not self.off_policy_mask_threshold >= 0:
            raise ConfigError(
                "algorithm.off_policy_mask_threshold must be >= 0 (a mean log-ratio per token; "
                f"null = off), got {self.off_policy_mask_threshold}."
            )
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
        if not 0 < self.top_entropy_quantile <= 1:
            raise ConfigError(
                "algorithm.top_entropy_quantile must be in (0, 1] (the share of tokens the policy "
                f"term trains on; 1 = all), got {self.top_entropy_quantile}."
            )
        if self.kl_in_reward and self.beta == 0:
            raise ConfigError("algorithm.kl_in_reward needs algorithm.beta > 0 (its weight).")
        if self.kl_bias_correction and (self.kl_in_reward or self.beta == 0):
            raise ConfigError(
                "algorithm.kl_bias_correction weights the KL term in the loss, so it needs "
                "algorithm.beta > 0 and algorithm.kl_in_reward=false: set those, or "
                "algorithm.kl_bias_correction=false."
            )


TASKS = ("addition", "json_extraction", "gsm8k", "jsonl", "tfds")


@dataclasses.dataclass(frozen=True)
class TaskSection:
    """The data, its eval split and the reward functions (see docs/training.md)."""

    name: str = option("addition", "addition (the demo), json_extraction, gsm8k, jsonl or tfds")
    dataset: str | None = option(None, "tfds: the TFDS dataset name")
    path: str | None = option(None, "jsonl: the data file; gsm8k: a folder of <split>.jsonl")
    eval_path: str | None = option(None, "jsonl: a separate eval file")
    data_dir: str | None = option(None, "gsm8k / tfds: the TFDS data_dir")
    split: str = option("train", "gsm8k / tfds: the training split")
    eval_split: str = option("test", "gsm8k / tfds: the eval split")
    prompt_field: str = option("prompt", "jsonl / tfds: the field that holds the prompt")
    system_prompt: str | None = option(
        None, "chat prompts start with this system message (gsm8k: None keeps its own)"
    )
    rewards: str | None = option(
        None,
        "'name:weight,...' of built-in rewards or your own module:function[:weight]; None: the "
        "task's own (jsonl, tfds: required)",
    )
    on_error: str = option("reject", "malformed rows or too-long prompts: reject or skip")
    chat: bool = option(False, "addition / json_extraction / jsonl / tfds: as chat messages")
    max_operand: int = option(9, "addition: operands go from 0 to this")
    num_examples: int = option(2000, "json_extraction: examples generated")
    held_out: int = option(0, "examples kept out of training for eval (0: the task's eval split)")
    eval_size: int = option(0, "evaluate on the first N eval examples (0 = all)")
    max_reward_failure_share: float = option(
        0.1, "stop if more than this share of a step's reward scores fail"
    )
    reward_workers: int = option(2, "processes that run reward functions (0: in-process)")
    reward_timeout_s: float = option(60.0, "a reward call slower than this scores None")

    def check(self):
        if self.reward_workers < 0 or self.reward_timeout_s <= 0:
            raise ConfigError(
                "task.reward_workers must be >= 0 and task.reward_timeout_s > 0; got "
                f"{self.reward_workers}, {self.reward_timeout_s}."
            )
        check_choice("task.name", self.name, TASKS, ConfigError)
        check_choice("task.on_error", self.on_error, ("reject", "skip"), ConfigError)
        if self.name == "jsonl" and (self.path is None or self.rewards is None):
            raise ConfigError(
                "task.name=jsonl needs task.path (the data file) and task.rewards (e.g. "
                "'math:1.0,think_answer_format:0.2'); see docs/training.md."
            )
        if self.name == "tfds" and (self.dataset is None or self.rewards is None):
            raise ConfigError(
                "task.name=tfds needs task.dataset (a TFDS name) and task.rewards (e.g. "
                "'math:1.0'); see docs/training.md."
            )
        for name in ("max_operand", "num_examples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"task.{name} must be >= 1, got {getattr(self, name)}.")
        if self.held_out < 0 or self.eval_size < 0:
            raise ConfigError(
                "task.held_out and task.eval_size must be >= 0; got "
                f"{self.held_out}, {self.eval_size}."
            )
        if not 0 <= self.max_reward_failure_share <= 1:
            raise ConfigError(
                "task.max_reward_failure_share must be in [0, 1], got "
                f"{self.max_reward_failure_share}."
            )


@dataclasses.dataclass(frozen=True)
class RewardModelSection:
    """A learned reward model (an HF sequence classifier) scored as one more reward function."""

    path: str | None = option(
        None, "HF *ForSequenceClassification checkpoint dir or hub name; None: no reward model"
    )
    name: str = option("reward_model", "its reward's name: metrics reward/<name>/mean")
    weight: float = option(1.0, "its weight in the total reward")
    dtype: str = option("bfloat16", "its parameter dtype: bfloat16 or float32")
    batch_size: int = option(16, "sequences scored per jitted call")
    max_length: int = option(2048, "longest prompt + completion in its tokens (longer: None)")
    normalize: str = option(
        "none", "none, or running: (score - mean) / std over every training score so far"
    )
    scale: float = option(
        1.0, "reward = scale * score + shift: a fixed affine map (after normalize)"
    )
    shift: float = option(0.0, "added after scale")

    def check(self):
        check_dtype("reward_model.dtype", self.dtype)
        if self.batch_size < 1 or self.max_length < 1:
            raise ConfigError(
                "reward_model.batch_size and reward_model.max_length must be >= 1; got "
                f"{self.batch_size}, {self.max_length}."
            )
        if not self.name:
            raise ConfigError("reward_model.name must be a non-empty string.")
        if self.normalize not in ("none", "running"):
            raise ConfigError(
                f"reward_model.normalize must be 'none' or 'running', got {self.normalize!r}."
            )


@dataclasses.dataclass(frozen=True)
class OptimSection:
    """AdamW after global-norm clipping, with linear warmup then a constant or cosine lr."""

    lr: float = option(1e-6, "peak learning rate (AdamW)")
    warmup_steps: int = option(0, "linear warmup from 0, in optimizer steps")
    schedule: str = option("constant", "after warmup: constant or cosine")
    weight_decay: float = option(0.0, "AdamW decoupled weight decay")
    max_grad_norm: float | None = option(1.0, "global-norm gradient clipping; None = off")
    b1: float = option(0.9, "Adam beta1")
    b2: float = option(0.99, "Adam beta2")
    eps: float = option(1e-8, "Adam epsilon: added to sqrt(v) in the update's denominator")

    def check(self):
        if self.lr <= 0:
            raise ConfigError(f"optim.lr must be > 0, got {self.lr}.")
        if self.eps <= 0:
            raise ConfigError(f"optim.eps must be > 0, got {self.eps}.")
        if self.schedule not in ("constant", "cosine"):
            raise ConfigError(
                f"optim.schedule must be 'constant' or 'cosine', got {self.schedule!r}."
            )
        if self.warmup_steps < 0 or self.weight_decay < 0:
            raise ConfigError("optim.warmup_steps and optim.weight_decay must be >= 0.")


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """The loop: how long, the seed, where checkpoints and metrics go, and how often."""

    steps: int = option(100, "training steps (one rollout batch each)")
    seed: int = option(0, "seeds data order, initialisation and sampling")
    run_dir: str = option("runs/demo", "checkpoints and metrics; rerun with it to resume")
    eval_every: int = option(20, "evaluate on held-out prompts every N steps (0 = never)")
    save_every: int = option(50, "checkpoint every N steps")
    keep_checkpoints: int = option(3, "how many recent checkpoints to keep")
    export: bool = option(True, "write the final policy in HF format to run_dir/hf")
    log_samples: int = option(2, "sample completions printed at each evaluation")
    tensorboard: bool = option(True, "also write TensorBoard event files")
    progress: bool = option(True, "show a progress bar")
    compilation_cache: str | None = option(
        "~/.cache/jgrpo/jax",
        "persistent XLA compilation cache, so a rerun starts without compiling (None = off; "
        "not used on several CPU devices, docs/troubleshooting.md)",
    )
    profile_steps: int = option(
        0, "trace this many steps with the JAX profiler into run_dir/profile (0 = off)"
    )
    profile_start: int = option(
        2, "the first step traced, counted from 1 as in the metrics (step 1 compiles)"
    )

    def check(self):
        for name in ("steps", "save_every", "keep_checkpoints", "profile_start"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}.")
        if self.eval_every < 0:
            raise ConfigError(f"train.eval_every must be >= 0, got {self.eval_every}.")
        if self.profile_steps < 0:
            raise ConfigError(f"train.profile_steps must be >= 0, got {self.profile_steps}.")
        if self.profile_steps and self.profile_start > self.steps:
            raise ConfigError(
                f"train.profile_start={self.profile_start} is after the last step "
                f"(train.steps={self.steps}), so nothing would be traced; lower it."
            )


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """How the devices form the (data, fsdp, tensor) mesh; see docs/scaling.md."""

    data: int = option(1, "data-parallel replicas, each with whole parameters (-1: the rest)")
    fsdp: int = option(
        -1, "data parallel with parameters and optimizer state sharded (-1: the rest)"
    )
    tensor: int = option(1, "tensor parallel: heads, MLP and vocabulary split (-1: the rest)")
    devices: int = option(-1, "build the mesh from the first N devices (-1: all of them)")
    memory_budget_gib: float | None = option(
        None, "device memory for the start-up check (None: the device's own limit; CPU: none)"
    )

    def check(self):
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for name, size in sizes.items():
            if size == 0 or size < -1:
                raise ConfigError(f"mesh.{name} must be >= 1 or -1 (the rest), got {size}.")
        if list(sizes.values()).count(-1) > 1:
            raise ConfigError(
                f"at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1, got {sizes}."
            )
        if self.devices == 0 or self.devices < -1:
            raise ConfigError(f"mesh.devices must be >= 1 or -1 (all), got {self.devices}.")
        if self.memory_budget_gib is not None and self.memory_budget_gib <= 0:
            raise ConfigError(
                f"mesh.memory_budget_gib must be > 0 or null, got {self.memory_budget_gib}."
            )

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data, self.fsdp, self.tensor)


@dataclasses.dataclass(frozen=True)
class DistributedSection:
    """Multi-host runs (the same command on every host): how `jax.distributed` is started."""

    initialize: str = option(
        "auto",
        "start jax.distributed: auto (when set below or a cluster is detected), always, never",
    )
    coordinator_address: str | None = option(
        None, "host:port of process 0 (None: from the cluster, or JAX_COORDINATOR_ADDRESS)"
    )
    num_processes: int | None = option(None, "processes in the run (None: from the cluster)")
    process_id: int | None = option(None, "this process's index, 0-based (None: from the cluster)")

    def check(self):
        check_choice("distributed.initialize", self.initialize, INITIALIZE_CHOICES, ConfigError)
        if self.num_processes is not None and self.num_processes < 1:
            raise ConfigError(
                f"distributed.num_processes must be >= 1 or null, got {self.num_processes}."
            )
        if self.process_id is not None:
            limit = self.num_processes
            if self.process_id < 0 or (limit is not None and self.process_id >= limit):
                raise ConfigError(
                    f"distributed.process_id must be in [0, distributed.num_processes) = "
                    f"[0, {limit}), got {self.process_id}."
                )


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole training config: one section per YAML mapping.

    `check()` validates every section, then that the prompts_per_step x num_generations
    sequences of a step split into num_minibatches x grad_accumulation equal parts.
    """

    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    task: TaskSection = dataclasses.field(default_factory=TaskSection)
    reward_model: RewardModelSection = dataclasses.field(default_factory=RewardModelSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    algorithm: AlgorithmSection = dataclasses.field(default_factory=AlgorithmSection)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    distributed: DistributedSection = dataclasses.field(default_factory=DistributedSection)

    def check(self) -> Config:
        for section in dataclasses.fields(self):
            _check_finite(section.name, getattr(self, section.name))
            getattr(self, section.name).check()
        rows = self.rollout.prompts_per_step * self.rollout.num_generations
        parts = self.algorithm.num_minibatches * self.algorithm.grad_accumulation
        if rows % parts:
            raise ConfigError(
                f"rollout.prompts_per_step x rollout.num_generations = {rows} sequences must "
                f"divide into algorithm.num_minibatches x algorithm.grad_accumulation = {parts} "
                "equal parts; change one of them."
            )
        return self

    @property
    def sampler_correction(self) -> str:
        """algorithm.sampler_correction with `auto` resolved: `token` when the rollout samples
        with bf16 weight matrices (the sampler is then not the policy being trained, as with
        TRL's vLLM sampling, which it corrects by default), `none` when it samples from the
        f32 parameters themselves."""
        chosen = self.algorithm.sampler_correction
        if chosen != "auto":
            return chosen
        return "token" if self.rollout.weights_dtype == "bfloat16" else "none"


def _check_finite(name: str, section: Any) -> None:
    """NaN and inf pass every range check (`nan <= 0` is False) and would reach the
    optimizer or the loss, so no float setting may hold one."""
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(
                f"{name}.{field.name} must be a finite number, got {value}; set a real value "
                "(a large one where you meant no limit)."
            )


_SECTIONS = {
    "model": ModelSection,
    "task": TaskSection,
    "reward_model": RewardModelSection,
    "rollout": RolloutSection,
    "algorithm": AlgorithmSection,
    "optim": OptimSection,
    "train": TrainSection,
    "mesh": MeshSection,
    "distributed": DistributedSection,
}


def field_names() -> list[str]:
    """Every dotted key of the config tree, e.g. 'rollout.num_generations'."""
    return [f"{name}.{f.name}" for name, cls in _SECTIONS.items() for f in dataclasses.fields(cls)]


def _unknown(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, field_names(), n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    return ConfigError(f"unknown config key {key!r}.{hint} See --help for every key.")


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Checks a value against a field's type (ints are accepted for floats)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        (annotation,) = [a for a in options if a is not type(None)]
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-6 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if type(value) is annotation:  # exact: True is not an int here, 1 is not a bool
        return value
    raise ConfigError(
        f"{key} must be {annotation.__name__}, got {value!r} ({type(value).__name__})."
    )


def _build(cls, values: dict[str, Any], prefix: str):
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in values.items():
        key = prefix + name
        if name not in known:
            raise _unknown(key)
        if cls is Config:
            if not isinstance(value, dict):
                raise ConfigError(f"{key} must be a mapping of its fields, got {value!r}.")
            kwargs[name] = _build(_SECTIONS[name], value, key + ".")
        else:
            kwargs[name] = _coerce(key, value, hints[name])
    return cls(**kwargs)


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise _unknown(key)
    node[parts[-1]] = value


# The built-in CPU demo: what `python -m jgrpo.train` runs without a CONFIG.yaml (overrides
# still apply on top). configs/demo.yaml holds the same values, with comments.
DEMO_OVERRIDES = (
    "task.name=addition",
    "task.max_operand=4",  # 25 problems, answers 0-8
    "model.preset=tiny",
    "rollout.prompts_per_step=32",
    "rollout.num_generations=16",
    "rollout.max_new_tokens=4",
    "rollout.max_prompt_length=8",
    "algorithm.beta=0.04",  # KL to the random init keeps the policy exploring
    "optim.lr=1e-3",
    "optim.schedule=cosine",  # the lr decays to 0 by the last step: a stable end
    "train.steps=500",
    "train.eval_every=50",
    "train.save_every=100",
    "train.run_dir=runs/demo",
)


# `smoke` on the command line: a quick CPU check of any recipe with the tiny model initialised
# from scratch (and a character tokenizer), a few rows and two steps.
SMOKE_OVERRIDES = (
    "model.path=null",
    "model.preset=tiny",
    "model.dtype=float32",
    "rollout.prompts_per_step=2",
    "rollout.num_generations=2",
    "rollout.max_new_tokens=8",
    "rollout.max_prompt_length=2048",  # one token per character
    "algorithm.num_minibatches=1",
    "algorithm.grad_accumulation=1",
    "algorithm.max_extra_rollouts=1",
    "mesh.devices=1",
    "task.eval_size=2",
    "task.num_examples=64",
    "task.held_out=0",
    "train.steps=2",
    "train.eval_every=2",
    "train.save_every=2",
    "train.run_dir=runs/smoke",
)


def with_smoke(overrides: Sequence[str]) -> list[str]:
    """The word `smoke` among the overrides becomes SMOKE_OVERRIDES, placed before the others."""
    if "smoke" not in overrides:
        return list(overrides)
    return [*SMOKE_OVERRIDES, *(o for o in overrides if o != "smoke")]


def load_config(path: str | pathlib.Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """The validated Config: defaults, then the YAML file (if any), then each override.

    Each override is a `section.key=value` string whose value is parsed as YAML (`null` is
    None); later ones win. The word `smoke` puts SMOKE_OVERRIDES before the others (a quick
    CPU check of any recipe). The YAML file holds one mapping per section. Raises ConfigError
    naming the key for an unknown key (with the closest valid ones), a wrong type or an
    impossible value.

    Without a path this is the plain defaults, not the demo that `python -m jgrpo.train` runs
    without a YAML file (that one learns sums of 0-4, the defaults' task those of 0-9):
    `demo_config(overrides)` is the CLI's config.
    """
    overrides = with_smoke(overrides)
    tree: dict[str, Any] = {}
    if path is not None:
        tree = _read_yaml(pathlib.Path(path))
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {override!r} must look like section.key=value.")
        if key.strip() not in field_names():
            raise _unknown(key.strip())
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as error:
            raise ConfigError(
                f"override {override!r}: the value is not valid YAML ({_yaml_problem(error)}); "
                f"fix it, or quote a string inside the shell's quotes: \"{key.strip()}='{text}'\"."
            ) from None
        _set_dotted(tree, key.strip(), value)
    return _build(Config, tree, "").check()


def demo_config(overrides: Sequence[str] = ()) -> Config:
    """What `python -m jgrpo.train [overrides]` runs without a YAML file: the defaults, then
    DEMO_OVERRIDES (configs/demo.yaml), then the word `smoke`'s and each of `overrides`.

    Use it from Python to evaluate or resume a run started that way: `load_config(None)` is
    the plain defaults, whose task differs."""
    return load_config(None, [*DEMO_OVERRIDES, *with_smoke(overrides)])


def _read_yaml(path: pathlib.Path) -> dict[str, Any]:
    """The mapping of sections a YAML config file holds; ConfigError naming the file when it
    is a folder, not UTF-8 or not valid YAML (a missing file raises FileNotFoundError)."""
    if path.is_dir():
        raise ConfigError(
            f"{path} is a folder, not a config file; give a YAML file (e.g. configs/demo.yaml)."
        )
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path} is not UTF-8 text (byte {error.start}: {error.reason}); save it as UTF-8."
        ) from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(error)}; fix it.") from None
    if not isinstance(loaded, dict):
        kind = type(loaded).__name__
        raise ConfigError(f"{path} must hold a mapping of sections, got {kind}.")
    return loaded


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's error in one line: the problem and where (line and column, from 1)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    if mark is None:
        return problem
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint).replace("typing.", ""))


def format_help() -> str:
    """Every key with its type, default and description, section by section."""
    lines = []
    for section, cls in _SECTIONS.items():
        lines.append(f"{section}:")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = _type_name(hints[f.name])
            lines.append(
                f"  {section}.{f.name} ({kind}, default {f.default!r}): {f.metadata['help']}"
            )
    return "\n".join(lines)


def _yaml_value(value: Any) -> str:
    """A default as it is written in YAML and overrides: null, true, 1e-06, runs/demo."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def format_markdown() -> str:
    """docs/config.md: every key as a table row per section, and how values are set.

    Written by `python scripts/reference_docs.py`; a test fails when the file is stale.
    """

    def cell(text: str) -> str:  # a table cell: | splits cells, <x> would be an HTML tag
        return text.replace("|", "\\|").replace("<", "\\<")

    out = [
        "# Configuration reference",
        "",
        "<!-- Generated from jgrpo/config.py by `python scripts/reference_docs.py`: edit the "
        "dataclasses there, not this file. -->",
        "",
        "Every key of `python -m jgrpo.train`, with its type, default and description. "
        "The same list, one line per key, is printed by `python -m jgrpo.train --help`.",
        "",
        inspect.cleandoc(Config.__doc__ or ""),
        "",
        "## Setting values",
        "",
        "```bash",
        "python -m jgrpo.train [CONFIG.yaml] [section.key=value ...] [smoke]",
        "python -m jgrpo.train configs/gsm8k-qwen2.5-0.5b.yaml optim.lr=1e-6 train.steps=300",
        "```",
        "",
        "- The YAML file holds one mapping per section (`rollout:` then an indented "
        "`num_generations: 16`); keys left out keep their defaults. configs/ has examples.",
        "- Each `section.key=value` override is parsed as YAML (`null` is None, `true` is a "
        "bool, `1e-6` a float) and applied after the file, in order; the last one wins.",
        "- Without a YAML file the [demo](#the-demo-and-smoke) is the base; your overrides "
        "apply on top of it.",
        "- The word `smoke` inserts the [smoke overrides](#the-demo-and-smoke) before yours: a "
        "quick CPU check of any recipe.",
        "- From Python: `jgrpo.config.load_config(path, overrides)` returns the validated "
        "`Config`. Without a path it starts from the defaults below, not from the demo: "
        "`jgrpo.config.demo_config(overrides)` is what the command line runs without a YAML "
        "file.",
        "- Unknown keys (with the closest valid ones), wrong types and impossible values are "
        "errors that name the key, raised before anything runs.",
        "",
        "Sections: " + ", ".join(f"[`{name}`](#{name})" for name in _SECTIONS) + ".",
    ]
    for section, cls in _SECTIONS.items():
        hints = typing.get_type_hints(cls)
        out += ["", f"## {section}", "", inspect.cleandoc(cls.__doc__ or ""), ""]
        out += ["| key | type | default | description |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            kind, default = _type_name(hints[f.name]), _yaml_value(f.default)
            out.append(
                f"| `{section}.{f.name}` | `{cell(kind)}` | `{cell(default)}` "
                f"| {cell(f.metadata['help'])} |"
            )
    out += [
        "",
        "## The demo and smoke",
        "",
        "Without a YAML file, `python -m jgrpo.train` runs the CPU demo (a tiny model learns "
        "addition from scratch): the defaults above with these overrides "
        "(configs/demo.yaml holds the same values):",
        "",
        "```text",
        *DEMO_OVERRIDES,
        "```",
        "",
        "`smoke` swaps in the tiny model from scratch (with a character tokenizer), a few rows "
        "and two steps:",
        "",
        "```text",
        *SMOKE_OVERRIDES,
        "```",
        "",
    ]
    return "\n".join(out)


def to_dict(config: Config) -> dict[str, Any]:
    """The config as plain nested dicts (for YAML, JSON logs and checkpoints)."""
    return dataclasses.asdict(config)


def changed_settings(saved: dict[str, Any], config: Config) -> list[str]:
    """`key: old -> new` for each setting of `config` that differs from `saved`, a `to_dict`
    tree read back from JSON (a checkpoint's); keys only one side has are left out."""

    def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    old = flat(saved)
    new = flat(json.loads(json.dumps(to_dict(config))))  # tuples as lists, as saved
    return [
        f"{key}: {old[key]!r} -> {new[key]!r}" for key in new if key in old and old[key] != new[key]
    ]


def from_dict(tree: dict[str, Any]) -> Config:
    """The inverse of `to_dict` (e.g. the config stored in a checkpoint), validated."""
    return _build(Config, tree, "").check()
