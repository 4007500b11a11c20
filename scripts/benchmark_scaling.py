"""Weak scaling of the GRPO update: the same rows per device on 1, 2, 4, ... devices.

    python scripts/benchmark_scaling.py [--preset tiny] [--devices 1,2,4,8] [--rows-per-device 16]

Each device count runs in a fresh process on the first n devices (`mesh.devices`; on a CPU
host, n of XLA's virtual devices: `--xla_force_host_platform_device_count`), the parameters
and Adam's state sharded over `fsdp` by the trainer's own jitted update
(`jgrpo.train.Trainer.update`). The batch has
`rows-per-device x devices` rows of full-length completions, so every device does the same work
at every count; perfect weak scaling keeps the step time constant. Printed: the median step
time, rows per second, the efficiency t(1) / t(n), and n x t(1) / t(n): the efficiency when
the devices share a fixed amount of compute (virtual CPU devices), where 1.0 means that
splitting the work over n devices costs nothing beyond the work itself.

On a CPU host the virtual devices share the host's cores: with more devices than cores the
time grows with the device count whatever the program does, so the figures there measure the
overhead of partitioning and collectives; the meaningful run is on accelerators.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def measure(args: argparse.Namespace) -> dict:
    """One device count, in this process (XLA_FLAGS was set by the parent)."""
    import jax
    import numpy as np

    from jgrpo.config import load_config
    from jgrpo.train import Trainer
    from jgrpo.update import Batch

    devices = args.count
    rows = args.rows_per_device * devices
    config = load_config(
        None,
        [
            f"model.preset={args.preset}",
            f"rollout.prompts_per_step={rows}",
            "rollout.num_generations=2",
            f"rollout.max_new_tokens={args.new_tokens}",
            f"rollout.max_prompt_length={args.prompt_tokens}",
            "task.reward_workers=0",
            "mesh.fsdp=-1",
            f"mesh.devices={devices}",
        ],
    )
    trainer = Trainer(config)
    rng = np.random.default_rng(0)
    length = args.prompt_tokens + args.new_tokens
    vocab = trainer.model_config.vocab_size
    completion = np.ones((rows, args.new_tokens), bool)  # every completion full length

    def batch() -> Batch:
        host = Batch(
            input_ids=rng.integers(1, vocab, (rows, length), dtype=np.int32),
            attention_mask=np.ones((rows, length), np.int32),
            completion_mask=completion,
            advantages=rng.standard_normal(rows).astype(np.float32),
        )
        shardings = Batch(trainer.row_matrix, trainer.row_matrix, trainer.row_matrix, trainer.rows)
        return jax.device_put(host, shardings)

    state = trainer.initial_state(trainer.initial_params())
    times = []
    for step in range(args.steps + 1):
        inputs = batch()
        start = time.perf_counter()
        state, update = trainer.update(state, inputs, None)
        jax.block_until_ready(update)
        if step:  # the first call compiles
            times.append(time.perf_counter() - start)
    return {"devices": devices, "rows": rows, "seconds": statistics.median(times)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--devices", default="1,2,4,8", help="device counts, comma-separated")
    parser.add_argument("--rows-per-device", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.count:
        print(json.dumps(measure(args)))
        return

    results = []
    for count in (int(n) for n in args.devices.split(",")):
        env = {
            **os.environ,
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={count}",
        }
        command = [sys.executable, __file__, f"--count={count}", *(argv or sys.argv[1:])]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode:
            sys.exit(f"{count} devices failed:\n{done.stderr[-3000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))

    base = results[0]
    print(
        f"Weak scaling of the update: preset {args.preset}, {args.rows_per_device} rows per "
        f"device of {args.prompt_tokens} + {args.new_tokens} tokens, fsdp over all devices, "
        f"median of {args.steps} steps after the compile\n"
    )
    print("| devices | rows | step s | rows/s | efficiency t(1)/t(n) | n x t(1)/t(n) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        ratio = base["seconds"] / r["seconds"]
        print(
            f"| {r['devices']} | {r['rows']} | {r['seconds']:.3f} | "
            f"{r['rows'] / r['seconds']:.1f} | {ratio:.2f} | "
            f"{r['devices'] / base['devices'] * ratio:.2f} |"
        )


if __name__ == "__main__":
    main()
