"""`python -m jgrpo.train [CONFIG.yaml] [key=value ...]`: GRPO from a config, stage by stage.

Each step:
1. take the next prompts of the task (order fixed by the seed; the position is checkpointed);
2. rollout: G completions per prompt (`jgrpo.sampling.rollout`);
3. rewards: decode, call the task's reward functions (`jgrpo.rewards.score_completions`),
   add the optional overlong penalty and KL-in-reward term; with dynamic sampling, groups
   whose rewards are all equal are replaced by new prompts;
4. advantages within each group (`jgrpo.group_advantages`);
5. update: `jgrpo.train_step` (mu passes x minibatches, one jitted program, donated state);
6. metrics; every N steps an evaluation and a checkpoint.

Rerunning the same command with the same `train.run_dir` resumes from the newest intact
checkpoint; SIGTERM (TPU preemption) or Ctrl-C saves one and exits 0 (a second Ctrl-C exits at
once); a second run on a `train.run_dir` in use is refused. With no arguments the CPU demo runs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import pathlib
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo import distributed, tasks
from jgrpo.advantages import group_advantages
from jgrpo.checkpoint import CheckpointDamaged, Checkpointer
from jgrpo.config import (
    DEMO_OVERRIDES,
    SMOKE_OVERRIDES,
    Config,
    ConfigError,
    TaskSection,
    changed_settings,
    demo_config,
    format_help,
    load_config,
    to_dict,
)
from jgrpo.generation import encode_prompts, pad_prompts, stop_token_ids
from jgrpo.huge_pages import reexec_with_huge_pages
from jgrpo.losses import sequence_kl
from jgrpo.metrics import MetricsWriter, ProgressBar
from jgrpo.models.group_forward import PackedCompletions
from jgrpo.models.transformer import with_rounded_weights
from jgrpo.packing import completion_lengths, pack_completions, packed_row_counts, rows_needed
from jgrpo.plan import check_memory
from jgrpo.rewards import Scores, score_completions
from jgrpo.rewards.pool import VerifierPool
from jgrpo.rewards.registry import RewardSpecError
from jgrpo.sampling import Rollout, SamplingConfig, rollout
from jgrpo.sharding import (
    abstract_arrays,
    make_mesh,
    optimizer_state_shardings,
    replicated,
    row_shardings,
    rules_context,
    tree_shardings,
)
from jgrpo.tasks.datasets import DatasetError
from jgrpo.update import (
    Batch,
    TrainState,
    UpdateConfig,
    completion_logprobs,
    init_state,
    make_optimizer,
    train_step,
)

logger = logging.getLogger("jgrpo.train")

# Prompt widths round up to this: a new longest prompt by a few tokens keeps its program.
PROMPT_WIDTH_MULTIPLE = 8


class TrainingDiverged(RuntimeError):
    """The loss, the gradients or the updated weights stopped being finite; nothing was saved
    after that."""


class RunDirInUse(RuntimeError):
    """Another run holds `train.run_dir`: two runs there would interleave their checkpoints
    and metrics."""


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    steps_done: int
    run_dir: pathlib.Path
    stopped_by_signal: bool = False


# --- Setup -------------------------------------------------------------------------------


def use_compilation_cache(directory: str | None) -> None:
    """Points JAX's persistent compilation cache at `directory` (`train.compilation_cache`),
    so a later run of the same config reads its compiled programs back instead of compiling.

    A cache the user already chose (JAX_COMPILATION_CACHE_DIR or jax.config) is kept. JAX
    decides whether to use a cache at the process's first compilation, so this is called
    before anything compiles.

    Not on several CPU devices (`--xla_force_host_platform_device_count`): with jaxlib 0.10.2,
    a sharded rollout read back from the cache deadlocked in 5 of 10 runs, its devices
    waiting at two different all-gathers (one inside the prefill's layer loop, one outside
    it that does not depend on it); compiled afresh it never did (docs/troubleshooting.md).
    A cache the user chose is kept there too, with a warning.
    """
    chosen = jax.config.jax_compilation_cache_dir
    cpu_devices = jax.device_count() if jax.default_backend() == "cpu" else 1
    if chosen and cpu_devices > 1:
        logger.warning(
            "The JAX compilation cache %s serves programs on %d CPU devices: XLA:CPU "
            "programs with collectives read back from it can deadlock; if the run hangs, "
            "unset JAX_COMPILATION_CACHE_DIR (docs/troubleshooting.md).",
            chosen,
            cpu_devices,
        )
    if chosen or directory is None:
        return
    if cpu_devices > 1:
        logger.warning(
            "train.compilation_cache is not used on %d CPU devices: XLA:CPU programs with "
            "collectives read back from the cache can deadlock (docs/troubleshooting.md).",
            cpu_devices,
        )
        return
    if "://" not in directory:  # gs:// and other remote paths pass through
        directory = str(pathlib.Path(directory).expanduser())
    jax.config.update("jax_compilation_cache_dir", directory)


def load_policy(config: Config, task: tasks.Task, mesh=None):
    """The policy model and its tokenizer: an HF checkpoint, or a preset initialised at random.

    With a mesh, every parameter goes straight to its shards (by `jgrpo.sharding`'s rules):
    checkpoint tensors from host memory, a preset's initial values from a jitted init.
    """
    from flax import nnx

    from jgrpo import models

    dtype = jnp.dtype(config.model.dtype)

    def shardings_for(model_config):
        if mesh is None:
            return None
        shapes = jax.eval_shape(
            lambda: models.Transformer(model_config, rngs=nnx.Rngs(0), param_dtype=dtype).params()
        )
        return tree_shardings(shapes, models.transformer.param_axes(model_config), mesh)

    if config.model.path is not None:
        from transformers import AutoTokenizer

        shardings = shardings_for(models.hf.read_config(config.model.path))
        model = models.from_pretrained(config.model.path, dtype=dtype, shardings=shardings)
        tokenizer = AutoTokenizer.from_pretrained(models.hf.resolve(config.model.path))
    else:
        from jgrpo.tasks.arithmetic import text_tokenizer

        # A model from scratch uses the task's tokenizer, else one token per character.
        tokenizer = task.tokenizer if task.tokenizer is not None else text_tokenizer()
        model_config = models.preset(config.model.preset).replace(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )

        def initial():
            seed = config.train.seed
            return models.Transformer(model_config, rngs=nnx.Rngs(seed), param_dtype=dtype)

        # Shapes first, then the values computed in place by one jitted program.
        model = nnx.eval_shape(initial)
        model.load_params(
            jax.jit(lambda: initial().params(), out_shardings=shardings_for(model_config))()
        )
    if config.model.remat:
        model.config = model.config.replace(remat=True)
    return model, tokenizer


def build_task(config: Config) -> tasks.Task:
    """The task the config names, with `task.rewards` replacing its rewards when set."""
    t, seed = config.task, config.train.seed
    if t.name == "addition":
        from jgrpo.tasks.arithmetic import addition_task

        task = addition_task(t.max_operand, held_out=t.held_out, seed=seed, chat=t.chat)
    elif t.name == "json_extraction":
        from jgrpo.tasks.json_extraction import json_extraction_task

        task = json_extraction_task(t.num_examples, held_out=t.held_out, seed=seed, chat=t.chat)
    elif t.name == "gsm8k":
        from jgrpo.tasks.gsm8k import DEFAULT_SYSTEM, gsm8k_task

        task = gsm8k_task(
            data_dir=t.data_dir,
            split=t.split,
            eval_split=t.eval_split,
            system_prompt=DEFAULT_SYSTEM if t.system_prompt is None else t.system_prompt,
            source="tfds" if t.path is None else "jsonl",
            path=t.path,
            on_error=t.on_error,
        )
    else:  # your own data: a JSONL file or a TFDS dataset, scored by built-in rewards
        from jgrpo.tasks.datasets import jsonl_task, tfds_task

        options = dict(
            rewards=t.rewards,
            prompt_field=t.prompt_field,
            held_out=t.held_out,
            seed=seed,
            on_error=t.on_error,
            chat=t.chat,
            system_prompt=t.system_prompt,
        )
        if t.name == "jsonl":
            task = jsonl_task(t.path, eval_path=t.eval_path, **options)
        else:
            task = tfds_task(
                t.dataset,
                split=t.split,
                eval_split=t.eval_split,
                data_dir=t.data_dir,
                **options,
            )
    if t.rewards is not None and t.name not in ("jsonl", "tfds"):
        from jgrpo.rewards.registry import parse_reward_spec

        task.reward_fns, task.reward_weights = parse_reward_spec(t.rewards)
        if task.correctness not in task.reward_fns:
            task.correctness = next(iter(task.reward_fns))
    return task


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
        # dr_grpo divides by the length limit, not by a trimmed batch's width
        max_completion_length=config.rollout.max_new_tokens,
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


# --- Stages 1-3: prompts, rollout, rewards -------------------------------------------------


def prompt_width(longest: int, max_prompt_length: int) -> int:
    """Columns prompts are left-padded to: the longest prompt (0: none) rounded up to a
    multiple of PROMPT_WIDTH_MULTIPLE, at most max_prompt_length.

    RoPE positions count only real tokens, so leading pad columns that no prompt fills
    change no result; they only cost compute in the prefill, the decode's attention and the
    update."""
    multiple = PROMPT_WIDTH_MULTIPLE
    return min(max_prompt_length, -(-max(longest, 1) // multiple) * multiple)


def encode_examples(
    tokenizer, examples: Sequence[Mapping[str, Any]], width: int, max_prompt_length: int
) -> tuple[np.ndarray, np.ndarray]:  # (int32[P, width], int32[P, width])
    """Left-pads prompts to exactly `width` columns (static shapes for the whole run)."""
    token_lists = encode_prompts(tokenizer, [example["prompt"] for example in examples])
    for example, tokens in zip(examples, token_lists, strict=True):
        if len(tokens) > max_prompt_length:
            raise ValueError(
                f"prompt {example['prompt']!r} is {len(tokens)} tokens, more than "
                f"rollout.max_prompt_length={max_prompt_length}; raise it (nothing is truncated)."
            )
        if len(tokens) > width:
            raise ValueError(
                f"prompt {example['prompt']!r} is {len(tokens)} tokens, more than the {width} "
                "columns this Trainer pads prompts to (the longest prompt of the task's data "
                "when it was built); build the Trainer after changing the task's examples."
            )
    return pad_prompts(token_lists, buckets=(width,))


def decode_completions(
    tokenizer, tokens: np.ndarray, lengths: np.ndarray, truncated: np.ndarray
) -> list[str]:
    """Text of each completion without its final stop token.

    Other special tokens stay visible (not skipped as TRL does), so a policy cannot satisfy
    a text verifier by emitting tokens that decode to nothing.
    """
    ends = lengths - (~truncated).astype(lengths.dtype)  # drop the stop token
    return [
        tokenizer.decode(tokens[row, : ends[row]], skip_special_tokens=False)
        for row in range(tokens.shape[0])
    ]


def as_completion(prompt: Any, text: str) -> Any:
    """TRL's convention: chat prompts get chat completions, text prompts get text."""
    return text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]


