"""Memory planning: what each device holds during a step, read from the compiled programs.

    python -m jgrpo.plan [CONFIG.yaml] [section.key=value ...] [smoke] [--budget-gib 16]

The rollout, the update and a learned reward model's scoring are compiled ahead of time for
the config's mesh (nothing runs). Parameters, optimizer state, the reference model and the
reward model are the per-device shards of their arrays; the KV cache comes from its shapes;
the scratch memory of each program (activations, gradients, the cache) from XLA's own
memory analysis of the compiled program. The peak is the largest of the phases. With a
budget, the report also names the largest micro-batch (rows per forward and backward pass,
set by algorithm.grad_accumulation) that fits.

`python -m jgrpo.train` runs the same check before step 1 when it knows a budget (the
device's memory limit on GPU and TPU, or mesh.memory_budget_gib) and stops with this report
instead of running out of memory mid-run.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo.config import ConfigError, load_config
from jgrpo.rollout import concurrent_rows, kv_cache_bytes
from jgrpo.setup import Setup, packing_obstacle, shared_prompt_rows
from jgrpo.sharding import abstract_arrays, replicated, rules_context
from jgrpo.update import UpdateConfig

GIB = 1024**3


class OutOfMemoryPlan(RuntimeError):
    """The planned peak of a step exceeds the memory budget; the message is the report."""


@dataclasses.dataclass
class MemoryPlan:
    """Bytes per device (the fullest device of the mesh)."""

    mesh: dict[str, int]
    parameters: int
    optimizer: int
    reference: int
    kv_cache: int  # prompt + completion caches of one rollout (inside rollout_scratch)
    rollout_scratch: int  # the compiled rollout's temporaries
    update_scratch: int  # the compiled update's temporaries (activations, gradients)
    batch: int  # one rollout batch as the update receives it
    micro_batch_rows: int
    reward_model: int = 0  # a learned reward model's parameters (reward_model.path)
    reward_scratch: int = 0  # its scoring program's temporaries (longest bucket, one batch)
    fits: dict[int, int] = dataclasses.field(default_factory=dict)  # micro rows -> peak
    # micro-batches that would split groups, so run unpacked (algorithm.pack_completions)
    unplanned: list[int] = dataclasses.field(default_factory=list)
    # settings that would save memory and are not set yet (`memory_knobs`)
    knobs: tuple[str, ...] = ()
    # sequences a rollout samples, and how many decode at once (rollout.max_concurrent)
    sequences: int = 0
    concurrent: int = 0
    # LoRA: `parameters` and `optimizer` are the adapters', `reference` the frozen base
    lora_rank: int = 0

    @property
    def resident(self) -> int:
        return self.parameters + self.optimizer + self.reference + self.reward_model

    @property
    def rollout_peak(self) -> int:
        return self.resident + self.rollout_scratch

    @property
    def update_peak(self) -> int:
        return self.resident + self.batch + self.update_scratch

    @property
    def reward_peak(self) -> int:
        return self.resident + self.reward_scratch

    @property
    def peak(self) -> int:
        return max(self.rollout_peak, self.update_peak, self.reward_peak)

    def largest_fitting(self, budget: int) -> int | None:
        """The largest micro-batch (rows) whose planned peak is within the budget."""
        fitting = [rows for rows, peak in self.fits.items() if peak <= budget]
        return max(fitting) if fitting else None

    def report(self, budget: int | None = None) -> str:
        mesh = " x ".join(f"{name}={size}" for name, size in self.mesh.items())
        lora = self.lora_rank > 0
        lines = [
            f"memory per device, mesh {mesh}:",
            f"  parameters       {_gib(self.parameters)}"
            + (f"  (LoRA adapters, rank {self.lora_rank})" if lora else ""),
            f"  optimizer state  {_gib(self.optimizer)}",
            f"  reference model  {_gib(self.reference)}"
            + ("  (the frozen base: no copy)" if lora else ""),
            *(
                [
                    f"  reward model     {_gib(self.reward_model)}  "
                    f"(scoring scratch {_gib(self.reward_scratch)})"
                ]
                if self.reward_model
                else []
            ),
            f"  rollout scratch  {_gib(self.rollout_scratch)}  (KV cache {_gib(self.kv_cache)}"
            + (
                f"; {self.concurrent} of {self.sequences} sequences decode at once)"
                if self.concurrent < self.sequences
                else ")"
            ),
            f"  update scratch   {_gib(self.update_scratch)}  "
            f"(micro-batch of {self.micro_batch_rows} rows; batch {_gib(self.batch)})",
            f"  peak             {_gib(self.peak)}  (rollout {_gib(self.rollout_peak)}, "
            f"update {_gib(self.update_peak)}"
            + (f", reward model {_gib(self.reward_peak)})" if self.reward_model else ")"),
        ]
        if budget is not None:
            lines.append(f"  budget           {_gib(budget)}")
            for rows, peak in sorted(self.fits.items()):
                mark = "fits" if peak <= budget else "too big"
                lines.append(f"    micro-batch {rows:5d} rows: peak {_gib(peak)}  {mark}")
            for rows in self.unplanned:
                lines.append(
                    f"    micro-batch {rows:5d} rows: splits groups, so runs unpacked; plan it "
                    "with algorithm.pack_completions=false"
                )
            best = self.largest_fitting(budget)
            shorter = (
                f", use {', '.join(self.knobs)}, or shorter rollout lengths"
                if self.knobs
                else " or use shorter rollout lengths"
            )
            lines.append(
                f"  largest micro-batch that fits: {best} rows"
                if best
                else f"  no micro-batch fits: shard further (mesh.fsdp, mesh.tensor){shorter}"
            )
        return "\n".join(lines)


def memory_knobs(config) -> tuple[str, ...]:
    """The memory-saving settings a run could still take: each one not already set."""
    model = config.model
    knobs = []
    if model.dtype != "bfloat16":
        knobs.append("model.dtype=bfloat16")
        # a bf16 model's reference is a bf16 copy already
        # (with LoRA the frozen base is the reference, whatever beta)
        if (config.algorithm.beta > 0 or model.lora_rank) and model.reference_dtype != "bfloat16":
            knobs.append("model.reference_dtype=bfloat16")
    if not model.remat:
        knobs.append("model.remat=true")
    if model.keep_logits_mib > 0:
        knobs.append("model.keep_logits_mib=0")
    if not model.lora_rank:
        knobs.append("model.lora_rank=16")
    return tuple(knobs)


def _gib(nbytes: int) -> str:
    if nbytes < GIB:
        return f"{nbytes / 1024**2:8.2f} MiB"
    return f"{nbytes / GIB:8.2f} GiB"


def shard_bytes(tree) -> int:
    """Bytes of the largest shard of each array (ShapeDtypeStructs with shardings), summed."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def plan_memory(setup: Setup, micro_batch_candidates: Sequence[int] = ()) -> MemoryPlan:
    """Compiles the run's rollout and update for its mesh and sizes every part."""
    c, mc, mesh = setup.config, setup.model_config, setup.mesh
    state, batch, reference = setup.update_arguments()
    params, opt_state = state.params, state.opt_state
    frozen = setup.reference_arguments()  # also with kl_in_reward, where the update has none
    prompts, length = c.rollout.prompts_per_step, setup.prompt_widths["train"]
    rows, new_tokens = prompts * c.rollout.num_generations, c.rollout.completion_tokens

    prompt = jax.ShapeDtypeStruct((prompts, length), jnp.int32, sharding=setup.row_matrix)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated(mesh))
    with rules_context(mesh):
        rollout = setup.rollout_program(setup.sampling, c.rollout.num_generations)
        policy = setup.policy_arguments()  # with LoRA, the base and the adapters
        rollout_memory = rollout.lower(policy, prompt, prompt, key).compile().memory_analysis()

    def update_scratch(update_config: UpdateConfig) -> int:
        if update_config == setup.update_config:  # compiled ahead (or now) for the run
            return setup.compiled_update().memory_analysis().temp_size_in_bytes
        with rules_context(mesh):
            program = setup.update_program(update_config)
            compiled = program.lower(state, batch, reference).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    per_minibatch = rows_per_minibatch(c)
    micro_rows = per_minibatch // c.algorithm.grad_accumulation
    shard_rows = mesh.shape["data"] * mesh.shape["fsdp"]
    with rules_context(mesh):  # one device's share of the prompt and completion caches
        prompt_cache = kv_cache_bytes(prompts, length, mc, c.model.dtype)
        slots = concurrent_rows(setup.sampling.max_concurrent, rows) or rows
        completion_cache = kv_cache_bytes(slots, new_tokens, mc, c.model.dtype, completion=True)
        kv_cache = prompt_cache + completion_cache
    reward_params, reward_scratch = reward_model_memory(c, mesh)
    plan = MemoryPlan(
        mesh=dict(mesh.shape),
        parameters=shard_bytes(params),
        optimizer=shard_bytes(opt_state),
        reference=shard_bytes(frozen) if frozen is not None else 0,
        kv_cache=kv_cache,
        rollout_scratch=rollout_memory.temp_size_in_bytes,
        update_scratch=update_scratch(setup.update_config),
        batch=shard_bytes(batch),
        micro_batch_rows=micro_rows,
        reward_model=reward_params,
        reward_scratch=reward_scratch,
        knobs=memory_knobs(c),
        sequences=rows,
        concurrent=slots,
        lora_rank=c.model.lora_rank,
    )
    plan.fits[micro_rows] = plan.update_peak
    for candidate in micro_batch_candidates:
        if candidate == micro_rows or per_minibatch % candidate or candidate % shard_rows:
            continue
        accumulation = per_minibatch // candidate
        shared = shared_prompt_rows(c, grad_accumulation=accumulation, batch_shards=shard_rows)
        if c.algorithm.pack_completions and packing_obstacle(
            c, grad_accumulation=accumulation, batch_shards=shard_rows
        ):
            plan.unplanned.append(candidate)  # the trainer would run it unpacked: not this plan
            continue
        config = dataclasses.replace(
            setup.update_config, grad_accumulation=accumulation, shared_prompt_rows=shared
        )  # the update the trainer would run with that accumulation
        scratch = update_scratch(config)
        plan.fits[candidate] = plan.resident + plan.batch + scratch
    return plan


