"""jgrpo benchmarks. Modes:

    python scripts/benchmark.py step [--preset tiny] [--prompts 16] [--generations 16] ...
    python scripts/benchmark.py rollout [...]   # = scripts/benchmark_rollout.py [...]
    python scripts/benchmark.py models [...]    # = scripts/benchmark_models.py [...]
    python scripts/benchmark.py scaling [...]   # = scripts/benchmark_scaling.py [...]
    python scripts/benchmark.py memory [...]    # = scripts/benchmark_memory.py [...]

`step` times full GRPO steps of the trainer (`jgrpo.train.Trainer`, the addition task, a
randomly initialised preset): rollout, reward and update apart, completion tokens/s, and the
update's achieved FLOP/s (XLA's cost analysis of the compiled update divided by its time) as
a fraction of a matmul peak measured in the same run on the same device in the model's dtype
(`--dtype`): the update's model FLOPs utilisation. Compilation is the first step, reported
apart.
"""

from __future__ import annotations

import argparse
import runpy
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

SCRIPTS = Path(__file__).resolve().parent


def matmul_peak_flops(size: int = 2048, repeats: int = 5, dtype=jnp.float32) -> float:
    """FLOP/s of one jitted [size, size] @ [size, size] in `dtype` (best of `repeats`)."""
    a = jax.random.normal(jax.random.key(0), (size, size), dtype)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best = min(_timed(lambda: matmul(a).block_until_ready()) for _ in range(repeats))
    return 2 * size**3 / best


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def benchmark_step(args: argparse.Namespace) -> None:
    from jgrpo.config import load_config
    from jgrpo.train import Trainer
    from jgrpo.update import init_state, train_step

    config = load_config(
        None,
        [
            f"model.preset={args.preset}",
            f"model.dtype={args.dtype}",
            "task.max_operand=999",  # prompts of up to 8 characters
            f"rollout.prompts_per_step={args.prompts}",
            f"rollout.num_generations={args.generations}",
            f"rollout.max_new_tokens={args.new_tokens}",
            "rollout.max_prompt_length=16",
            f"algorithm.num_minibatches={args.minibatches}",
            f"algorithm.beta={args.beta}",
        ],
    )
    trainer = Trainer(config)
    params = trainer.model.params()
    ref = jax.tree.map(jnp.copy, params) if args.beta > 0 else None
    state = init_state(params, trainer.optimizer)
    kwargs = dict(
        model_config=trainer.model_config,
        update_config=trainer.update_config,
        optimizer=trainer.optimizer,
    )
    rows = []
    flops = None
    for step in range(args.steps + 1):
        start = time.perf_counter()
        groups, metrics, _ = trainer.collect(state.params, None, jax.random.key(step), 0)
        batch = trainer.to_batch(groups, trainer.advantages(groups))
        if flops is None:
            compiled = train_step.lower(state, batch, ref, **kwargs).compile()
            flops = compiled.cost_analysis()["flops"]
        update_start = time.perf_counter()
        state, update = train_step(state, batch, ref, **kwargs)
        jax.block_until_ready(update)
        end = time.perf_counter()
        rows.append(
            dict(
                total=end - start,
                rollout=metrics["time/rollout"],
                reward=metrics["time/reward"],
                update=end - update_start,
                tokens=int(groups.lengths.sum()),
            )
        )
    first, timed = rows[0], rows[1:]
    median = {key: statistics.median(r[key] for r in timed) for key in timed[0]}
    peak = matmul_peak_flops(dtype=jnp.dtype(args.dtype))
    achieved = flops / median["update"]
    model = trainer.model_config
    print(
        f"GRPO step: preset {args.preset} ({model.num_params / 1e6:.1f}M params), "
        f"{args.prompts} prompts x G={args.generations}, up to {args.new_tokens} new tokens, "
        f"{args.minibatches} minibatch(es), beta={args.beta}; {jax.devices()[0].platform}, "
        f"median of {args.steps} steps after one compile step ({first['total']:.1f} s)\n"
    )
    print("| stage | seconds | share |")
    print("|---|---|---|")
    for key in ("rollout", "reward", "update"):
        print(f"| {key} | {median[key]:.3f} | {median[key] / median['total']:.0%} |")
    print(f"| step | {median['total']:.3f} | |\n")
    print(f"completion tokens/step (median): {median['tokens']:.0f}")
    print(f"completion tokens/s: {median['tokens'] / median['total']:.0f}")
    print(f"update FLOPs (XLA cost analysis): {flops / 1e9:.2f} GFLOP")
    print(
        f"update achieved {achieved / 1e9:.2f} GFLOP/s = {achieved / peak:.1%} of the "
        f"measured {args.dtype} matmul peak {peak / 1e9:.1f} GFLOP/s (the update's MFU)"
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("rollout", "models", "scaling", "memory"):
        script = SCRIPTS / f"benchmark_{argv[0]}.py"
        sys.argv = [str(script), *argv[1:]]
        sys.path.insert(0, str(SCRIPTS))
        runpy.run_path(str(script), run_name="__main__")
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("step",))
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--minibatches", type=int, default=1)
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    np.set_printoptions(precision=3)
    benchmark_step(args)


if __name__ == "__main__":
    main()