@dataclasses.dataclass
class Groups:
    """Rows of sampled groups with their rewards: host arrays of this process's rows (all
    P * G with one process), prompt-major."""

    prompt_ids: np.ndarray  # int32[R, L]
    prompt_mask: np.ndarray  # int32[R, L]
    tokens: np.ndarray  # int32[R, N]
    mask: np.ndarray  # bool[R, N]
    sampler_logprobs: np.ndarray  # f32[R, N]: Rollout.sampler_logprobs, 0 where masked
    lengths: np.ndarray  # int32[R]
    truncated: np.ndarray  # bool[R]
    rewards: np.ndarray  # f32[R]: weighted sum + penalties
    valid: np.ndarray  # bool[R]
    per_function: dict[str, np.ndarray]  # name -> f32[R] (NaN where not scored)
    texts: list[str]
    prompts: list[Any]

    def select_groups(self, groups: Sequence[int], group_size: int) -> Groups:
        """The rows of the given groups, in that order."""
        rows = np.concatenate([np.arange(g * group_size, (g + 1) * group_size) for g in groups])
        return Groups(**{name: _take(value, rows) for name, value in vars(self).items()})

    @staticmethod
    def concatenate(parts: Sequence[Groups]) -> Groups:
        names = vars(parts[0])
        return Groups(**{name: _join([vars(p)[name] for p in parts]) for name in names})


def _take(field, rows: np.ndarray):
    """Rows of one Groups field: an array, a dict of arrays or a list."""
    if isinstance(field, dict):
        return {key: value[rows] for key, value in field.items()}
    if isinstance(field, list):
        return [field[row] for row in rows]
    return field[rows]


def _join(fields: list):
    """One Groups field of several parts, stacked along the rows."""
    if isinstance(fields[0], dict):
        return {key: np.concatenate([f[key] for f in fields]) for key in fields[0]}
    if isinstance(fields[0], list):
        return [item for f in fields for item in f]
    return np.concatenate(fields)


def zero_signal(rewards: np.ndarray, valid: np.ndarray, group_size: int) -> np.ndarray:
    """bool[groups]: groups whose valid rewards are all equal (advantage 0, no gradient)."""
    rewards = rewards.reshape(-1, group_size)
    valid = valid.reshape(-1, group_size)
    high = np.where(valid, rewards, -np.inf).max(axis=1)
    low = np.where(valid, rewards, np.inf).min(axis=1)
    return ~(high > low)


def overlong_penalty(lengths: np.ndarray, limit: int, buffer: int, factor: float) -> np.ndarray:
    """DAPO's soft penalty: 0 up to limit - buffer tokens, then linear down to -factor."""
    if buffer == 0:
        return np.zeros(lengths.shape, np.float32)
    excess = np.clip(lengths - (limit - buffer), 0, buffer)
    return (-factor * excess / buffer).astype(np.float32)