def reward_model_memory(config, mesh) -> tuple[int, int]:
    """Per-device bytes of the config's reward model parameters (sharded by the rules table)
    and of its scoring program's scratch at the longest length bucket it can meet (0, 0
    without one). Scoring runs between the rollout and the update, so it is a phase of its
    own."""
    rm = config.reward_model
    if rm.path is None:
        return 0, 0
    from jgrpo.generation import DEFAULT_BUCKETS, bucket_length
    from jgrpo.models.reward_model import (
        read_reward_config,
        reward_param_axes,
        reward_param_shapes,
        score_sequences,
    )
    from jgrpo.rewards.model_reward import scoring_rows
    from jgrpo.sharding import row_shardings, tree_shardings

    rm_config = read_reward_config(rm.path)
    shapes = reward_param_shapes(rm_config, jnp.dtype(rm.dtype))
    params = abstract_arrays(shapes, tree_shardings(shapes, reward_param_axes(rm_config), mesh))
    rows = scoring_rows(rm.batch_size, mesh)
    length = bucket_length(rm.max_length, DEFAULT_BUCKETS)
    ids = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=row_shardings(mesh)[1])
    with rules_context(mesh):
        compiled = score_sequences.lower(
            params, ids, ids, config=rm_config, pad_token_id=None
        ).compile()
    return shard_bytes(params), compiled.memory_analysis().temp_size_in_bytes


