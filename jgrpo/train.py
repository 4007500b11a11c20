"""`python -m jgrpo.train [CONFIG.yaml] [key=value ...]`: GRPO from a config, stage by stage.

Setup (`jgrpo.setup`, once): the task and the policy, the mesh, the shardings, the optimizer,
the compiled programs. Then each step:
1. collect (`jgrpo.collect`): the next prompts of the task (order fixed by the seed; the
   position is checkpointed), G completions each (`jgrpo.rollout.rollout`), their rewards
   (`jgrpo.rewards.score_completions`) with the optional overlong penalty and KL-in-reward
   term; with dynamic sampling, groups whose rewards are all equal are replaced by new prompts;
2. batch (`jgrpo.batches`): advantages within each group (`jgrpo.group_advantages`), then the
   update's batch at the narrowest completion width, packed or padded;
3. update: `jgrpo.train_step` (mu passes x minibatches, one jitted program, donated state);
4. metrics; every N steps an evaluation (`jgrpo.evaluation`) and a checkpoint.
Around the loop (`jgrpo.lifecycle`): the run directory's lock, resuming, the divergence check,
preemption, profiling and the export; the command line is `jgrpo.cli`.

Rerunning the same command with the same `train.run_dir` resumes from the newest intact
checkpoint; SIGTERM (TPU preemption) or Ctrl-C saves one and exits 0 (a second Ctrl-C exits at
once); a second run on a `train.run_dir` in use is refused. With no arguments the CPU demo runs.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jgrpo import cli, distributed, tasks
from jgrpo.batches import advantages_of, completion_width, to_batch, update_shape
from jgrpo.checkpoint import Checkpointer
from jgrpo.collect import (  # noqa: F401 (encode_examples, overlong_penalty: here too)
    collect_groups,
    encode_examples,
    overlong_penalty,
    sample_and_score,
)
from jgrpo.config import Config, TaskSection, to_dict
from jgrpo.evaluation import evaluate_greedy
from jgrpo.groups import Groups
from jgrpo.huge_pages import reexec_with_huge_pages
from jgrpo.lifecycle import (  # noqa: F401 (export_checkpoint, RunDirInUse: here too)
    Preemption,
    RunDirInUse,
    StepProfiler,
    TrainingDiverged,
    export,
    export_checkpoint,
    resume,
    run_dir_lock,
    stop_if_diverged,
    use_compilation_cache,
)
from jgrpo.metrics import MetricsWriter, ProgressBar
from jgrpo.plan import check_memory
from jgrpo.programs import PROGRAMS as _PROGRAMS  # noqa: F401 (the tests clear it here)
from jgrpo.rewards.pool import VerifierPool
from jgrpo.setup import (  # noqa: F401 (the settings functions, here too)
    Setup,
    build_task,
    completion_widths,
    prompt_width,
    update_config_of,
)
from jgrpo.sharding import rules_context
from jgrpo.update import Batch, TrainState

logger = logging.getLogger("jgrpo.train")

# Names from before the stages had modules of their own.
_Preemption = Preemption
parse_args = cli.parse_args


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    steps_done: int
    run_dir: pathlib.Path
    stopped_by_signal: bool = False


class Trainer(Setup):
    """The setup (`jgrpo.setup.Setup`) with the steps: one method per stage, each in the
    module named for it, and `step`, which runs them in order. The loop is `train`."""

    def __init__(self, config: Config, task: tasks.Task | None = None):
        super().__init__(config, task)
        workers, timeout = config.task.reward_workers, config.task.reward_timeout_s
        self.reward_pool = VerifierPool(workers, timeout) if workers else None

    def collect(self, params, ref_params, key, position: int) -> tuple[Groups, dict, int]:
        """Stage 1: the step's scored groups (`jgrpo.collect.collect_groups`)."""
        return collect_groups(self, params, ref_params, key, position, self.reward_pool)

    def sample_and_score(self, params, ref_params, examples, key) -> tuple[Groups, dict]:
        """Stage 1 for one batch of prompts (`jgrpo.collect.sample_and_score`)."""
        return sample_and_score(self, params, ref_params, examples, key, self.reward_pool)

    def advantages(self, groups: Groups) -> np.ndarray:
        """Stage 2: f32[R] advantages of this process's rows (`jgrpo.batches.advantages_of`)."""
        return advantages_of(self, groups)

    def completion_width(self, groups: Groups) -> int:
        """Stage 2: the narrowest update width that holds every completion (`jgrpo.batches`)."""
        return completion_width(self, groups)

    def update_shape(self, groups: Groups) -> tuple[int, int | None]:
        """Stage 2: the update's completion width and packed rows (`jgrpo.batches`)."""
        return update_shape(self, groups)

    def to_batch(
        self,
        groups: Groups,
        advantages: np.ndarray,
        width: int | None = None,
        packed_rows: int | None = None,
    ) -> Batch:
        """Stage 2: the update's batch (`jgrpo.batches.to_batch`)."""
        return to_batch(self, groups, advantages, width, packed_rows)

    def step(
        self, state: TrainState, ref_params, step: int, position: int
    ) -> tuple[TrainState, dict[str, float], int]:
        """One GRPO step: collect -> advantages -> batch -> update -> metrics; the PRNG key is
        a pure function of the seed and step."""
        started = time.perf_counter()
        key = jax.random.fold_in(jax.random.key(self.config.train.seed), step)
        policy = self.policy_params(state.params)  # with LoRA: the adapters merged in
        groups, metrics, position = self.collect(policy, ref_params, key, position)
        advantages = self.advantages(groups)
        width, packed_rows = self.update_shape(groups)
        batch = self.to_batch(groups, advantages, width, packed_rows)

        update_start = time.perf_counter()
        self.compiled_update(width, packed_rows)  # compiled ahead: at first, wait for it
        with rules_context(self.mesh):
            takes_frozen = self.update_config.beta > 0 or self.lora is not None
            state, update = self.update(state, batch, ref_params if takes_frozen else None)
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

    def evaluate(self, params) -> tuple[dict[str, float], list[tuple[Any, str, float]]]:
        """Greedy completions of the eval split, scored (`jgrpo.evaluation`); `params` are
        the trained ones (with LoRA the adapters)."""
        return evaluate_greedy(self, self.policy_params(params), self.reward_pool)


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
        "moe_aux_loss": "moe/aux_loss",
        "moe_expert_load_max": "moe/expert_load_max",
        "moe_expert_load_min": "moe/expert_load_min",
    }
    metrics = {ours: float(np.mean(update[key])) for key, ours in names.items() if key in update}
    for last in ("lr", "params_norm"):
        if last in update:
            metrics[last] = float(np.asarray(update[last]).reshape(-1)[-1])
    return metrics


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
    with run_dir_lock(run_dir):
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
        resumed = resume(trainer, checkpointer, state, ref_params, run_dir)
        if resumed is not None:
            state, ref_params, step, position, moved = resumed
            last_saved = step
            reference_moves = reference_moves or moved
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
        with Preemption() as preemption:
            while step < c.train.steps:
                profiler.before(step + 1)
                state, metrics, position = trainer.step(state, ref_params, step, position)
                step += 1
                profiler.after(step)
                # before anything saves the new weights
                stop_if_diverged(step, metrics, last_saved, checkpointer.directory)

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
        export(trainer, state.params, run_dir / "hf")
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


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jgrpo.train [CONFIG.yaml] [key=value ...]` (`jgrpo.cli.main`)."""
    return cli.main(argv, run=lambda config: train(config))


if __name__ == "__main__":
    reexec_with_huge_pages()  # on Linux CPUs: 2 MiB pages, kept memory (returns if not)
    sys.exit(main())