class Trainer:
    """Holds what the steps share (task, tokenizer, compiled settings); the loop is `run`."""

    def __init__(self, config: Config, task: tasks.Task | None = None):
        self.config = config
        self.task = task if task is not None else build_task(config)
        self.mesh = self.make_mesh()
        self.model, self.tokenizer = load_policy(config, self.task, self.mesh)
        self.model_config = self.model.config
        self.check_prompts()
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
        )
        if not self.sampling.stop_token_ids:
            raise ConfigError(
                "the tokenizer and the model config define no EOS token, so completions could "
                "never stop; use a checkpoint whose config.json, generation_config.json or "
                "tokenizer sets eos_token_id."
            )
        self.greedy = dataclasses.replace(self.sampling, temperature=0.0, top_p=1.0, top_k=0)
        algo = config.algorithm
        self.completion_widths = completion_widths(r.max_new_tokens, algo.completion_buckets)
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
        self.reward_model = None  # a ModelReward among the task's reward functions
        if config.reward_model.path is not None:
            self.add_reward_model()
        workers, timeout = config.task.reward_workers, config.task.reward_timeout_s
        self.reward_pool = VerifierPool(workers, timeout) if workers else None

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
        params = self.model.params()
        self.param_shardings = tree_shardings(
            params, models.transformer.param_axes(self.model_config), self.mesh
        )
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

    def update_program(self, update_config: UpdateConfig) -> Callable:
        """`jgrpo.train_step` jitted with explicit in/out shardings, the state donated."""
        key = ("update", self.mesh, self.model_config, self.config.model.dtype, update_config)
        key += (self.config.algorithm.pack_completions,)  # the batch's shardings differ
        return _shared_program((*key, self.optimizer), lambda: self._jit_update(update_config))

    def _jit_update(self, update_config: UpdateConfig) -> Callable:
        uses_ref = update_config.beta > 0
        return jax.jit(
            functools.partial(
                train_step.__wrapped__,
                model_config=self.model_config,
                update_config=update_config,
                optimizer=self.optimizer,
            ),
            in_shardings=(
                self.state_shardings,
                self.batch_shardings,
                self.param_shardings if uses_ref else None,  # the reference's too
            ),
            out_shardings=(self.state_shardings, replicated(self.mesh)),
            donate_argnums=0,
        )

    def update_arguments(
        self, width: int | None = None, packed_rows: int | None = None
    ) -> tuple[TrainState, Batch, dict | None]:
        """The update's arguments as ShapeDtypeStructs with their shardings: the state, the
        batch `to_batch` makes (`batch_arguments`) and the reference parameters (None when
        beta is 0)."""
        params = abstract_arrays(jax.eval_shape(self.model.params), self.param_shardings)
        opt_state = abstract_arrays(
            jax.eval_shape(self.optimizer.init, params), self.state_shardings.opt_state
        )
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.state_shardings.step)
        reference = self.reference_arguments() if self.update_config.beta > 0 else None
        batch = self.batch_arguments(width, packed_rows)
        return TrainState(params, opt_state, step), batch, reference

    def batch_arguments(self, width: int | None = None, packed_rows: int | None = None) -> Batch:
        """The batch `to_batch` makes as ShapeDtypeStructs: prompts_per_step x G rows of
        the train prompts' width + `width` tokens (None: max_new_tokens), packed into
        `packed_rows` per group with `algorithm.pack_completions` (None: G)."""
        r = self.config.rollout
        width = r.max_new_tokens if width is None else width
        prompts, rows = r.prompts_per_step, r.prompts_per_step * r.num_generations
        tokens = self.prompt_widths["train"] + width
        packed = None
        if self.config.algorithm.pack_completions:
            packed_rows = self.group_size if packed_rows is None else packed_rows
            packed = PackedCompletions(
                source=jax.ShapeDtypeStruct((prompts * packed_rows, width), jnp.int32),
                predictor=jax.ShapeDtypeStruct((rows, width), jnp.int32),
            )
        return abstract_arrays(
            Batch(
                input_ids=jax.ShapeDtypeStruct((rows, tokens), jnp.int32),
                attention_mask=jax.ShapeDtypeStruct((rows, tokens), jnp.int32),
                completion_mask=jax.ShapeDtypeStruct((rows, width), jnp.bool_),
                advantages=jax.ShapeDtypeStruct((rows,), jnp.float32),
                packed=packed,
                sampler_logprobs=jax.ShapeDtypeStruct((rows, width), jnp.float32),
            ),
            self.batch_shardings,
        )

    def compile_update_ahead(self) -> None:
        """Starts compiling the update in a background thread, for every completion width
        (`algorithm.completion_buckets`) and packed row count (`algorithm.pack_completions`),
        the widest and most rows first.

        XLA compiles without holding the GIL, so the update compiles while the first rollout
        compiles and samples (on an accelerator, while the device works). The programs land
        in jit's cache: a step waits for its width's program and its call compiles nothing.
        """
        if self._update_compiling:
            return

        state, _, reference = self.update_arguments()

        def compile_update(width: int, packed_rows: int | None) -> jax.stages.Compiled:
            batch = self.batch_arguments(width, packed_rows)
            with rules_context(self.mesh):  # its rules are per thread
                return self.update.lower(state, batch, reference).compile()

        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jgrpo-compile")
        for shape in reversed(self.update_shapes):  # ascending: the largest first
            self._update_compiling[shape] = pool.submit(compile_update, *shape)
        pool.shutdown(wait=False)  # the thread ends with its tasks

    def compiled_update(
        self, width: int | None = None, packed_rows: int | None = None
    ) -> jax.stages.Compiled:
        """The update compiled for this run's batch of `width` completion columns (None:
        max_new_tokens) and `packed_rows` per group (None: G, or no packing): waits for
        `compile_update_ahead` (started here if it was not) and raises what its compilation
        raised."""
        self.compile_update_ahead()
        width = self.config.rollout.max_new_tokens if width is None else width
        if self.config.algorithm.pack_completions and packed_rows is None:
            packed_rows = self.group_size
        return self._update_compiling[width, packed_rows].result()

    def rollout_program(self, sampling: SamplingConfig, num_generations: int) -> Callable:
        """`jgrpo.sampling.rollout` jitted with the prompts split over the batch axes."""
        key = ("rollout", self.mesh, self.model_config, self.config.model.dtype)
        return _shared_program(
            (*key, sampling, num_generations), lambda: self._jit_rollout(sampling, num_generations)
        )

    def _jit_rollout(self, sampling: SamplingConfig, num_generations: int) -> Callable:
        return jax.jit(
            functools.partial(
                rollout.__wrapped__,
                model_config=self.model_config,
                num_generations=num_generations,
                sampling=sampling,
            ),
            in_shardings=(
                self.param_shardings,
                self.row_matrix,
                self.row_matrix,
                replicated(self.mesh),
            ),
            out_shardings=Rollout(*(self.row_matrix,) * 4, *(self.rows,) * 3),
        )

    def initial_params(self) -> dict:
        """The policy's parameters, in their shards (where `load_policy` put them)."""
        return jax.device_put(self.model.params(), self.param_shardings)  # a no-op check

    def reference_params(self, params: dict) -> dict | None:
        """The frozen reference of the KL penalty, from the initial `params` (None when beta
        is 0): a copy, or with model.reference_dtype=bfloat16 the parameters with their
        weight matrices and embedding table rounded to bf16 once (`with_rounded_weights`:
        half the memory but for the norms and biases; the reference pass multiplies bf16
        operands with f32 sums). A copy either way: the update donates the state's buffers."""
        if self.config.algorithm.beta <= 0:
            return None
        model = self.config.model
        if model.reference_dtype == "float32" or model.dtype == "bfloat16":  # already as asked
            return jax.tree.map(jnp.copy, params)
        rounded = with_rounded_weights(params, jnp.bfloat16)  # new bf16 leaves, the rest shared
        return jax.tree.map(lambda x: x if x.dtype == jnp.bfloat16 else jnp.copy(x), rounded)

    @functools.cached_property
    def synced_reference(self) -> Callable[[dict, dict], dict]:
        """(reference, params) -> alpha x params + (1 - alpha) x reference, summed in f32 and
        kept in each reference leaf's dtype (algorithm.ref_sync_alpha); the old reference's
        buffers are donated."""
        alpha = self.config.algorithm.ref_sync_alpha

        def mix(reference, params):
            return jax.tree.map(
                lambda ref, new: (
                    alpha * new.astype(jnp.float32) + (1 - alpha) * ref.astype(jnp.float32)
                ).astype(ref.dtype),
                reference,
                params,
            )

        return jax.jit(mix, donate_argnums=0)

    def reference_arguments(self) -> dict | None:
        """`reference_params`' result as ShapeDtypeStructs in the parameters' shardings
        (None when beta is 0; the reference exists with `kl_in_reward` too, which the update
        does not take)."""
        params = abstract_arrays(jax.eval_shape(self.model.params), self.param_shardings)
        reference = jax.eval_shape(self.reference_params, params)
        return None if reference is None else abstract_arrays(reference, self.param_shardings)

    def initial_state(self, params: dict) -> TrainState:
        """Step 0 with the optimizer state created directly in its shards."""
        return jax.jit(
            functools.partial(init_state, optimizer=self.optimizer),
            out_shardings=self.state_shardings,
        )(params)

    def sample(self, params, prompt_ids, prompt_mask, key, sampling, num_generations) -> Rollout:
        """G completions of each prompt, sampled on the mesh: this process's prompts in, its
        rows of the result out (host arrays)."""
        prompt_ids = self.block.to_global(prompt_ids, self.row_matrix)
        prompt_mask = self.block.to_global(prompt_mask, self.row_matrix)
        with rules_context(self.mesh):
            result = self.rollout_program(sampling, num_generations)(
                params, prompt_ids, prompt_mask, key
            )
        return jax.tree.map(self.block.local, result)

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

    # Stage 2 and 3 for one batch of prompts.
    def sample_and_score(self, params, ref_params, examples, key) -> tuple[Groups, dict]:
        """Rollout and rewards of this process's share of `examples` (all of them with one
        process); the Groups hold only those rows."""
        c, g = self.config, self.group_size
        timings = {}
        start = time.perf_counter()
        examples = self.block.take(examples)
        prompt_ids, prompt_mask = encode_examples(
            self.tokenizer, examples, self.prompt_widths["train"], c.rollout.max_prompt_length
        )
        host = self.sample(params, prompt_ids, prompt_mask, key, self.sampling, g)
        timings["time/rollout"] = time.perf_counter() - start

        start = time.perf_counter()
        tokens, lengths = np.asarray(host.tokens), np.asarray(host.lengths)
        rows_examples = [example for example in examples for _ in range(g)]
        prompts, texts, scores = self.score(rows_examples, tokens, lengths, host.truncated)
        rewards = scores.total.copy()
        per_function = dict(scores.per_function)
        if c.algorithm.overlong_buffer:
            penalty = overlong_penalty(
                lengths,
                c.rollout.max_new_tokens,
                c.algorithm.overlong_buffer,
                c.algorithm.overlong_penalty,
            )
            rewards += penalty
            per_function["overlong"] = penalty
        timings["time/reward"] = time.perf_counter() - start

        repeat = lambda x: np.repeat(x, g, axis=0)  # noqa: E731
        groups = Groups(
            prompt_ids=repeat(prompt_ids),
            prompt_mask=repeat(prompt_mask),
            tokens=tokens,
            mask=np.asarray(host.mask),
            sampler_logprobs=np.asarray(host.sampler_logprobs),
            lengths=lengths,
            truncated=np.asarray(host.truncated),
            rewards=rewards,
            valid=scores.valid,
            per_function=per_function,
            texts=texts,
            prompts=prompts,
        )
        if self.kl_weight_in_reward:
            start = time.perf_counter()
            batch = self.to_batch(groups, np.zeros(len(texts), np.float32))
            ref = self.block.local(self.frozen_logprobs(ref_params, batch))
            kl = np.asarray(
                sequence_kl(
                    jnp.asarray(host.logprobs),  # the policy's, not top-k/p-filtered
                    jnp.asarray(ref),
                    jnp.asarray(groups.mask),
                    kl_estimator=c.algorithm.kl_estimator,
                )
            )
            groups.rewards = groups.rewards - self.kl_weight_in_reward * kl
            groups.per_function["kl_penalty"] = -self.kl_weight_in_reward * kl
            timings["time/reward"] += time.perf_counter() - start
        timings["reward_failures"] = sum(scores.failures.values())
        return groups, timings

    def score(
        self, row_examples: Sequence[Mapping[str, Any]], tokens, lengths, truncated
    ) -> tuple[list[Any], list[str], Scores]:
        """Decodes each row's completion and scores it against the example it answers."""
        tokens, lengths = np.asarray(tokens), np.asarray(lengths)
        texts = decode_completions(self.tokenizer, tokens, lengths, np.asarray(truncated))
        prompts = [example["prompt"] for example in row_examples]
        fields = {
            key: [example.get(key) for example in row_examples]
            for key in row_examples[0]
            if key != "prompt"
        }
        fields["completion_ids"] = [
            tokens[row, : lengths[row]].tolist() for row in range(len(texts))
        ]
        scores = score_completions(
            self.task.reward_fns,
            self.task.reward_weights,
            prompts,
            [as_completion(p, t) for p, t in zip(prompts, texts, strict=True)],
            fields,
            max_failure_share=self.config.task.max_reward_failure_share,
            pool=self.reward_pool,
        )
        return prompts, texts, scores

    def frozen_logprobs(self, params, batch: Batch) -> jax.Array:
        """f32[R, N] log-probs of the batch's completions under `params`, split by rows."""
        temperature = self.config.rollout.temperature
        # The whole batch: whole groups on every batch shard.
        rows = self.group_size if self.config.algorithm.shared_prompt_forward else 1
        matmul_dtype = self.config.model.matmul_dtype
        program = _shared_program(
            ("frozen_logprobs", self.mesh, self.model_config, temperature, rows, matmul_dtype),
            lambda: jax.jit(
                functools.partial(
                    _frozen_logprobs,
                    model_config=self.model_config,
                    temperature=temperature,
                    shared_prompt_rows=rows,
                    matmul_dtype=matmul_dtype,
                ),
                out_shardings=self.row_matrix,
            ),
        )
        with rules_context(self.mesh):
            return program(params, batch)

    def completion_width(self, groups: Groups) -> int:
        """The narrowest of `completion_widths` that holds every process's longest completion.

        Completion tokens attend only to earlier ones, so dropping columns that no row uses
        changes no log-prob, loss or gradient beyond float rounding (`UpdateConfig`'s
        max_completion_length keeps dr_grpo's divisor)."""
        if len(self.completion_widths) == 1:
            return self.completion_widths[0]
        used = np.flatnonzero(groups.mask.any(axis=0))
        longest = distributed.agree_max(int(used[-1]) + 1 if used.size else 0)
        return next(width for width in self.completion_widths if width >= longest)

    def update_shape(self, groups: Groups) -> tuple[int, int | None]:
        """The completion width and packed rows per group (None: no packing) of the step's
        update, the same on every process.

        Without `algorithm.pack_completions`: the narrowest width that holds every
        completion. With it: of the widths that hold every completion, each with the fewest
        of `packed_row_counts(G)` rows that hold every group's completions, the pair with
        the fewest slots per group (width x rows; on a tie the narrower width). A narrower
        width can need more rows: short completions pack better into wide rows.
        """
        if not self.config.algorithm.pack_completions:
            return self.completion_width(groups), None
        g = self.group_size
        lengths = completion_lengths(groups.mask)
        longest = int(lengths.max(initial=0))
        # rows each width needs here; G + 1 marks a width some completion does not fit
        needed = [
            rows_needed(lengths, g, width) if longest <= width else g + 1
            for width in self.completion_widths
        ]
        choices = []
        agreed = distributed.agree_max_each(needed)
        for width, rows in zip(self.completion_widths, agreed, strict=True):
            if rows <= g:
                rows = next(count for count in packed_row_counts(g) if count >= rows)
                choices.append((width * rows, width, rows))
        _, width, rows = min(choices)
        return width, rows

    def to_batch(
        self,
        groups: Groups,
        advantages: np.ndarray,
        width: int | None = None,
        packed_rows: int | None = None,
    ) -> Batch:
        """The update's batch; `width` keeps the first `width` completion columns (None: all),
        and with `algorithm.pack_completions` each group's completions are packed into
        `packed_rows` rows (None: G)."""
        tokens, mask = groups.tokens[:, :width], groups.mask[:, :width]
        completion_mask = mask
        if self.config.algorithm.mask_truncated:
            completion_mask = completion_mask & ~groups.truncated[:, None]
        packed = None
        if self.config.algorithm.pack_completions:
            packed = pack_completions(
                completion_lengths(mask),
                group_size=self.group_size,
                width=tokens.shape[1],
                rows_per_group=self.group_size if packed_rows is None else packed_rows,
                prompt_length=groups.prompt_ids.shape[1],
            )
        batch = Batch(
            input_ids=np.concatenate([groups.prompt_ids, tokens], axis=1),
            attention_mask=np.concatenate([groups.prompt_mask, mask.astype(np.int32)], axis=1),
            completion_mask=completion_mask,
            advantages=np.asarray(advantages, np.float32),
            packed=packed,
            sampler_logprobs=groups.sampler_logprobs[:, :width],
        )
        return jax.tree.map(self.block.to_global, batch, self.batch_shardings)

    def collect(self, params, ref_params, key, position: int) -> tuple[Groups, dict, int]:
        """Stages 1-3: rollouts (more than one with dynamic sampling) -> the step's groups.

        The groups are this process's rows; the metrics cover every process's rows.
        """
        c, g = self.config, self.group_size
        p = c.rollout.prompts_per_step
        first, stop = self.block.bounds(p)
        local_prompts = stop - first
        attempts = 1 + (c.algorithm.max_extra_rollouts if c.algorithm.dynamic_sampling else 0)
        sampled: list[Groups] = []
        kept: list[Groups] = []
        metrics: dict[str, float] = {"time/rollout": 0.0, "time/reward": 0.0}
        failures = 0
        for attempt in range(attempts):
            examples = tasks.take(self.task.train, p, position=position, seed=c.train.seed)
            position += p
            groups, timings = self.sample_and_score(
                params, ref_params, examples, jax.random.fold_in(key, attempt)
            )
            metrics["time/rollout"] += timings["time/rollout"]
            metrics["time/reward"] += timings["time/reward"]
            failures += timings["reward_failures"]
            sampled.append(groups)
            if not c.algorithm.dynamic_sampling:
                break
            with_signal = np.flatnonzero(~zero_signal(groups.rewards, groups.valid, g))
            if with_signal.size:
                kept.append(groups.select_groups(with_signal, g))
            # Every process samples again until all of them have enough groups.
            if distributed.agree_all(sum(len(k.rewards) for k in kept) >= local_prompts * g):
                break
        everything = Groups.concatenate(sampled)
        flat_all = zero_signal(everything.rewards, everything.valid, g)
        batch_groups = everything
        if c.algorithm.dynamic_sampling:
            missing = local_prompts - sum(len(k.rewards) for k in kept) // g
            if missing > 0:  # extra rollouts exhausted: fill with zero-signal groups
                kept.append(everything.select_groups(np.flatnonzero(flat_all)[:missing], g))
            batch_groups = Groups.concatenate(kept).select_groups(range(local_prompts), g)
            metrics["dynamic/extra_rollouts"] = len(sampled) - 1
            metrics["dynamic/zero_signal_kept"] = int(self.block.gather([max(missing, 0)]).sum())

        gather = self.block.gather  # every process's rows, for the metrics
        valid = gather(everything.valid)
        rewards = gather(everything.rewards)[valid]
        lengths = gather(everything.lengths)
        metrics["reward/mean"] = float(rewards.mean()) if rewards.size else float("nan")
        metrics["reward/std"] = float(rewards.std()) if rewards.size else float("nan")
        for name, values in everything.per_function.items():
            values = gather(values)
            scored = values[~np.isnan(values)]
            metrics[f"reward/{name}/mean"] = float(scored.mean()) if scored.size else float("nan")
            metrics[f"reward/{name}/std"] = float(scored.std()) if scored.size else float("nan")
        metrics["valid_frac"] = float(valid.mean())
        metrics["reward_failures"] = int(gather([failures]).sum())
        metrics["frac_zero_std"] = float(gather(flat_all).mean())
        metrics["completion_len/mean"] = float(lengths.mean())
        metrics["completion_len/max"] = int(lengths.max())
        metrics["truncated_frac"] = float(gather(everything.truncated).mean())
        metrics["tokens"] = int(lengths.sum())
        return batch_groups, metrics, position

    def advantages(self, groups: Groups) -> np.ndarray:
        """f32[R] advantages of this process's rows, from the statistics of every process's
        rows (a collective): `algorithm.scale=batch` divides by the std of the whole batch,
        so every process normalises alike and as one process would."""
        algo, g = self.config.algorithm, self.group_size
        rewards = self.block.gather(groups.rewards)  # [R_all], in row order
        valid = self.block.gather(groups.valid)
        rows = len(rewards)
        advantages = _group_advantages(
            jnp.asarray(rewards),
            jnp.asarray(np.arange(rows) // g, jnp.int32),
            rows // g,
            valid=jnp.asarray(valid),
            scale=algo.scale,
            std_ddof=algo.std_ddof,
            eps=algo.advantage_eps,
            clip=algo.advantage_clip,
        )
        return self.block.take(np.asarray(advantages))

    def step(
        self, state: TrainState, ref_params, step: int, position: int
    ) -> tuple[TrainState, dict[str, float], int]:
        """One GRPO step (stages 1-5); the PRNG key is a pure function of the seed and step."""
        started = time.perf_counter()
        key = jax.random.fold_in(jax.random.key(self.config.train.seed), step)
        groups, metrics, position = self.collect(state.params, ref_params, key, position)
        advantages = self.advantages(groups)
        width, packed_rows = self.update_shape(groups)
        batch = self.to_batch(groups, advantages, width, packed_rows)

        update_start = time.perf_counter()
        self.compiled_update(width, packed_rows)  # compiled ahead: at first, wait for it
        with rules_context(self.mesh):
            state, update = self.update(
                state, batch, ref_params if self.update_config.beta > 0 else None
            )
        metrics.update(_update_metrics(jax.device_get(update)))
        metrics["time/update"] = time.perf_counter() - update_start
        metrics["completion_width"] = width
        if packed_rows is not None:
            metrics["packed_rows"] = packed_rows
        valid = self.block.gather(advantages)[self.block.gather(groups.valid)]
        metrics["advantage/mean"] = float(valid.mean()) if valid.size else 0.0
        metrics["advantage/std"] = float(valid.std()) if valid.size else 0.0
        metrics["advantage/abs_max"] = float(np.abs(valid).max()) if valid.size else 0.0
        metrics["time/step"] = time.perf_counter() - started
        metrics["tokens_per_s"] = metrics.pop("tokens") / metrics["time/step"]
        return state, metrics, position

    def meta(self) -> dict:
        """Run state beyond the arrays that a checkpoint keeps: a reward model's statistics."""
        if self.reward_model is None:
            return {}
        return {"reward_model_moments": self.reward_model.moments.state()}

    def load_meta(self, meta: Mapping[str, Any]) -> None:
        """Restores what `meta()` saved (a checkpoint from before a reward model: nothing)."""
        if self.reward_model is not None and "reward_model_moments" in meta:
            self.reward_model.moments.load(meta["reward_model_moments"])

    def frozen_reward_statistics(self):
        """A context in which a reward model's running statistics are read, not updated."""
        if self.reward_model is None:
            return contextlib.nullcontext()
        return self.reward_model.frozen()

    def evaluate(self, params) -> tuple[dict[str, float], list[tuple[Any, str, float]]]:
        """Greedy completions of the eval examples: mean reward and accuracy (over every
        process's rows; the samples to log are this process's)."""
        c, task = self.config, self.task
        examples = list(task.eval[: c.task.eval_size] if c.task.eval_size else task.eval)
        chunk = c.rollout.prompts_per_step
        totals, correct, real, samples = [], [], [], []
        for start in range(0, len(examples), chunk):
            part = examples[start : start + chunk]
            padded = part + [part[-1]] * (chunk - len(part))  # same shape for every chunk
            local = self.block.take(padded)
            is_real = self.block.take(np.arange(chunk)) < len(part)  # padding at the end
            rows = int(is_real.sum())
            ids, mask = encode_examples(
                self.tokenizer, local, self.prompt_widths["eval"], c.rollout.max_prompt_length
            )
            result = self.sample(params, ids, mask, jax.random.key(0), self.greedy, 1)
            # Padding rows are scored too: a reward model's scoring is a collective call
            # that every process makes, even one whose rows are all padding.
            with self.frozen_reward_statistics():
                prompts, texts, scores = self.score(
                    local, result.tokens, result.lengths, result.truncated
                )
            real_rows = zip(prompts, texts, scores.total.tolist(), strict=True)
            samples.extend(list(real_rows)[:rows])
            totals.append(self.block.gather(scores.total.astype(np.float64)))
            correct.append(self.block.gather(scores.per_function[task.correctness] >= 1.0))
            real.append(self.block.gather(is_real))
        real = np.concatenate(real)
        metrics = {
            "eval/reward": float(np.concatenate(totals)[real].mean()),
            "eval/accuracy": float(np.concatenate(correct)[real].mean()),
        }
        spread = max(1, len(samples) // max(c.train.log_samples, 1))  # across the eval set
        return metrics, samples[::spread][: c.train.log_samples]


# Jitted programs shared by every Trainer with the same mesh and settings (their shardings
# follow from these), so a second run in one process, in a notebook or the tests, reuses
# the compiled update and rollouts.
_PROGRAMS: dict[tuple, Callable] = {}


def _shared_program(key: tuple, build: Callable[[], Callable]) -> Callable:
    if key not in _PROGRAMS:
        _PROGRAMS[key] = build()
    return _PROGRAMS[key]


# One compiled program instead of a dispatch per operation, every step.
_group_advantages = jax.jit(
    group_advantages, static_argnums=2, static_argnames=("scale", "std_ddof", "eps", "clip")
)


def _frozen_logprobs(
    params, batch: Batch, *, model_config, temperature, shared_prompt_rows, matmul_dtype
) -> jax.Array:
    return completion_logprobs(
        params,
        batch,
        model_config=model_config,
        temperature=temperature,
        chunk_size=4096,
        shared_prompt_rows=shared_prompt_rows,
        matmul_dtype=matmul_dtype,
    )[0]


def _update_metrics(update: dict[str, np.ndarray]) -> dict[str, float]:
    """Means over the [num_iterations, num_minibatches] optimizer steps (lr and params_norm:
    the last)."""
    names = {
        "loss": "loss",
        "kl_mean": "kl",
        "clip_frac_low": "clip_frac/low",
        "clip_frac_high": "clip_frac/high",
        "clip_frac_dual": "clip_frac/dual",
        "ratio_mean": "ratio/mean",
        "entropy": "entropy",
        "grad_norm": "grad_norm",
        "sampler_gap": "sampler/gap",
        "sampler_weight_mean": "sampler/weight_mean",
        "sampler_capped_frac": "sampler/capped_frac",
        "off_policy_masked_frac": "off_policy/masked_frac",
    }
    metrics = {ours: float(np.mean(update[key])) for key, ours in names.items() if key in update}
    for last in ("lr", "params_norm"):
        if last in update:
            metrics[last] = float(np.asarray(update[last]).reshape(-1)[-1])
    return metrics


def _non_finite(metrics: Mapping[str, float]) -> str:
    """'name=value' of each divergence sign among the update's metrics ('' if none): a
    non-finite loss or gradient norm (before the update), or a non-finite norm of the
    updated parameters (NaN, or weights past ~1.8e19 whose squares overflow float32)."""
    names = ("loss", "grad_norm", "params_norm")
    return " ".join(
        f"{name}={metrics[name]}" for name in names if not np.isfinite(metrics.get(name, 0.0))
    )


class _Preemption:
    """Turns SIGTERM and a first Ctrl-C (SIGINT) into a flag the loop checks between steps
    (main thread only). The first Ctrl-C puts back the SIGINT handler it replaced, so a second
    one acts as it would without the loop: Python's raises KeyboardInterrupt; the CLI's
    (the system default) ends the process at once. An ignored SIGINT stays ignored."""

    def __init__(self):
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self):
        if _in_main_thread():
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._handle)
            if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
                self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, self._previous.pop(signal.SIGINT))
            logger.warning(
                "Ctrl-C: saving a checkpoint after this step, then exiting (Ctrl-C again: "
                "exit at once, without saving this step)."
            )
        else:
            logger.warning("SIGTERM: saving a checkpoint after this step, then exiting.")
        self.requested = True

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            if handler is not None:  # None: set outside Python, cannot be put back
                signal.signal(signum, handler)