def rows_per_minibatch(config) -> int:
    c = config
    return c.rollout.prompts_per_step * c.rollout.num_generations // c.algorithm.num_minibatches


def micro_batch_candidates(rows_per_minibatch: int) -> list[int]:
    """Powers of two that divide the minibatch, and the minibatch itself."""
    candidates = {rows_per_minibatch}
    size = 1
    while size < rows_per_minibatch:
        if rows_per_minibatch % size == 0:
            candidates.add(size)
        size *= 2
    return sorted(candidates)


def device_budget(config) -> int | None:
    """mesh.memory_budget_gib, else the device's own limit (GPU, TPU); None on CPU."""
    if config.mesh.memory_budget_gib is not None:
        return int(config.mesh.memory_budget_gib * GIB)
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def check_memory(setup: Setup) -> MemoryPlan | None:
    """Fails fast, before step 1, when the planned peak exceeds the budget."""
    budget = device_budget(setup.config)
    if budget is None:
        return None
    plan = plan_memory(setup, micro_batch_candidates(rows_per_minibatch(setup.config)))
    if plan.peak > budget:
        raise OutOfMemoryPlan(
            "this config would run out of device memory:\n"
            + plan.report(budget)
            + "\nSet algorithm.grad_accumulation to reach the micro-batch above, or shard "
            "further (mesh.fsdp, mesh.tensor)."
        )
    return plan


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from jgrpo.cli import parse_args
    from jgrpo.config import DEMO_OVERRIDES, with_smoke

    parser = argparse.ArgumentParser(
        prog="python -m jgrpo.plan",
        description="Per-device memory of a training config's rollout and update, from the "
        "programs compiled for its mesh (nothing runs). It takes the arguments of "
        "python -m jgrpo.train.",
        epilog="python -m jgrpo.train --help lists every config key with its default.",
    )
    parser.add_argument(
        "--budget-gib", type=float, default=None, metavar="GIB", help="memory per device"
    )
    parser.add_argument(
        "config",
        nargs="?",
        metavar="CONFIG.yaml",
        help="a recipe such as configs/gsm8k-qwen2.5-0.5b.yaml; without one, the demo",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="config overrides, later ones win; the word smoke plans the recipe's CPU check",
    )
    args = parser.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    path, overrides = parse_args([*filter(None, [args.config]), *args.overrides])
    overrides = with_smoke(overrides)
    if path is None:
        overrides = [*DEMO_OVERRIDES, *overrides]
    try:
        config = load_config(path, overrides)
        setup = Setup(config)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ConnectionError) as error:  # a data or model source
        print(f"error: {error}", file=sys.stderr)
        return 2
    budget = None if args.budget_gib is None else int(args.budget_gib * GIB)
    candidates = micro_batch_candidates(rows_per_minibatch(config)) if budget else ()
    plan = plan_memory(setup, candidates)
    print(plan.report(budget))
    return 0 if budget is None or plan.peak <= budget else 1


if __name__ == "__main__":
    sys.exit(main())
