"""Setup: everything a run builds once from its config, before the first step.

The task and the policy (`jgrpo.loading`), the device mesh, each split's prompt width, the
sampling and update settings, the optimizer, the shardings of every array the loop keeps,
the initial state and the KL reference, and a learned reward model. Its jitted programs
(the rollout, the update, compiled ahead) are `jgrpo.programs.Programs`, which it extends.
`jgrpo.plan` sizes a config's memory from a `Setup` alone; `jgrpo.train.Trainer` adds the
steps.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jgrpo import distributed, tasks
from jgrpo.config import Config, ConfigError
from jgrpo.generation import encode_prompts, stop_token_ids
from jgrpo.loading import build_task, load_policy
from jgrpo.models.group_forward import PackedCompletions
from jgrpo.models.lora import (
    adapter_axes,
    adapter_specs,
    init_adapters,
    merge_adapters,
    with_adapters,
)
from jgrpo.models.precision import with_rounded_weights
from jgrpo.packing import packed_row_counts
from jgrpo.programs import Programs
from jgrpo.rollout import SamplingConfig, kv_cache_bytes
from jgrpo.sharding import (
    make_mesh,
    optimizer_state_shardings,
    replicated,
    row_shardings,
    rules_context,
    tree_shardings,
)
from jgrpo.tools import Environment, ToolEnvironment, tool_format, tool_schemas
from jgrpo.update import Batch, TrainState, UpdateConfig, init_state, make_optimizer

logger = logging.getLogger("jgrpo.train")

# Folded into train.seed's key for the LoRA adapters' initial values: the steps fold in their
# step numbers (0 and up), which never reach it.
ADAPTER_KEY = 2**32 - 1

# Prompt widths round up to this: a new longest prompt by a few tokens keeps its program.
PROMPT_WIDTH_MULTIPLE = 8


def prompt_width(longest: int, max_prompt_length: int) -> int:
    """Columns prompts are left-padded to: the longest prompt (0: none) rounded up to a
    multiple of PROMPT_WIDTH_MULTIPLE, at most max_prompt_length.

    RoPE positions count only real tokens, so leading pad columns that no prompt fills
    change no result; they only cost compute in the prefill, the decode's attention and the
    update."""
    multiple = PROMPT_WIDTH_MULTIPLE
    return min(max_prompt_length, -(-max(longest, 1) // multiple) * multiple)


def shared_prompt_rows(config: Config, *, grad_accumulation: int, batch_shards: int) -> int:
    """G when `algorithm.shared_prompt_forward` is on and every micro-batch holds whole groups
    whose prompts split evenly over the `batch_shards` (mesh data x fsdp), so the update runs
    each prompt once per group; else 1."""
    if not config.algorithm.shared_prompt_forward:
        return 1
    prompts = config.rollout.prompts_per_step
    parts = config.algorithm.num_minibatches * grad_accumulation
    whole_groups = prompts % parts == 0 and (prompts // parts) % batch_shards == 0
    return config.rollout.num_generations if whole_groups else 1


def packing_obstacle(config: Config, *, grad_accumulation: int, batch_shards: int) -> str | None:
    """Why `algorithm.pack_completions` cannot run with these settings, naming the field to
    change, or None when it can: packing works per group, on the shared-prompt update."""
    algo, rollout = config.algorithm, config.rollout
    shared = shared_prompt_rows(
        config, grad_accumulation=grad_accumulation, batch_shards=batch_shards
    )
    if shared > 1:
        return None
    if not algo.shared_prompt_forward:
        return "it needs the shared-prompt update, algorithm.shared_prompt_forward=true"
    return (
        "it needs whole groups in every micro-batch and batch shard: "
        f"rollout.prompts_per_step={rollout.prompts_per_step} divisible by "
        "algorithm.num_minibatches x algorithm.grad_accumulation x mesh data x fsdp = "
        f"{algo.num_minibatches} x {grad_accumulation} x {batch_shards}"
    )


def update_config_of(config: Config, *, beta_in_loss: float, batch_shards: int = 1) -> UpdateConfig:
    """The update's settings: each algorithm setting the update has a field of the same name
    for, and those the rest of the config decides; `batch_shards` is the mesh's data x fsdp
    size."""
    algo = config.algorithm
    same_names = {f.name for f in dataclasses.fields(UpdateConfig)} & {
        f.name for f in dataclasses.fields(algo)
    }
    settings = {name: getattr(algo, name) for name in same_names}
    settings.update(
        beta=beta_in_loss,  # 0 when the KL goes into the reward
        sampler_correction=config.sampler_correction,  # `auto` resolved
        temperature=config.rollout.temperature,
        shared_prompt_rows=shared_prompt_rows(
            config, grad_accumulation=algo.grad_accumulation, batch_shards=batch_shards
        ),
        matmul_dtype=config.model.matmul_dtype,
        keep_logits_mib=config.model.keep_logits_mib,
        lora_scale=None if config.model.lora is None else config.model.lora.scale,
        # dr_grpo divides by the length limit, not by a trimmed batch's width
        max_completion_length=config.rollout.completion_tokens,
    )
    return UpdateConfig(**settings)


def completion_widths(max_new_tokens: int, buckets: int) -> tuple[int, ...]:
    """The completion widths the update may run at (`algorithm.completion_buckets`):
    k / buckets of max_new_tokens for k = 1 ... buckets, each rounded up to a multiple of 8
    (vector lanes) and at most max_new_tokens; ascending, without repeats."""
    widths = set()
    for k in range(1, buckets + 1):
        width = -(-k * max_new_tokens // buckets)  # ceil
        widths.add(min(max_new_tokens, -(-width // 8) * 8))
    return tuple(sorted(widths))


def optimizer_of(config: Config):
    algo, optim = config.algorithm, config.optim
    return make_optimizer(
        optim.lr,
        total_steps=config.train.steps * algo.num_iterations * algo.num_minibatches,
        warmup_steps=optim.warmup_steps,
        schedule=optim.schedule,
        weight_decay=optim.weight_decay,
        max_grad_norm=optim.max_grad_norm,
        b1=optim.b1,
        b2=optim.b2,
        eps=optim.eps,
    )


def decode_slots(config: Config, model_config, mesh, prompt_width: int) -> int:
    """The rollout's `max_concurrent`: rollout.max_concurrent, or with rollout.kv_cache_mib
    the most slots whose completion caches fit in the budget beside the prompts' caches, on
    each device (a multiple of the batch shards; 0, every row at once, when all rows fit).
    ConfigError when not even one slot per device fits."""
    r = config.rollout
    if r.kv_cache_mib is None:
        return r.max_concurrent
    rows = r.prompts_per_step * r.num_generations
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    dtype = config.model.dtype
    with rules_context(mesh):  # one device's share, as the rollout places the caches
        prompts = kv_cache_bytes(r.prompts_per_step, prompt_width, model_config, dtype)
        per_shard_slot = kv_cache_bytes(
            shards, r.completion_tokens, model_config, dtype, completion=True
        )
    budget = int(r.kv_cache_mib * 2**20)
    slots = shards * max(0, (budget - prompts) // per_shard_slot)
    if slots < shards:
        need = (prompts + per_shard_slot) / 2**20
        tokens_setting = f"rollout.{'max_new_tokens' if r.max_turns == 1 else 'max_total_tokens'}"
        raise ConfigError(
            f"rollout.kv_cache_mib={r.kv_cache_mib} holds no completion slot: on each device "
            f"the prompts' caches take {prompts / 2**20:.2f} MiB and one completion of "
            f"{r.completion_tokens} tokens ({tokens_setting}) {per_shard_slot / 2**20:.2f} MiB; "
            f"raise it to at least {need:.2f}, or lower that setting."
        )
    if slots >= rows:
        logger.info(
            "rollout.kv_cache_mib=%g holds all %d sequences of a step: they decode at once",
            r.kv_cache_mib,
            rows,
        )
        return 0
    logger.info(
        "rollout.kv_cache_mib=%g: %d sequences decode at once (of %d a step)",
        r.kv_cache_mib,
        slots,
        rows,
    )
    return slots


class Setup(Programs):
    """What every step shares, built once from the config in this order: the task, the mesh,
    the policy and its tokenizer, the prompt widths, the sampling and update settings, the
    optimizer, the shardings and the update program, a learned reward model."""

    def __init__(self, config: Config, task: tasks.Task | None = None):
        self.config = config
        self.task = task if task is not None else build_task(config)
        self.mesh = self.make_mesh()
        self.model, self.tokenizer = load_policy(config, self.task, self.mesh)
        self.model_config = self.model.config
        self.lora = config.model.lora  # None: full fine-tuning
        if self.lora is not None:
            try:
                adapter_specs(self.model_config, self.lora)
            except ValueError as error:  # targets the model does not have (experts' MLP)
                raise ConfigError(str(error)) from None
        self.check_prompts()
        self.environment = self.episode_environment()  # None: single-turn
        self.tool_schemas = tool_schemas(self.task.tools) if self.task.tools else None
        if self.environment is not None:  # rendered with the tools' schemas, at run time
            width = config.rollout.max_prompt_length
            self.prompt_widths = {"train": width, "eval": width}
            logger.info(
                "multi-turn episodes: prompts are left-padded to rollout.max_prompt_length=%d "
                "columns (the environment's first messages with the tools' schemas)",
                width,
            )
        self.group_size = config.rollout.num_generations
        r = config.rollout
        self.sampling = SamplingConfig(
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            min_p=r.min_p,
            stop_token_ids=stop_token_ids(
                self.tokenizer, self.model_config, getattr(self.model, "source_dir", None)
            ),
            pad_token_id=self.tokenizer.pad_token_id or 0,
            weights_dtype=r.weights_dtype,
            max_concurrent=decode_slots(
                config, self.model_config, self.mesh, self.prompt_widths["train"]
            ),
        )
        if not self.sampling.stop_token_ids:
            raise ConfigError(
                "the tokenizer and the model config define no EOS token, so completions could "
                "never stop; use a checkpoint whose config.json, generation_config.json or "
                "tokenizer sets eos_token_id."
            )
        self.greedy = dataclasses.replace(self.sampling, temperature=0.0, top_p=1.0, top_k=0)
        algo = config.algorithm
        self.completion_widths = completion_widths(r.completion_tokens, algo.completion_buckets)
        self.kl_weight_in_reward = algo.beta if algo.kl_in_reward else 0.0
        batch_shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        self.update_config = update_config_of(
            config,
            beta_in_loss=0.0 if algo.kl_in_reward else algo.beta,
            batch_shards=batch_shards,
        )
        obstacle = packing_obstacle(
            config, grad_accumulation=algo.grad_accumulation, batch_shards=batch_shards
        )
        if algo.pack_completions and obstacle:
            # Packing is a speed option with equal results: settings it cannot run with train
            # the padded batch rather than stopping (as the shared-prompt forward does).
            logger.warning(
                "algorithm.pack_completions is off for this run: %s. The update runs the "
                "padded batch.",
                obstacle,
            )
            algo = dataclasses.replace(algo, pack_completions=False)
            self.config = config = dataclasses.replace(config, algorithm=algo)
        # the update's batch shapes: (completion width, packed rows per group or None)
        packed_rows = packed_row_counts(self.group_size) if algo.pack_completions else (None,)
        self.update_shapes = [(w, rows) for w in self.completion_widths for rows in packed_rows]
        self.optimizer = optimizer_of(config)
        self.setup_shardings()
        if self.lora is not None:
            self.round_lora_base()
        self.reward_model = None  # a ModelReward among the task's reward functions
        if config.reward_model.path is not None:
            self.add_reward_model()

    def episode_environment(self) -> Callable[[], Environment] | None:
        """Multi-turn tasks (tools or an environment): what makes each episode's environment;
        None for single-turn ones. ConfigError when rollout.max_turns does not match."""
        task, turns = self.task, self.config.rollout.max_turns
        multi_turn = bool(task.tools) or task.environment is not None
        if multi_turn and turns < 2:
            raise ConfigError(
                f"task {task.name!r} gives tools or an environment, which answer the model's "
                "turns: set rollout.max_turns >= 2 (e.g. 4)."
            )
        if not multi_turn and turns > 1:
            raise ConfigError(
                f"rollout.max_turns={turns} needs a task with tools or an environment to answer "
                f"the model's turns; task {task.name!r} has neither: set rollout.max_turns=1."
            )
        if not multi_turn:
            return None
        if task.environment is not None:
            return task.environment
        tools, model_type = list(task.tools), self.model_config.model_type
        tool_format(model_type)  # a family without a tool-call parser fails here
        return lambda: ToolEnvironment(
            tools, model_type, timeout_s=self.config.task.reward_timeout_s
        )

    def add_reward_model(self) -> None:
        """The config's reward model as one more reward function of the task, on the mesh."""
        from jgrpo.rewards.model_reward import ModelReward

        rm = self.config.reward_model
        if rm.name in self.task.reward_fns:
            raise ConfigError(
                f"reward_model.name={rm.name!r} is already a reward function of the task "
                f"({', '.join(self.task.reward_fns)}); choose another name."
            )
        scorer = ModelReward(
            rm.path,
            dtype=jnp.dtype(rm.dtype),
            batch_size=rm.batch_size,
            max_length=rm.max_length,
            normalize=rm.normalize,
            scale=rm.scale,
            shift=rm.shift,
            mesh=self.mesh,
        )
        self.task = dataclasses.replace(
            self.task,
            reward_fns={**self.task.reward_fns, rm.name: scorer},
            reward_weights={**self.task.reward_weights, rm.name: rm.weight},
        )
        self.reward_model = scorer

    # --- placement on the mesh ---------------------------------------------------------------

    def make_mesh(self):
        """The device mesh of the config's mesh.* keys, checked against the batch."""
        m = self.config.mesh
        if m.devices != -1 and jax.process_count() > 1:
            raise ConfigError(
                f"mesh.devices={m.devices} with {jax.process_count()} processes: a multi-process "
                "run uses every device of every process; leave mesh.devices at -1."
            )
        devices = jax.devices() if m.devices == -1 else jax.devices()[: m.devices]
        if m.devices > len(devices):
            raise ConfigError(f"mesh.devices={m.devices} but only {len(devices)} exist.")
        mesh = make_mesh(m.shape, devices)
        split = mesh.shape["data"] * mesh.shape["fsdp"]
        prompts = self.config.rollout.prompts_per_step
        if prompts % split:
            raise ConfigError(
                f"rollout.prompts_per_step={prompts} must be divisible by mesh.data x mesh.fsdp "
                f"= {split} (each device samples whole groups of its prompts); change one of "
                "them, or use fewer devices with mesh.devices."
            )
        return mesh

    def setup_shardings(self) -> None:
        """The shardings of every array the loop keeps, and the jitted update with explicit
        in/out shardings (the state donated)."""
        from jgrpo import models

        self.rows, self.row_matrix = row_shardings(self.mesh)  # [B] and [B, T] arrays
        packed = None
        if self.config.algorithm.pack_completions:  # [P * Gb, N] and [B, N], split like rows
            packed = PackedCompletions(self.row_matrix, self.row_matrix)
        self.batch_shardings = Batch(
            self.row_matrix, self.row_matrix, self.row_matrix, self.rows, packed, self.row_matrix
        )
        # The model's parameters (what the rollout reads), and those the optimizer trains:
        # the same, or with LoRA the adapters (the model's are then the frozen base's).
        self.model_shardings = tree_shardings(
            self.model.params(), models.transformer.param_axes(self.model_config), self.mesh
        )
        params = self.trained_shapes()
        self.param_shardings = self.model_shardings
        if self.lora is not None:
            axes = adapter_axes(self.model_config, self.lora)
            self.param_shardings = tree_shardings(params, axes, self.mesh)
        abstract_opt = jax.eval_shape(self.optimizer.init, params)
        self.state_shardings = TrainState(
            params=self.param_shardings,
            opt_state=optimizer_state_shardings(
                self.optimizer, abstract_opt, self.param_shardings, self.mesh
            ),
            step=replicated(self.mesh),
        )
        self.update = self.update_program(self.update_config)
        # (width, packed rows) -> its program
        self._update_compiling: dict[tuple, concurrent.futures.Future] = {}
        self.block = distributed.RowBlock(self.rows)  # the rows this process handles

    def trained_shapes(self) -> dict:
        """ShapeDtypeStructs of the parameters the optimizer trains (`initial_params`)."""
        if self.lora is None:
            return jax.eval_shape(self.model.params)
        draw = functools.partial(init_adapters, self.model_config, self.lora)
        return jax.eval_shape(draw, jax.random.key(0))

    def initial_params(self) -> dict:
        """The parameters the optimizer trains, in their shards: the policy's (where
        `load_policy` put them), or with LoRA fresh adapters (`init_adapters`, B = 0: the
        policy starts as the base), drawn from train.seed."""
        if self.lora is None:
            return jax.device_put(self.model.params(), self.param_shardings)  # a no-op check
        key = jax.random.fold_in(jax.random.key(self.config.train.seed), ADAPTER_KEY)
        draw = functools.partial(init_adapters, self.model_config, self.lora)
        return jax.jit(draw, out_shardings=self.param_shardings)(key)

    def reference_params(self, params: dict) -> dict | None:
        """The frozen reference of the KL penalty, from the initial `params` (None when beta
        is 0): a copy, or with model.reference_dtype=bfloat16 the parameters with their
        weight matrices and embedding table rounded to bf16 once (`with_rounded_weights`:
        half the memory but for the norms and biases; the reference pass multiplies bf16
        operands with f32 sums). A copy either way: the update donates the state's buffers.

        With LoRA (`params` are then the adapters) it is the frozen base, whatever beta: the
        model's own parameters (`round_lora_base`), no copy (nothing donates them); the update
        applies the adapters to it, and it is the KL's reference as it stands."""
        if self.lora is not None:
            return self.model.params()
        if self.config.algorithm.beta <= 0:
            return None
        model = self.config.model
        if model.reference_dtype == "float32" or model.dtype == "bfloat16":  # already as asked
            return jax.tree.map(jnp.copy, params)
        rounded = with_rounded_weights(params, jnp.bfloat16)  # new bf16 leaves, the rest shared
        return jax.tree.map(lambda x: x if x.dtype == jnp.bfloat16 else jnp.copy(x), rounded)

    def round_lora_base(self) -> None:
        """LoRA with model.reference_dtype=bfloat16: the frozen base's weight matrices and
        embeddings rounded to bf16 in place (`with_rounded_weights`), so that only the bf16
        base is kept; the adapters and their optimizer state stay f32."""
        if self.config.model.reference_dtype == "float32" or self.config.model.dtype == "bfloat16":
            return
        with rules_context(self.mesh):
            rounded = jax.jit(
                functools.partial(with_rounded_weights, dtype=jnp.bfloat16),
                out_shardings=self.model_shardings,
            )(self.model.params())
        self.model.load_params(rounded)

    def policy_params(self, params: dict) -> dict:
        """The policy's model parameters, what the rollout and the evaluation sample from:
        `params`, or with LoRA the frozen base with the adapters `params` beside it
        (`with_adapters`: nothing copied). The rollout merges them, W + s A B, into the
        decode layout it makes once per rollout anyway (`decode_layers`), so it decodes with
        the full model's products and holds no merged copy besides that layout."""
        if self.lora is None:
            return params
        return with_adapters(self.model.params(), params, self.lora.scale)

    @functools.cached_property
    def policy_shardings(self):
        """The shardings of `policy_params`' result."""
        if self.lora is None:
            return self.model_shardings
        return with_adapters(self.model_shardings, self.param_shardings, self.lora.scale)

    def merged_params(self, params: dict) -> dict:
        """The policy as one model (LoRA: the base with W + s A B in f32, `merge_adapters`),
        in the model's shardings: what the export writes."""
        if self.lora is None:
            return params
        merge = functools.partial(merge_adapters, scale=self.lora.scale)
        return jax.jit(merge, out_shardings=self.model_shardings)(self.model.params(), params)

    def initial_state(self, params: dict) -> TrainState:
        """Step 0 with the optimizer state created directly in its shards."""
        return jax.jit(
            functools.partial(init_state, optimizer=self.optimizer),
            out_shardings=self.state_shardings,
        )(params)

    def check_prompts(self) -> None:
        """Prompts longer than rollout.max_prompt_length: an error, or dropped (task.on_error);
        then each split's prompt width (`prompt_width` of its longest kept prompt)."""
        from jgrpo.tasks.datasets import check_prompt_lengths

        limit, on_error = self.config.rollout.max_prompt_length, self.config.task.on_error
        self.prompt_widths = {}
        for split in ("train", "eval"):
            examples = getattr(self.task, split)
            prompts = [example["prompt"] for example in examples]
            lengths = [len(tokens) for tokens in encode_prompts(self.tokenizer, prompts)]
            kept = check_prompt_lengths(
                examples,
                self.tokenizer,
                limit,
                on_error=on_error,
                source=f"{self.task.name} {split}",
                lengths=lengths,
            )
            if len(kept) != len(examples):
                setattr(self.task, split, kept)
            kept_lengths = [n for n in lengths if n <= limit]  # aligned with `kept`
            if split == "eval" and self.config.task.eval_size:
                kept_lengths = kept_lengths[: self.config.task.eval_size]  # what evaluate reads
            self.prompt_widths[split] = prompt_width(max(kept_lengths, default=0), limit)
        logger.info(
            "prompts are left-padded to %d columns (train) and %d (eval): the longest prompts "
            "rounded up to a multiple of %d, at most rollout.max_prompt_length=%d",
            self.prompt_widths["train"],
            self.prompt_widths["eval"],
            PROMPT_WIDTH_MULTIPLE,
            limit,
        )

    def meta(self) -> dict:
        """Run state beyond the arrays that a checkpoint keeps: a reward model's statistics,
        and what identifies a LoRA run's frozen base (`lora_base`)."""
        meta = {}
        if self.reward_model is not None:
            meta["reward_model_moments"] = self.reward_model.moments.state()
        if self.lora is not None:
            meta["lora_base"] = self.lora_base
        return meta

    @functools.cached_property
    def lora_base(self) -> dict:
        """LoRA: the frozen base a checkpoint's adapters belong to, as its checkpoints record
        it: model.path (or the preset), and a digest of every base array's checksum (as
        stored, after any bf16 rounding; `jgrpo.checkpoint.checksums`)."""
        from jgrpo.checkpoint import checksums

        sums = checksums(self.model.params())
        digest = hashlib.sha256(json.dumps(sums, sort_keys=True).encode()).hexdigest()
        model = self.config.model
        source = model.path if model.path is not None else f"preset {model.preset}"
        return {"model": source, "digest": digest[:16]}

    def check_lora_base(self, meta: Mapping[str, Any]) -> None:
        """ConfigError when a checkpoint's adapters were trained on another base than the one
        this run loaded (a LoRA checkpoint holds only the adapters)."""
        saved = meta.get("lora_base")
        if self.lora is None or saved is None or saved["digest"] == self.lora_base["digest"]:
            return
        raise ConfigError(
            f"the checkpoint's LoRA adapters were trained on {saved['model']} (base digest "
            f"{saved['digest']}), but this run loads {self.lora_base['model']} (digest "
            f"{self.lora_base['digest']}): set model.path (and model.reference_dtype) to the "
            "base the run started from."
        )

    def load_meta(self, meta: Mapping[str, Any]) -> None:
        """Restores what `meta()` saved (a checkpoint from before a reward model: nothing)."""
        if self.reward_model is not None and "reward_model_moments" in meta:
            self.reward_model.moments.load(meta["reward_model_moments"])

    def frozen_reward_statistics(self):
        """A context in which a reward model's running statistics are read, not updated."""
        if self.reward_model is None:
            return contextlib.nullcontext()
        return self.reward_model.frozen()