@contextlib.contextmanager
def _run_dir_lock(run_dir: pathlib.Path):
    """Holds an OS lock (flock) on run_dir/.lock while the run lasts; RunDirInUse when another
    process holds it. The OS drops the lock when its process ends, however it ends (kill -9
    included), so no stale lock ever blocks a resume. Several hosts: process 0 locks for all
    (their shared storage may not pass flock between hosts) and every process learns the
    outcome."""
    import fcntl  # POSIX only

    handle, holder = None, ""
    if distributed.is_primary():
        handle = open(run_dir / ".lock", "a+")  # noqa: SIM115 (held until the run ends)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip()
            handle.close()
            handle = None
        else:
            handle.truncate(0)
            handle.write(f"process {os.getpid()} on {socket.gethostname()}\n")
            handle.flush()
    if distributed.agree_any(distributed.is_primary() and handle is None):
        raise RunDirInUse(
            f"train.run_dir={run_dir} is in use by another run ({holder or 'see process 0'}); "
            "wait for it to end, or give this run another train.run_dir."
        )
    try:
        yield
    finally:
        if handle is not None:
            handle.close()  # releases the lock


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class StepProfiler:
    """Traces steps `first` .. `first + count - 1` (counted from 1) with the JAX profiler into
    `directory`, on every process (TensorBoard's profile plugin or XProf open the trace)."""

    def __init__(self, directory: pathlib.Path, first: int, count: int):
        self.directory, self.first, self.last = directory, first, first + count - 1
        self.tracing = False

    def before(self, step: int) -> None:
        if not self.tracing and self.first <= step <= self.last:
            logger.info("tracing steps %d-%d into %s", step, self.last, self.directory)
            jax.profiler.start_trace(str(self.directory))
            self.tracing = True

    def after(self, step: int) -> None:  # the step's metrics are on the host: it has finished
        if step >= self.last:
            self.close()

    def close(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False


def train(
    config: Config,
    *,
    task: tasks.Task | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> TrainResult:
    """Runs (or resumes) the GRPO loop the config describes; returns the final state.

    `task` replaces the config's built-in task (bring your own data and reward functions);
    `on_step(step, metrics)` is called after each step's metrics are written. One run at a
    time per `train.run_dir`: another run there raises RunDirInUse.
    """
    use_compilation_cache(config.train.compilation_cache)
    run_dir = pathlib.Path(config.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    distributed.check_shared_directory(run_dir)  # several hosts write one checkpoint
    with _run_dir_lock(run_dir):
        return _run(config, task, on_step, run_dir)


def _run(
    c: Config,
    task: tasks.Task | None,
    on_step: Callable[[int, dict[str, float]], None] | None,
    run_dir: pathlib.Path,
) -> TrainResult:
    """`train` with the run directory locked: setup, the loop, the export."""
    trainer = Trainer(c, task)
    trainer.compile_update_ahead()  # compiles while the plan and the first rollout run
    check_memory(trainer)  # before anything is allocated: a config that cannot fit stops here

    params = trainer.initial_params()
    ref_params = trainer.reference_params(params)  # None when beta is 0
    state = trainer.initial_state(params)
    checkpointer = Checkpointer(run_dir / "checkpoints", keep=c.train.keep_checkpoints)
    step, position = 0, 0
    last_saved = None  # the step resumed from, then the last one saved
    reference_moves = c.algorithm.ref_sync_steps > 0  # saved with each checkpoint if so
    try:
        if checkpointer.latest_step() is not None:
            state, meta = checkpointer.restore(state)  # the newest intact step, checked
            step, position = int(meta["step"]), int(meta["data_position"])
            last_saved = step
            if ref_params is not None:  # a moved reference: from its checkpoint, sync on or off
                moved = checkpointer.restore_reference(trainer.reference_arguments(), step)
                reference_moves = reference_moves or moved is not None
                ref_params = ref_params if moved is None else moved
            trainer.load_meta(meta)
            logger.info("resuming %s from step %d", run_dir, step)
            changes = changed_settings(meta.get("config", {}), c)
            if changes:
                logger.warning(
                    "resuming with settings other than the checkpoint's (these apply from step "
                    "%d): %s",
                    step + 1,
                    "; ".join(changes),
                )
        # The checksums each save computes on the devices: compiled now, not in a step.
        checkpointer.compile_checksums(state, ref_params if reference_moves else None)
    except BaseException:
        checkpointer.close()
        raise
    primary = distributed.is_primary()  # process 0 writes metrics and logs samples
    writer = (
        MetricsWriter(run_dir, resume_step=last_saved, tensorboard=c.train.tensorboard)
        if primary
        else None
    )
    progress = ProgressBar(c.train.steps, initial_step=step, enabled=c.train.progress and primary)

    def save(done: int):
        nonlocal last_saved
        meta = {"step": done, "data_position": position, "seed": c.train.seed, "config": to_dict(c)}
        meta.update(trainer.meta())
        checkpointer.save(done, state, meta, reference=ref_params if reference_moves else None)
        last_saved = done

    stopped = False
    profiler = StepProfiler(run_dir / "profile", c.train.profile_start, c.train.profile_steps)
    try:
        with _Preemption() as preemption:
            while step < c.train.steps:
                profiler.before(step + 1)
                state, metrics, position = trainer.step(state, ref_params, step, position)
                step += 1
                profiler.after(step)
                diverged = _non_finite(metrics)  # before anything saves the new weights
                if diverged:
                    where = (
                        f"the last good checkpoint is step {last_saved} in {checkpointer.directory}"
                        " (rerunning resumes from it)"
                        if last_saved is not None
                        else "no checkpoint was written yet"
                    )
                    raise TrainingDiverged(
                        f"step {step}: {diverged} is not finite; {where}. Lower optim.lr, "
                        "keep optim.max_grad_norm set, or use model.dtype=float32."
                    )

                if c.algorithm.ref_sync_steps and step % c.algorithm.ref_sync_steps == 0:
                    ref_params = trainer.synced_reference(ref_params, state.params)
                if c.train.eval_every and (step % c.train.eval_every == 0 or step == c.train.steps):
                    eval_metrics, samples = trainer.evaluate(state.params)
                    metrics.update(eval_metrics)
                    for prompt, text, reward in samples if primary else ():
                        logger.info(
                            "step %d sample (reward %.3g): %r -> %r", step, reward, prompt, text
                        )
                if writer is not None:
                    writer.write(step, metrics)
                progress.update(step, metrics)
                if step % c.train.save_every == 0 or step == c.train.steps:
                    save(step)
                if on_step is not None:
                    on_step(step, metrics)
                if distributed.agree_any(preemption.requested):  # every process stops here
                    if last_saved != step:
                        save(step)
                    stopped = True
                    break
    finally:
        profiler.close()
        progress.close()
        if writer is not None:
            writer.close()
        checkpointer.close()
        if trainer.reward_pool is not None:
            trainer.reward_pool.close()
    if step >= c.train.steps and c.train.export and not stopped:
        params = distributed.host_params(state.params)  # every process takes part
        if primary:
            export(trainer, params, run_dir / "hf")
    return TrainResult(state=state, steps_done=step, run_dir=run_dir, stopped_by_signal=stopped)


def evaluate(
    config: Config, params=None, *, task: tasks.Task | None = None
) -> tuple[dict[str, float], list[tuple[Any, str, float]]]:
    """Greedy answers to the eval split, as the train loop's evaluation step scores them.

    params: the policy to evaluate (e.g. `train(config).state.params`); None evaluates the
    config's initial policy, the one training starts from. Returns the metrics
    {"eval/reward", "eval/accuracy"} (accuracy: the share where the task's correctness reward
    is 1) and up to `train.log_samples` (prompt, completion, reward) samples spread over the
    eval set.

    It scores the task of `config` (or `task`), and logs which: to evaluate a trained policy,
    pass the config it was trained with. For the CLI's demo that is `demo_config()`, not
    `load_config(None)`, whose defaults ask for sums of 0-9 where the demo learnt 0-4.
    """
    use_compilation_cache(config.train.compilation_cache)
    trainer = Trainer(config, task)
    size = len(trainer.task.eval[: config.task.eval_size or None])
    scored = _task_settings(config) if task is None else f"the task {trainer.task.name!r}"
    logger.info("evaluating %d eval prompts of %s", size, scored)
    try:
        if params is None:
            params = trainer.initial_params()
        else:  # in this trainer's shards, wherever the parameters came from
            params = jax.device_put(params, trainer.param_shardings)
        return trainer.evaluate(params)
    finally:
        if trainer.reward_pool is not None:
            trainer.reward_pool.close()


def _task_settings(config: Config) -> str:
    """The config's task as settings: its name and those that differ from the defaults."""
    default = TaskSection()
    return ", ".join(
        f"task.{field.name}={getattr(config.task, field.name)}"
        for field in dataclasses.fields(TaskSection)
        if field.name == "name" or getattr(config.task, field.name) != getattr(default, field.name)
    )


def export(trainer: Trainer, params, directory: pathlib.Path) -> pathlib.Path:
    """The trained policy as an HF checkpoint (config, safetensors, tokenizer)."""
    from jgrpo import models

    trainer.model.load_params(params)
    models.save_pretrained(trainer.model, directory)
    if getattr(trainer.model, "source_dir", None) is None:
        trainer.tokenizer.save_pretrained(directory)
    logger.info("exported the policy to %s", directory)
    return directory


def export_checkpoint(
    run_dir: str | pathlib.Path, out_dir: str | pathlib.Path, *, step: int | None = None
) -> pathlib.Path:
    """A checkpoint of `run_dir` in HF format, using the run's config: `step`, or by default
    the newest intact one (a damaged step is skipped with a warning, as a resume does)."""
    from jgrpo.config import from_dict

    with Checkpointer(pathlib.Path(run_dir) / "checkpoints") as checkpointer:
        steps = checkpointer.all_steps()
        if not steps:
            raise FileNotFoundError(f"{run_dir} has no checkpoint to export.")
        meta = checkpointer.restore_meta(steps[-1] if step is None else step)
        trainer = Trainer(from_dict(meta["config"]))
        optimizer_state = init_state(trainer.model.params(), trainer.optimizer)
        state, _ = checkpointer.restore(optimizer_state, step=step)
    return export(trainer, state.params, pathlib.Path(out_dir))


def parse_args(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """[CONFIG.yaml] [key=value ...] -> (config path or None, overrides)."""
    if argv and "=" not in argv[0] and argv[0] != "smoke":
        return argv[0], list(argv[1:])
    return None, list(argv)


def _log_to_stderr() -> None:
    """jgrpo's INFO messages (resume, samples, export) on stderr, whatever else set logging up."""
    log = logging.getLogger("jgrpo")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(
            "usage: python -m jgrpo.train [CONFIG.yaml] [section.key=value ...]\n\n"
            "Without CONFIG.yaml the CPU demo runs (a small model learns addition from scratch),\n"
            f"with any overrides on top; the demo sets: {' '.join(DEMO_OVERRIDES)}\n"
            "The word `smoke` among the overrides runs a recipe as a quick CPU check: "
            f"{' '.join(SMOKE_OVERRIDES)}\n"
            "Rerun with the same train.run_dir to resume.\n\nConfig keys:\n" + format_help()
        )
        return 0
    _log_to_stderr()
    path, overrides = parse_args(argv)
    try:  # without a YAML file, the built-in demo with any overrides on top
        config = demo_config(overrides) if path is None else load_config(path, overrides)
    except (ConfigError, FileNotFoundError) as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    interrupt = signal.getsignal(signal.SIGINT) if _in_main_thread() else signal.SIG_IGN
    if interrupt not in (signal.SIG_IGN, None):
        # Ctrl-C ends the process at once: a KeyboardInterrupt would wait for a compilation
        # or a device program to finish. In the loop the first one saves first (_Preemption).
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        d = config.distributed
        distributed.initialize(
            d.initialize,
            coordinator_address=d.coordinator_address,
            num_processes=d.num_processes,
            process_id=d.process_id,
        )
        result = train(config)
    except TrainingDiverged as error:
        print(f"training diverged: {error}", file=sys.stderr)
        return 1
    except (RunDirInUse, CheckpointDamaged) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    # Found as the hosts connect and the data and the model load (ConnectionError: a data or
    # model source offline; each message names the fix).
    except (ConfigError, DatasetError, distributed.DistributedError, ConnectionError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except RewardSpecError as error:
        print(f"error: task.rewards: {error}", file=sys.stderr)
        return 2
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as error:
        print(f"error: {_missing_file(error, config)}", file=sys.stderr)
        return 2
    finally:
        if interrupt not in (signal.SIG_IGN, None):
            signal.signal(signal.SIGINT, interrupt)
    if result.stopped_by_signal:
        logger.info("stopped by a signal after step %d; rerun to resume.", result.steps_done)
    return 0


# Config keys that name files or folders the run reads.
_PATH_KEYS = ("task.path", "task.eval_path", "task.data_dir", "model.path", "reward_model.path")


def _missing_file(error: OSError, config: Config) -> str:
    """A file or folder the run could not read, in one line with the config key naming it."""
    if error.filename is None:
        return str(error)  # one of jgrpo's messages, which says what is missing
    missing = str(error.filename)
    keys = []
    for key in _PATH_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if value is not None and missing.startswith(str(value)):
            keys.append(f"{key}={value}")
    named = f" (from {', '.join(keys)})" if keys else ""
    return f"{missing}: {error.strerror}{named}; check the path."


if __name__ == "__main__":
    reexec_with_huge_pages()  # on Linux CPUs: 2 MiB pages, kept memory (returns if not)
    sys.exit(main())
