"""Full fine-tuning against LoRA: the update's memory from its compiled programs, its step time,
and a decode step with the adapters merged or not.

    python scripts/benchmark_lora.py --preset smollm2-135m --rank 16 --repeats 3
    python scripts/benchmark_lora.py --preset qwen2.5-1.5b --rank 16 --memory-only
    python scripts/benchmark_lora.py --learning --steps 40

One GRPO update (`jgrpo.train_step`: reference pass, forward, backward, AdamW; beta 0.04,
f32) on `--prompts` x `--generations` rows of `--prompt-length` + `--new-tokens` tokens,
compiled for one device. Memory: XLA's memory analysis of the compiled update, its arguments
(parameters or adapters, optimizer state, the reference or the frozen base, the batch) and its
temporaries. Time: medians of `--repeats` calls after a compile call, on random weights of the
preset's shapes (its full vocabulary). Then one decode step (`jgrpo.models.forward` with a KV
cache, the rows of the update) with the adapters merged into the weights, as the rollout
samples, and unmerged (`with_adapters`), and the merge itself.

`--learning`: what LoRA learns per step next to full fine-tuning from the same checkpoint.
The CPU demo's model (addition of 0-4, from scratch) is first trained `--warmup-steps` steps
in full and exported; then `--steps` steps of the demo continue from that checkpoint with full
fine-tuning and with LoRA (rank `--rank`), each at its own learning rate, and their rewards and
greedy accuracy are printed side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

MIB = 2**20


def timed(function, *args, repeats: int) -> float:
    """Median seconds of `repeats` calls after one compile call."""
    jax.block_until_ready(function(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(function(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    from flax import nnx

    from jgrpo.models import Transformer, forward, init_cache, preset
    from jgrpo.models.lora import LoraConfig, init_adapters, merge_adapters, with_adapters
    from jgrpo.update import Batch, UpdateConfig, init_state, make_optimizer, train_step

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory-only", action="store_true", help="compile, do not run")
    parser.add_argument(
        "--lora-only", action="store_true", help="run LoRA alone (full fine-tuning too big)"
    )
    parser.add_argument("--learning", action="store_true", help="rewards per step instead")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup-steps", type=int, default=150)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.learning:
        return learning(args)

    config = preset(args.preset)
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
    rows, length = args.prompts * args.generations, args.prompt_length + args.new_tokens
    optimizer = make_optimizer(1e-5, total_steps=10)

    def model_params():
        return Transformer(config, rngs=nnx.Rngs(0)).params()

    def adapters_of(key):
        fresh = init_adapters(config, lora, key)  # B = 0: give B values, as after training
        return {
            "layers": {
                kernel: {"a": parts["a"], "b": parts["b"] + 1e-3}
                for kernel, parts in fresh["layers"].items()
            }
        }

    rng = np.random.default_rng(0)
    ids = rng.integers(3, config.vocab_size, (rows, length)).astype(np.int32)
    completion = np.ones((rows, args.new_tokens), bool)
    batch = Batch(
        input_ids=jnp.asarray(ids),
        attention_mask=jnp.ones((rows, length), jnp.int32),
        completion_mask=jnp.asarray(completion),
        advantages=jnp.asarray(rng.standard_normal(rows), jnp.float32),
    )
    full_config = UpdateConfig(beta=0.04, shared_prompt_rows=args.generations)
    lora_config = UpdateConfig(
        beta=0.04, shared_prompt_rows=args.generations, lora_scale=lora.scale
    )

    def full_update(state, batch, reference):
        return train_step.__wrapped__(
            state,
            batch,
            reference,
            model_config=config,
            update_config=full_config,
            optimizer=optimizer,
        )

    def lora_update(state, batch, base):
        return train_step.__wrapped__(
            state,
            batch,
            None,
            base,
            model_config=config,
            update_config=lora_config,
            optimizer=optimizer,
        )

    fresh_state = jax.jit(lambda p: init_state(p, optimizer))  # the update donates its state

    def time_update(update, *, full: bool) -> float:
        """Seconds of one update; its arrays are freed on return (before the decode part)."""
        params = model_params()
        start = params if full else adapters_of(jax.random.key(1))
        reference = jax.tree.map(jnp.copy, params) if full else params
        return timed(lambda: update(fresh_state(start), batch, reference)[1], repeats=args.repeats)

    params_shape = jax.eval_shape(model_params)
    adapters_shape = jax.eval_shape(adapters_of, jax.random.key(0))
    programs = {}
    for name, update, trained in (
        ("full fine-tuning", full_update, params_shape),
        (f"LoRA r={args.rank}", lora_update, adapters_shape),
    ):
        state = jax.eval_shape(lambda p: init_state(p, optimizer), trained)
        compiled = jax.jit(update, donate_argnums=0).lower(state, batch, params_shape).compile()
        programs[name] = (jax.jit(update, donate_argnums=0), trained, compiled.memory_analysis())

    def size(tree) -> int:
        return sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))

    print(
        f"{args.preset} ({size(params_shape) / MIB:.0f} MiB f32), {rows} rows of "
        f"{args.prompt_length} + {args.new_tokens} tokens, one update on {jax.devices()[0]}:"
    )
    print("\n| update | trained | optimizer state | reference / base | temporaries | total | s |")
    print("|---|---|---|---|---|---|---|")
    for name, (update, trained, memory) in programs.items():
        trained_bytes = size(trained)
        optimizer_bytes = size(jax.eval_shape(optimizer.init, trained))
        total = memory.argument_size_in_bytes + memory.temp_size_in_bytes
        seconds = ""
        if not args.memory_only and not (args.lora_only and trained is params_shape):
            seconds = f"{time_update(update, full=trained is params_shape):.2f}"
        print(
            f"| {name} | {trained_bytes / MIB:.1f} MiB | {optimizer_bytes / MIB:.1f} MiB | "
            f"{size(params_shape) / MIB:.1f} MiB | {memory.temp_size_in_bytes / MIB:.1f} MiB | "
            f"{total / MIB:.1f} MiB | {seconds} |"
        )
    if args.memory_only:
        return 0

    # A decode step as the rollout runs it, merged (one copy per rollout), or unmerged.
    params = model_params()
    adapters = adapters_of(jax.random.key(1))
    cache = init_cache(config, rows, length)
    prefill = jax.jit(lambda p, c: forward(p, batch.input_ids[:, :-1], cache=c, config=config))
    _, cache = prefill(params, cache)
    token = batch.input_ids[:, -1:]

    @jax.jit
    def step(model, cache):
        return forward(model, token, cache=cache, config=config)[0]

    merge = jax.jit(lambda base, adapters: merge_adapters(base, adapters, lora.scale))
    merged = merge(params, adapters)
    unmerged = with_adapters(params, adapters, lora.scale)
    merged_s = timed(step, merged, cache, repeats=max(args.repeats, 5))
    unmerged_s = timed(step, unmerged, cache, repeats=max(args.repeats, 5))
    merge_s = timed(merge, params, adapters, repeats=args.repeats)
    print(f"\n| decode step, {rows} rows, cache {length} | ms | vs merged |")
    print("|---|---|---|")
    print(f"| adapters merged (the rollout) | {merged_s * 1e3:.2f} | 1.00 |")
    print(f"| adapters unmerged | {unmerged_s * 1e3:.2f} | {unmerged_s / merged_s:.2f} |")
    print(f"| the merge, once per rollout | {merge_s * 1e3:.2f} | {merge_s / merged_s:.2f} |")
    return 0


LEARNING_RUNS = (  # name, overrides on the demo continued from the warmed-up checkpoint
    ("full fine-tuning, lr 1e-3 (the demo's)", ["optim.lr=1e-3"]),
    ("LoRA, lr 3e-3", ["optim.lr=3e-3"]),
    ("LoRA, lr 1e-2", ["optim.lr=1e-2"]),
)


def learning(args) -> int:
    from jgrpo.config import DEMO_OVERRIDES, load_config
    from jgrpo.metrics import read_metrics
    from jgrpo.train import train

    quiet = ["train.progress=false", "train.tensorboard=false", "task.reward_workers=0"]
    with tempfile.TemporaryDirectory() as tmp:
        warm = load_config(
            None,
            [*DEMO_OVERRIDES, *quiet, f"train.steps={args.warmup_steps}", "train.eval_every=0"]
            + [f"train.run_dir={tmp}/warm"],
        )
        train(warm)  # exported to tmp/warm/hf
        print(
            f"the CPU demo's model after {args.warmup_steps} steps of full fine-tuning, then "
            f"{args.steps} more steps each way (means over the first and last 10 steps; "
            "accuracy: greedy, all 25 problems, at the end):\n"
        )
        print("| continued with | reward/correct first 10 | last 10 | eval/accuracy |")
        print("|---|---|---|---|")
        for index, (name, overrides) in enumerate(LEARNING_RUNS):
            lora = [f"model.lora_rank={args.rank}"] if name.startswith("LoRA") else []
            run_dir = f"{tmp}/run{index}"
            config = load_config(
                None,
                [*DEMO_OVERRIDES, *quiet, f"model.path={tmp}/warm/hf", *overrides, *lora]
                + [f"train.steps={args.steps}", f"train.eval_every={args.steps}"]
                + ["train.export=false", f"train.run_dir={run_dir}"],
            )
            train(config)
            lines = read_metrics(run_dir)
            first = statistics.mean(line["reward/correct/mean"] for line in lines[:10])
            last = statistics.mean(line["reward/correct/mean"] for line in lines[-10:])
            label = name.replace("LoRA", f"LoRA r={args.rank}")
            print(f"| {label} | {first:.3f} | {last:.3f} | {lines[-1]['eval/accuracy']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
