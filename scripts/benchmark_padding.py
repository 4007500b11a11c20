"""The update on completions of spread lengths: padded, trimmed, packed, measured side by side.

    python scripts/benchmark.py padding [--model tiny] [--lengths 8:40] [--calls 3]
    python scripts/benchmark.py padding model.preset=qwen2.5-0.5b [--lengths 64:320] [key=value ...]

By default the compare workload's model and batch (`compare_workload.py`: 4 prompts x G = 8,
64 new tokens, beta 0.04, f32). With a `model.preset=NAME` override, that preset randomly
initialised on the addition task's prompts (as `benchmark.py step`), with random rewards, so
that a recipe's shapes can be measured on an accelerator. `key=value` overrides set the shapes
(`rollout.max_new_tokens=512`, `algorithm.grad_accumulation=4`, `model.remat=true`, ...) in
either case. Each completion is cut to a length drawn uniformly from `--lengths` (a fixed seed;
by default 1/8 to 5/8 of `rollout.max_new_tokens`). One update program (`train_step`, with the
reference pass when beta > 0) per setting, each on the batch the trainer makes for it:

- padded: every completion padded to `max_new_tokens` (the defaults);
- trimmed: `algorithm.completion_buckets=4`, the narrowest of 4 widths that holds the
  longest completion;
- packed: `algorithm.pack_completions=true`, each group's completions in the fewest rows
  that hold them;
- both: the two options together (the width whose packed rows hold the fewest slots).

Calls alternate between the settings (the first of each is not timed), so a slow phase of
the host hits them alike. Prints each setting's width, packed rows, median time and ratio to
the padded update, and the metrics, which must agree up to rounding.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

import compare_workload as workload  # noqa: E402
from benchmark import ADDITION_PROMPTS  # noqa: E402
from benchmark_compare import jgrpo_config, jgrpo_task  # noqa: E402

SETTINGS = {
    "padded": {},
    "trimmed": {"completion_buckets": 4},
    "packed": {"pack_completions": True},
    "both": {"completion_buckets": 4, "pack_completions": True},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(workload.ARCHITECTURES))
    parser.add_argument("--lengths", help="LOW:HIGH completion tokens, uniform")
    parser.add_argument("--calls", type=int, default=3, help="timed calls per setting")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default="/tmp/jgrpo-compare", help="where the checkpoint is")
    parser.add_argument(
        "overrides", nargs="*", help="key=value config overrides (model.preset=NAME: a preset)"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jgrpo.config import load_config
    from jgrpo.train import Trainer

    presets = [o.split("=", 1)[1] for o in args.overrides if o.startswith("model.preset=")]
    if presets:  # a randomly initialised preset on the config's task: addition
        model_name, task = presets[-1], None
        base = load_config(None, [*ADDITION_PROMPTS, "mesh.devices=1", *args.overrides])
    else:
        model_name, task = args.model, jgrpo_task()
        checkpoint = workload.build_checkpoint(Path(args.workdir) / args.model, args.model)
        base = jgrpo_config(checkpoint, 1, overrides=tuple(args.overrides))
    new_tokens = base.rollout.max_new_tokens
    low, high = (
        (max(1, new_tokens // 8), 5 * new_tokens // 8)
        if args.lengths is None
        else (int(part) for part in args.lengths.split(":"))
    )
    if not 1 <= low <= high <= new_tokens:
        parser.error(f"--lengths must be LOW:HIGH with 1 <= LOW <= HIGH <= {new_tokens}")
    trainers = {
        name: Trainer(
            dataclasses.replace(base, algorithm=dataclasses.replace(base.algorithm, **options)),
            task,
        )
        for name, options in SETTINGS.items()
    }
    padded = trainers["padded"]
    padded.sampling = dataclasses.replace(padded.sampling, stop_token_ids=())  # full rows
    params = padded.initial_params()
    reference = padded.reference_params(params)
    state = padded.initial_state(params)
    groups, _, _ = padded.collect(params, reference, jax.random.key(args.seed), 0)
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(low, high + 1, len(groups.mask))
    if presets:  # random weights earn no addition reward: random rewards, so gradients are real
        groups.rewards[:] = rng.random(len(groups.rewards))
    groups.mask[:] = np.arange(groups.mask.shape[1])[None] < lengths[:, None]
    groups.tokens[~groups.mask] = padded.sampling.pad_token_id
    advantages = padded.advantages(groups)

    runs = {}
    for name, trainer in trainers.items():
        width, rows = trainer.update_shape(groups)
        batch = trainer.to_batch(groups, advantages, width, rows)
        runs[name] = (width, rows, trainer.update, batch)
    times = {name: [] for name in runs}
    metrics = {}
    for call in range(args.calls + 1):
        order = list(runs) if call % 2 == 0 else list(reversed(runs))
        for name in order:
            _, _, update, batch = runs[name]
            fresh = jax.block_until_ready(jax.tree.map(jnp.copy, state))  # donated
            start = time.perf_counter()
            _, result = jax.block_until_ready(update(fresh, batch, reference))
            if call:  # the first call compiles
                times[name].append(time.perf_counter() - start)
            metrics[name] = {key: float(np.ravel(value)[0]) for key, value in result.items()}

    rollout = base.rollout
    print(
        f"GRPO update ({'reference pass, ' if reference is not None else ''}forward, "
        f"backward, AdamW), {model_name}, {jax.devices()[0].platform}, "
        f"{rollout.prompts_per_step} prompts x G={rollout.num_generations}, {new_tokens} new "
        f"tokens; completion lengths uniform in [{low}, {high}] (mean {lengths.mean():.1f}, "
        f"longest {lengths.max()}); medians of {args.calls} calls after the first\n"
    )
    print("| setting | width | packed rows | update | / padded |")
    print("|---|---|---|---|---|")
    padded_s = statistics.median(times["padded"])
    for name, (width, rows, _, _) in runs.items():
        median = statistics.median(times[name])
        packed = "-" if rows is None else f"{rows} of {rollout.num_generations}"
        print(f"| {name} | {width} | {packed} | {median:.4f} s | {median / padded_s:.2f} |")
    print()
    for key in ("loss", "grad_norm", "entropy", "kl_mean"):
        if key in metrics["padded"]:
            print(f"{key}: " + ", ".join(f"{name} {metrics[name][key]:.7g}" for name in metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
