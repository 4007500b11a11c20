"""The GRPO update as one jitted pure function: state and a rollout batch in, new state out.

For one rollout batch of B sequences:
1. old log-probs (when the ratio can move: num_iterations > 1 or several minibatches) and
   reference log-probs (when beta > 0) are computed once, before any parameter changes;
2. num_iterations (mu) passes, each over num_minibatches minibatches in order, one optimizer
   step per minibatch; a minibatch may be split into micro-batches whose gradients are
   accumulated: exactly for "dapo" and "grpo", which normalise by the minibatch's tokens
   and non-empty rows, and for "dr_grpo"; "bnpo" averages its micro-batches' token means.

Log-probs come from final hidden states through `jgrpo.chunked_token_logprobs`, so the
[B, T, V] logits of a training step are never built.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jgrpo.logprobs import chunked_token_logprobs
from jgrpo.losses import (
    SAMPLER_CORRECTION_LEVELS,
    SAMPLER_CORRECTION_MODES,
    grpo_loss,
    high_entropy_mask,
    off_policy_mask,
    sampler_weights,
)
from jgrpo.models.config import ModelConfig
from jgrpo.models.embedding import unembedding
from jgrpo.models.group_forward import (
    PackedCompletions,
    group_completion_hidden,
    packed_head_inputs,
)
from jgrpo.models.lora import with_adapters
from jgrpo.models.mlp import RouterStats, load_balancing_loss
from jgrpo.models.precision import with_matmul_weights
from jgrpo.models.transformer import forward
from jgrpo.sharding import traced_shard_count

# MiB of f32 log-prob logits per device the update keeps for its backward pass (`keeps_logits`).
KEEP_LOGITS_MIB = 512.0


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """Static settings of the update (part of the compiled program).

    `shared_prompt_rows` = G > 1 promises that every G consecutive rows of the batch repeat
    one prompt (prompt-major rows, as `jgrpo.rollout` returns them) and that each
    micro-batch holds whole groups. The layers then run each prompt once for its group and
    its G completions on top (`jgrpo.models.group_forward`): the same log-probs and gradients up to
    float rounding, with about half the tokens when the prompt is as long as the completion.
    The training loop sets it (`algorithm.shared_prompt_forward`, on by default) whenever
    micro-batches and batch shards hold whole groups.

    `max_completion_length` fixes dr_grpo's divisor (the length limit) for batches trimmed to
    their longest completion (`algorithm.completion_buckets`), so the loss does not depend
    on the trim; no other loss type reads it.
    """

    num_iterations: int = 1  # mu: passes over each rollout batch
    num_minibatches: int = 1  # optimizer steps per pass
    grad_accumulation: int = 1  # micro-batches per minibatch
    loss_type: str = "dapo"
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    dual_clip: float | None = None  # A < 0: the policy term stops at -dual_clip x A
    policy_loss: str = "clip"  # or "cispo", "sapo" (grpo_loss)
    cispo_max_ratio: float = 5.0
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    beta: float = 0.0  # KL penalty in the loss; 0 = no reference model
    kl_estimator: str = "k3"
    kl_bias_correction: bool = False  # KL term weighted by the ratio (unbiased gradient)
    top_entropy_quantile: float = 1.0  # policy term on this share of tokens, highest entropy
    off_policy_mask_threshold: float | None = None  # drop A < 0 rows the policy drifted from
    ratio_level: str = "token"
    temperature: float = 1.0  # must equal the sampling temperature
    logprob_chunk_size: int = 4096
    keep_logits_mib: float = KEEP_LOGITS_MIB  # MiB of logits per device kept for the backward
    shared_prompt_rows: int = 1  # G: rows that repeat one prompt; 1 = every row in full
    matmul_dtype: str = "float32"  # "bfloat16": bf16 products, f32 sums (completion_logprobs)
    max_completion_length: int | None = None  # dr_grpo's divisor; None = the batch's width
    sampler_correction: str = "none"  # "token" / "sequence": weight by pi / pi_sampler
    sampler_correction_cap: float = 2.0  # the largest weight
    sampler_correction_mode: str = "truncate"  # "mask": weights outside [floor, cap] are 0
    sampler_correction_floor: float = 0.0  # the smallest weight: raised to it, or masked below
    lora_scale: float | None = None  # LoRA's alpha / r: state.params are adapters on base_params
    router_aux_loss_coef: float = 0.0  # mixture of experts: the load-balancing loss's weight

    def __post_init__(self):
        check_update_settings(self)
        if not isinstance(self.shared_prompt_rows, int) or self.shared_prompt_rows < 1:
            raise ValueError(
                f"shared_prompt_rows must be an int >= 1, got {self.shared_prompt_rows!r}."
            )
        if self.temperature <= 0:
            raise ValueError(
                f"temperature must be > 0 (the sampling temperature), got {self.temperature}."
            )
        if not self.keep_logits_mib >= 0:
            raise ValueError(
                f"keep_logits_mib must be >= 0 (0: always recompute), got {self.keep_logits_mib}."
            )
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise ValueError(
                f"max_completion_length must be >= 1 or None, got {self.max_completion_length}."
            )
        if self.matmul_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"matmul_dtype must be 'float32' or 'bfloat16', got {self.matmul_dtype!r}."
            )
        if self.sampler_correction not in ("none", *SAMPLER_CORRECTION_LEVELS):
            raise ValueError(
                "sampler_correction must be 'none', 'token' or 'sequence', got "
                f"{self.sampler_correction!r}."
            )
        if self.sampler_correction_mode not in SAMPLER_CORRECTION_MODES:
            raise ValueError(
                "sampler_correction_mode must be 'truncate' or 'mask', got "
                f"{self.sampler_correction_mode!r}."
            )
        if self.lora_scale is not None and not self.lora_scale > 0:
            raise ValueError(f"lora_scale must be > 0 or None, got {self.lora_scale}.")

    @property
    def needs_old_logprobs(self) -> bool:
        """With one pass over one minibatch the policy has not moved: old = current."""
        return self.num_iterations > 1 or self.num_minibatches > 1


def check_update_settings(
    settings: Any, *, prefix: str = "", none: str = "None", error: type[ValueError] = ValueError
) -> None:
    """Raises `error` for the first of these update settings that cannot run, naming the field
    and the fix: the schedule's counts, dual_clip, the token and row masks and the sampler
    correction's bounds.

    `settings` is an `UpdateConfig`, or the config's algorithm section, whose fields of the
    same names are read (with `prefix="algorithm."`, `none="null"` and `error=ConfigError`),
    so each rule and its numbers are written once. The fields are named `prefix` + their
    name, and None as `none`.
    """
    p = prefix
    for name in ("num_iterations", "num_minibatches", "grad_accumulation"):
        value = getattr(settings, name)
        if not isinstance(value, int) or value < 1:
            raise error(f"{p}{name} must be an int >= 1, got {value!r}.")
    dual_clip, policy_loss = settings.dual_clip, settings.policy_loss
    if dual_clip is not None and policy_loss != "clip":
        raise error(
            f"{p}dual_clip bounds the clipped policy term, so it needs {p}policy_loss=clip, "
            f"not {policy_loss}; set {p}dual_clip={none}."
        )
    high = settings.clip_eps if settings.clip_eps_high is None else settings.clip_eps_high
    if dual_clip is not None and not dual_clip > 1 + high:
        raise error(
            f"{p}dual_clip must be > 1 + clip_eps_high = {1 + high} (the ratio above which "
            f"negative-advantage tokens stop), got {dual_clip}; set it higher (verl uses 3.0) "
            f"or to {none}."
        )
    threshold = settings.off_policy_mask_threshold
    if threshold is not None and not threshold >= 0:
        raise error(
            f"{p}off_policy_mask_threshold must be >= 0 (a mean log-ratio per token; "
            f"{none} = off), got {threshold}."
        )
    if not 0 < settings.top_entropy_quantile <= 1:
        raise error(
            f"{p}top_entropy_quantile must be in (0, 1] (the share of tokens the policy term "
            f"trains on; 1 = all), got {settings.top_entropy_quantile}."
        )
    if not settings.sampler_correction_cap >= 1:
        raise error(
            f"{p}sampler_correction_cap must be >= 1 (the largest weight), got "
            f"{settings.sampler_correction_cap}."
        )
    if not 0 <= settings.sampler_correction_floor <= 1:
        raise error(
            f"{p}sampler_correction_floor must be in [0, 1] (0 = no lower bound; above 1 it "
            f"would cut the sampler's own tokens), got {settings.sampler_correction_floor}."
        )


class TrainState(NamedTuple):
    """Parameters, optimizer state and step count: the pytree `train_step` takes and returns."""

    params: dict
    opt_state: optax.OptState
    step: jax.Array  # int32: optimizer steps taken


class Batch(NamedTuple):
    """One rollout: B = prompts x generations sequences of prompt (L) + completion (N).

    `packed` (`jgrpo.packing.pack_completions`) runs each group's completions in fewer rows
    than G; it needs `UpdateConfig.shared_prompt_rows` = G. `sampler_logprobs` (the
    rollout's) give the `sampler_gap` metric and, with `UpdateConfig.sampler_correction`,
    the loss's importance weights for a sampler that differs from the policy.
    """

    input_ids: jax.Array  # int32[B, L + N]: left-padded prompt, then completion
    attention_mask: jax.Array  # int32[B, L + N]: real prompt and completion tokens
    completion_mask: jax.Array  # [B, N]: completion tokens that enter the loss
    advantages: jax.Array  # f32[B]
    packed: PackedCompletions | None = None
    sampler_logprobs: jax.Array | None = None  # f32[B, N]: the completions under the sampler


@functools.lru_cache(maxsize=32)
def make_optimizer(
    learning_rate: float,
    *,
    total_steps: int,
    warmup_steps: int = 0,
    schedule: str = "constant",
    weight_decay: float = 0.0,
    max_grad_norm: float | None = 1.0,
    b1: float = 0.9,
    b2: float = 0.99,
    eps: float = 1e-8,
) -> optax.GradientTransformation:
    """AdamW after global-norm clipping, with linear warmup then a constant or cosine lr.

    `total_steps` (optimizer steps in the run) is where the cosine schedule reaches 0; the
    constant schedule ignores it. Equal settings return the same object: the optimizer is a
    static argument of `train_step`, so a new run with the same settings reuses its compiled
    program.
    """
    if learning_rate <= 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate}.")
    if schedule == "cosine" and warmup_steps:
        lr = optax.warmup_cosine_decay_schedule(
            0.0, learning_rate, warmup_steps, max(total_steps, warmup_steps + 1)
        )
    elif schedule == "cosine":  # the first step at the full rate, then down to 0
        lr = optax.cosine_decay_schedule(learning_rate, max(total_steps, 1))
    elif schedule == "constant":
        warmup = optax.linear_schedule(0.0, learning_rate, max(warmup_steps, 1))
        lr = optax.join_schedules([warmup, optax.constant_schedule(learning_rate)], [warmup_steps])
    else:
        raise ValueError(f"schedule must be one of 'constant', 'cosine'; got {schedule!r}.")
    clip = optax.clip_by_global_norm(max_grad_norm) if max_grad_norm else optax.identity()
    adamw = optax.inject_hyperparams(optax.adamw)(
        learning_rate=lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay
    )
    return optax.chain(clip, adamw)


def completion_logprobs(
    params: dict,
    batch: Batch,
    *,
    model_config: ModelConfig,
    temperature: float,
    chunk_size: int,
    shared_prompt_rows: int = 1,
    matmul_dtype: str = "float32",
    keep_logits_mib: float = KEEP_LOGITS_MIB,
    router_stats: bool = False,
) -> tuple:  # (f32[B, N], f32[B, N]), then RouterStats | None with router_stats
    """Log-prob and entropy of every completion token under `params` (no [B, T, V] logits);
    with `router_stats`, a mixture of experts' `RouterStats` over the batch's real tokens too
    (None for a dense model).

    Differentiated, the log-prob head keeps its f32 logits for the backward pass when one
    device's share of them takes at most `keep_logits_mib` MiB (`keeps_logits`; traced under
    a mesh, the rows split over the batch's devices), and recomputes them chunk by chunk
    otherwise (`jgrpo.chunked_token_logprobs`), with the same results to float rounding.

    `shared_prompt_rows` = G > 1 promises that each G consecutive rows repeat one prompt;
    the prompt then runs once per group (`jgrpo.models.group_forward`), with equal results. A
    `batch.packed` packing then runs each group's completions in its packed rows, and the
    log-prob head reads the packed tokens rather than every padded position.

    `matmul_dtype="bfloat16"` is mixed precision: the weight matrices are cast to bf16
    inside the program (`with_matmul_weights`; the parameters, and so their gradients and
    the optimizer state, stay f32), and every matrix product of the layers and the
    unembedding, forward and backward, takes bf16 operands and sums in f32
    (`jgrpo.models.precision.mixed_matmul`). Activations, norms, attention and the softmax
    stay f32.
    """
    if matmul_dtype != "float32":
        params = with_matmul_weights(params, jnp.dtype(matmul_dtype))
    table = unembedding(params)  # [D, V]

    def head(hidden, targets):  # [..., E], int[...] -> (f32[...], f32[...])
        return chunked_token_logprobs(
            hidden,
            table,
            targets,
            temperature=temperature,
            chunk_size=chunk_size,
            softcap=model_config.final_logit_softcapping,
            keep_logits=keeps_logits(
                targets.size, table.shape[1], keep_logits_mib, batch_shards(targets.shape[0])
            ),
        )

    completion_length = batch.completion_mask.shape[1]
    if batch.packed is not None and shared_prompt_rows == 1:
        raise ValueError(
            "a packed batch needs shared_prompt_rows = G > 1 (packing is per group of rows)."
        )
    if batch.packed is not None:  # the head reads the packed tokens, not B x N positions
        hidden, targets, index, stats = packed_head_inputs(
            params,
            batch.input_ids,
            batch.attention_mask,
            batch.packed,
            config=model_config,
            group_size=shared_prompt_rows,
            completion_length=completion_length,
            router_stats=True,
        )  # [M, E], [M], [B, N]
        logprobs, entropy = head(hidden, targets)  # [M] each
        logprobs, entropy = logprobs[index], entropy[index]
    else:
        if shared_prompt_rows > 1:
            predicting, stats = group_completion_hidden(
                params,
                batch.input_ids,
                batch.attention_mask,
                config=model_config,
                group_size=shared_prompt_rows,
                completion_length=completion_length,
                router_stats=True,
            )  # [B, N, E]
        else:
            hidden, stats = forward(
                params,
                batch.input_ids,
                attention_mask=batch.attention_mask,
                config=model_config,
                return_hidden=True,
                return_router_stats=True,
            )  # [B, L + N, E]
            predicting = hidden[:, -completion_length - 1 : -1]  # positions that predict
        logprobs, entropy = head(predicting, batch.input_ids[:, -completion_length:])
    return (logprobs, entropy, stats) if router_stats else (logprobs, entropy)


def routing_metrics(stats: RouterStats, aux_loss: jax.Array) -> dict[str, jax.Array]:
    """A mixture of experts' routing in a micro-batch: the load-balancing loss (k when
    balanced), and the busiest and idlest experts' shares of the assignments relative to an
    even share (1 = even; summed over the layers)."""
    relative = stats.counts / jnp.maximum(stats.counts.mean(), 1e-9)  # [X]
    return {  # logged as moe/aux_loss, ... (`jgrpo.train`)
        "moe_aux_loss": aux_loss,
        "moe_expert_load_max": relative.max(),
        "moe_expert_load_min": relative.min(),
    }


def keeps_logits(tokens: int, vocab: int, budget_mib: float, shards: int = 1) -> bool:
    """Whether one device's share of the f32 logits of `tokens` positions over `vocab` fits in
    `budget_mib` MiB, the positions split over `shards` devices (`batch_shards`)."""
    return math.ceil(tokens / shards) * vocab * 4 <= budget_mib * 2**20


def batch_shards(rows: int) -> int:
    """Over how many devices the mesh being traced under splits `rows` rows of a batch (1
    outside a mesh): the kept log-prob logits are split with their rows, so each device
    holds at most that share of them. (A table split over `tensor` by the rules splits them
    over its vocabulary too; the budget leaves that to spare, since it depends on how the
    table was placed and on the chunk size.)"""
    return traced_shard_count((rows,), ("batch",))


def _split(tree, parts: int):
    """[B, ...] leaves -> [parts, B / parts, ...]."""
    return jax.tree.map(lambda x: x.reshape(parts, x.shape[0] // parts, *x.shape[1:]), tree)


@functools.partial(
    jax.jit,
    static_argnames=("model_config", "update_config", "optimizer"),
    donate_argnames=("state",),
)
def train_step(
    state: TrainState,
    batch: Batch,
    ref_params: dict | None = None,
    base_params: dict | None = None,
    *,
    model_config: ModelConfig,
    update_config: UpdateConfig,
    optimizer: optax.GradientTransformation,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """num_iterations x num_minibatches optimizer steps on one rollout batch.

    Args:
      state: donated: its buffers are reused for the result, so do not read it afterwards.
      batch: B rows; B must split into num_minibatches x grad_accumulation equal parts.
      ref_params: the frozen reference parameters; required when update_config.beta > 0.
        Its weight matrices and embeddings may be bf16 (`jgrpo.models.precision.
        with_rounded_weights(params, jnp.bfloat16)`, what model.reference_dtype=bfloat16
        keeps): half the memory, and the reference pass multiplies bf16 operands with f32
        sums.
      base_params: LoRA (update_config.lora_scale set): the frozen model that the adapters in
        `state.params` (`jgrpo.models.lora.init_adapters`) apply to; the policy is
        `with_adapters(base_params, state.params, lora_scale)`, only the adapters get
        gradients and optimizer steps, and the base is the KL's reference (ref_params must
        be None). Its weight matrices may be bf16 as ref_params' may.
      model_config: static, like update_config and optimizer: a new value compiles anew.

    Returns the new state and metrics, each of shape [num_iterations, num_minibatches] (so
    callers can see, for instance, the ratio move away from 1 in the second pass): `loss`,
    `ratio_mean`, `clip_frac_low`, `clip_frac_high`, `entropy`, `grad_norm`, `lr`,
    `params_norm` (of the trained parameters after that step: the adapters with LoRA) and
    `kl_mean` when beta > 0. With `batch.sampler_logprobs`: `sampler_gap`, the mean
    |old log-prob - sampler log-prob| over the completion tokens; with `sampler_correction`
    too, `sampler_weight_mean` and `sampler_capped_frac` (the share of tokens whose weight
    the cap cut).
    """
    cfg = update_config
    rows = batch.advantages.shape[0]
    if rows % (cfg.num_minibatches * cfg.grad_accumulation):
        raise ValueError(
            f"the batch of {rows} sequences must divide into num_minibatches="
            f"{cfg.num_minibatches} x grad_accumulation={cfg.grad_accumulation} equal parts."
        )
    if (rows // (cfg.num_minibatches * cfg.grad_accumulation)) % cfg.shared_prompt_rows:
        raise ValueError(
            f"shared_prompt_rows={cfg.shared_prompt_rows} must divide the "
            f"{rows // (cfg.num_minibatches * cfg.grad_accumulation)} rows of a micro-batch "
            "(whole groups in each); set it to 1 to run every row in full."
        )
    if cfg.lora_scale is not None:
        if base_params is None or ref_params is not None:
            raise ValueError(
                "LoRA (lora_scale set) needs base_params (the frozen model the adapters apply "
                "to), which is also the KL's reference: pass no ref_params."
            )
        ref_params = base_params
    elif base_params is not None:
        raise ValueError("base_params is for LoRA: set update_config.lora_scale.")
    if cfg.beta > 0 and ref_params is None:
        raise ValueError(f"beta={cfg.beta} > 0 needs ref_params (the frozen initial weights).")
    if cfg.sampler_correction != "none" and batch.sampler_logprobs is None:
        raise ValueError(
            f"sampler_correction={cfg.sampler_correction!r} needs batch.sampler_logprobs (the "
            "rollout's log-probs); pass them or set sampler_correction='none'."
        )

    def policy(params):  # the trained parameters -> the model's parameters
        if cfg.lora_scale is None:
            return params
        return with_adapters(base_params, params, cfg.lora_scale)

    model_logprobs = functools.partial(
        completion_logprobs,
        model_config=model_config,
        temperature=cfg.temperature,
        chunk_size=cfg.logprob_chunk_size,
        shared_prompt_rows=cfg.shared_prompt_rows,
        matmul_dtype=cfg.matmul_dtype,
        keep_logits_mib=cfg.keep_logits_mib,
    )

    def frozen_logprobs(model_params):
        """Log-probs of the whole batch under fixed parameters, one minibatch at a time."""
        parts = _split(batch, cfg.num_minibatches)
        logprobs = jax.lax.map(lambda part: model_logprobs(model_params, part)[0], parts)
        return jax.lax.stop_gradient(logprobs.reshape(rows, -1))

    extras = {}
    if cfg.needs_old_logprobs:
        extras["old_logprobs"] = frozen_logprobs(policy(state.params))
    if cfg.beta > 0:
        extras["ref_logprobs"] = frozen_logprobs(ref_params)

    def loss_fn(params, micro, micro_extras, minibatch_tokens, minibatch_sequences):
        logprobs, entropy, router_stats = model_logprobs(policy(params), micro, router_stats=True)
        old = micro_extras.get("old_logprobs", jax.lax.stop_gradient(logprobs))
        weights, sampler_metrics = None, {}
        if micro.sampler_logprobs is not None:
            weights, sampler_metrics = _sampler_terms(
                old, micro.sampler_logprobs, micro.completion_mask, cfg
            )
        policy_mask = None
        if cfg.top_entropy_quantile < 1:  # over this micro-batch's tokens, as TRL's forward batch
            policy_mask = high_entropy_mask(
                entropy, micro.completion_mask, quantile=cfg.top_entropy_quantile
            )
        off_policy_metrics = {}
        if cfg.off_policy_mask_threshold is not None:
            sampled = old if micro.sampler_logprobs is None else micro.sampler_logprobs
            kept_rows = off_policy_mask(
                micro.advantages,
                logprobs,
                sampled,
                micro.completion_mask,
                threshold=cfg.off_policy_mask_threshold,
            )  # [B, N]
            policy_mask = kept_rows if policy_mask is None else policy_mask * kept_rows
            nonempty = micro.completion_mask.any(axis=-1)  # [B]
            dropped = nonempty & (kept_rows[:, 0] == 0)
            off_policy_metrics["off_policy_masked_frac"] = dropped.sum() / jnp.maximum(
                nonempty.sum(), 1
            )
        loss, metrics = grpo_loss(
            logprobs,
            old,
            micro.advantages,
            micro.completion_mask,
            ref_logprobs=micro_extras.get("ref_logprobs"),
            loss_type=cfg.loss_type,
            clip_eps=cfg.clip_eps,
            clip_eps_high=cfg.clip_eps_high,
            dual_clip=cfg.dual_clip,
            policy_loss=cfg.policy_loss,
            cispo_max_ratio=cfg.cispo_max_ratio,
            sapo_temperature_pos=cfg.sapo_temperature_pos,
            sapo_temperature_neg=cfg.sapo_temperature_neg,
            beta=cfg.beta,
            kl_estimator=cfg.kl_estimator,
            kl_bias_correction=cfg.kl_bias_correction,
            ratio_level=cfg.ratio_level,
            total_tokens=minibatch_tokens,
            total_sequences=minibatch_sequences,
            max_completion_length=cfg.max_completion_length,
            sampler_weights=weights,
            policy_mask=policy_mask,
        )
        metrics.update(sampler_metrics)
        metrics.update(off_policy_metrics)
        mask = micro.completion_mask.astype(jnp.float32)
        metrics["entropy"] = (entropy * mask).sum() / jnp.maximum(mask.sum(), 1.0)
        if router_stats is not None:  # a mixture of experts
            aux = load_balancing_loss(router_stats)
            metrics.update(routing_metrics(router_stats, aux))
            if cfg.router_aux_loss_coef:
                # dapo's and grpo's micro-batch losses are summed over the minibatch, the
                # others averaged: the auxiliary loss is averaged either way
                summed = cfg.loss_type in ("dapo", "grpo")
                loss = loss + cfg.router_aux_loss_coef * aux / (
                    cfg.grad_accumulation if summed else 1
                )
        metrics["loss"] = loss
        return loss, metrics

    def minibatch_step(state, minibatch):
        data, minibatch_extras = minibatch
        tokens = data.completion_mask.sum()
        sequences = data.completion_mask.any(axis=-1).sum()  # non-empty rows: grpo's divisor
        micros = _split((data, minibatch_extras), cfg.grad_accumulation)

        def accumulate(grads, micro):
            micro_data, micro_extras = micro
            (_, metrics), micro_grads = jax.value_and_grad(loss_fn, has_aux=True)(
                state.params, micro_data, micro_extras, tokens, sequences
            )
            return jax.tree.map(jnp.add, grads, micro_grads), metrics

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        grads, metrics = jax.lax.scan(accumulate, zeros, micros)
        # dapo's and grpo's micro-batch losses already sum to the minibatch's; the others average.
        summed = cfg.loss_type in ("dapo", "grpo")
        if not summed:
            grads = jax.tree.map(lambda g: g / cfg.grad_accumulation, grads)
        metrics = jax.tree.map(jnp.mean, metrics)
        metrics["loss"] = metrics["loss"] * (cfg.grad_accumulation if summed else 1)
        metrics["grad_norm"] = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        lr = optax.tree_utils.tree_get(  # the injected value, when the optimizer has one
            opt_state, "learning_rate", filtering=lambda _, value: isinstance(value, jax.Array)
        )
        if lr is not None:
            metrics["lr"] = lr
        params = optax.apply_updates(state.params, updates)
        # The updated weights' L2 norm (in f32: inf once any |weight| passes ~1.8e19), so the
        # loop can refuse weights that diverged before it saves them.
        metrics["params_norm"] = optax.tree.norm(optax.tree.cast(params, jnp.float32))
        return TrainState(params, opt_state, state.step + 1), metrics

    minibatches = _split((batch, extras), cfg.num_minibatches)

    def one_pass(state, _):
        return jax.lax.scan(minibatch_step, state, minibatches)

    return jax.lax.scan(one_pass, state, None, length=cfg.num_iterations)


def _sampler_terms(
    old_logprobs: jax.Array,  # f32[B, N] the policy's before the update
    sampler_logprobs: jax.Array,  # f32[B, N] the rollout's
    completion_mask: jax.Array,  # [B, N]
    cfg: UpdateConfig,
) -> tuple[jax.Array | None, dict[str, jax.Array]]:
    """The loss's sampler weights (None without a correction) and the sampler metrics."""
    on = completion_mask.astype(bool)
    tokens = jnp.maximum(on.sum(), 1).astype(jnp.float32)
    gap = jnp.where(on, jnp.abs(old_logprobs - sampler_logprobs.astype(jnp.float32)), 0.0)
    metrics = {"sampler_gap": gap.sum() / tokens}
    if cfg.sampler_correction == "none":
        return None, jax.lax.stop_gradient(metrics)
    weigh = functools.partial(
        sampler_weights,
        old_logprobs,
        sampler_logprobs,
        completion_mask,
        level=cfg.sampler_correction,
    )
    weights = weigh(
        cap=cfg.sampler_correction_cap,
        mode=cfg.sampler_correction_mode,
        floor=cfg.sampler_correction_floor,
    )  # [B, N]
    ratios = weigh(cap=jnp.inf)  # [B, N], unbounded
    cut = on & (weights != ratios)  # capped, raised to the floor, or masked
    metrics["sampler_weight_mean"] = weights.sum() / tokens
    metrics["sampler_capped_frac"] = cut.sum() / tokens
    return weights, jax.lax.stop_gradient(metrics)


def init_state(params: dict, optimizer: optax.GradientTransformation) -> TrainState:
    """Step 0: the parameters and a fresh optimizer state."""
    step = jnp.zeros((), jnp.int32)
    return TrainState(params=params, opt_state=optimizer.init(params), step=step)
