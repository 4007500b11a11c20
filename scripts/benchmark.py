"""jgrpo benchmarks. Modes:

    python scripts/benchmark.py step [--preset tiny] [--prompts 16] [--generations 16] ...
    python scripts/benchmark.py rollout [...]   # = scripts/benchmark_rollout.py [...]
    python scripts/benchmark.py models [...]    # = scripts/benchmark_models.py [...]
    python scripts/benchmark.py scaling [...]   # = scripts/benchmark_scaling.py [...]
    python scripts/benchmark.py memory [...]    # = scripts/benchmark_memory.py [...]
    python scripts/benchmark.py compare [...]   # = scripts/benchmark_compare.py [...]
    python scripts/benchmark.py padding [...]   # = scripts/benchmark_padding.py [...]
    python scripts/benchmark.py products [...]  # = scripts/benchmark_products.py [...]
    python scripts/benchmark.py lora [...]      # = scripts/benchmark_lora.py [...]
    python scripts/benchmark.py experts [...]   # = scripts/benchmark_experts.py [...]

`step` times full GRPO steps of the trainer (`jgrpo.train.Trainer`, the addition task, a
randomly initialised preset): rollout, reward and update apart, completion tokens/s, and the
update's achieved FLOP/s (FLOPs counted from the shapes, `forward_flops`, over its time) as
a fraction of a matmul peak measured in the same run on the same device in the model's dtype
(`--dtype`): the update's model FLOPs utilisation. Compilation is the first step, reported
apart. `--profile DIR` then runs one more step, untimed, under the JAX profiler and writes its
trace to DIR (for TensorBoard's profile plugin; the .trace.json.gz opens in ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import runpy
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

SCRIPTS = Path(__file__).resolve().parent
# Modes that run their own script, benchmark_MODE.py.
MODES = (
    "rollout",
    "models",
    "scaling",
    "memory",
    "compare",
    "padding",
    "products",
    "lora",
    "experts",
)
# A randomly initialised preset on the addition task: prompts of up to 8 characters.
ADDITION_PROMPTS = ("task.max_operand=999", "rollout.max_prompt_length=16")


def matmul_peak_flops(size: int | None = None, repeats: int = 5, dtype=jnp.float32) -> float:
    """FLOP/s of one jitted [size, size] @ [size, size] in `dtype`, summed in f32 (as the
    model's products are), best of `repeats`; the default size is 2048 on CPU and 8192 on
    accelerators (smaller ones do not fill a GPU)."""
    if size is None:
        size = 2048 if jax.default_backend() == "cpu" else 8192
    matmul, a = _square_matmul(size, jnp.dtype(dtype))
    best = min(_timed(lambda: matmul(a).block_until_ready()) for _ in range(repeats))
    return 2 * size**3 / best


@functools.cache
def _square_matmul(size: int, dtype):
    """The compiled [size, size] product and its operand, made once per process, so that
    measuring the peak again between steps compiles nothing."""
    a = jax.random.normal(jax.random.key(0), (size, size), dtype)
    matmul = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
    matmul(a).block_until_ready()
    return matmul, a


def forward_flops(
    config, rows: int, length: int, scored: int, shared_prompt_rows: int = 1
) -> float:
    """Matmul FLOPs of one training forward over `rows` sequences of `length` tokens, of which
    the last `scored` are scored through the unembedding (the chunked log-probs).

    Counted from the shapes, as MFU is usually defined (PaLM's appendix B): 2 FLOPs per
    weight per token, plus attention's two products over all `length` keys. With
    `shared_prompt_rows` = G > 1 (`jgrpo.UpdateConfig`), the forward the update runs: each
    prompt's `length - scored` tokens once per G rows, attending over the prompt's keys.
    XLA's cost analysis cannot be used: it counts a scanned layer stack's body once, not once
    per layer. A backward pass costs twice its forward, so an update is 3x this.
    """
    e, m, d = config.hidden_size, config.intermediate_size, config.head_dim
    h, kv = config.num_heads, config.num_kv_heads
    per_layer = e * h * d * 2 + e * kv * d * 2 + 3 * e * m  # q, o, k, v, gate, up, down
    per_key = 2 * 2 * h * d  # q k^T and p v, per token, key and layer
    if shared_prompt_rows > 1:
        prompt_length = length - scored
        prompt_tokens = rows // shared_prompt_rows * prompt_length
        layers = prompt_tokens * (2 * per_layer + per_key * prompt_length) + rows * scored * (
            2 * per_layer + per_key * length
        )
    else:
        layers = rows * length * (2 * per_layer + per_key * length)
    return config.num_layers * layers + rows * scored * 2 * e * config.vocab_size


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
            *ADDITION_PROMPTS,
            f"rollout.prompts_per_step={args.prompts}",
            f"rollout.num_generations={args.generations}",
            f"rollout.max_new_tokens={args.new_tokens}",
            f"algorithm.num_minibatches={args.minibatches}",
            f"algorithm.beta={args.beta}",
        ],
    )
    trainer = Trainer(config)
    if args.full_length:  # every completion runs to --new-tokens: no stop tokens
        trainer.sampling = dataclasses.replace(trainer.sampling, stop_token_ids=())
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

    def step(state, index):
        nonlocal flops
        start = time.perf_counter()
        groups, metrics, _ = trainer.collect(state.params, None, jax.random.key(index), 0)
        batch = trainer.to_batch(groups, trainer.advantages(groups))
        if flops is None:  # forward + backward, and the reference forward when beta > 0
            forward = forward_flops(
                trainer.model_config,
                *batch.input_ids.shape,
                args.new_tokens,
                trainer.update_config.shared_prompt_rows,
            )
            flops = forward * (3 + (args.beta > 0))
        update_start = time.perf_counter()
        state, update = train_step(state, batch, ref, **kwargs)
        jax.block_until_ready(update)
        end = time.perf_counter()
        row = dict(
            total=end - start,
            rollout=metrics["time/rollout"],
            reward=metrics["time/reward"],
            update=end - update_start,
            tokens=int(groups.lengths.sum()),
        )
        return state, row

    for index in range(args.steps + 1):
        state, row = step(state, index)
        rows.append(row)
    if args.profile:
        with jax.profiler.trace(args.profile, create_perfetto_trace=True):
            step(state, args.steps + 1)
        print(f"profiled one more step into {args.profile}")
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
    print(f"update FLOPs (from the shapes, padding included): {flops / 1e9:.2f} GFLOP")
    print(
        f"update achieved {achieved / 1e9:.2f} GFLOP/s = {achieved / peak:.1%} of the "
        f"measured {args.dtype} matmul peak {peak / 1e9:.1f} GFLOP/s (the update's MFU)"
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in MODES:
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
    parser.add_argument(
        "--full-length", action="store_true", help="block the stop tokens: N tokens per row"
    )
    parser.add_argument(
        "--profile", metavar="DIR", help="then trace one more step with the JAX profiler into DIR"
    )
    args = parser.parse_args(argv)
    np.set_printoptions(precision=3)
    benchmark_step(args)


if __name__ == "__main__":
    main()
