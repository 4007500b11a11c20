"""`jgrpo.plan`'s predicted peak memory per device next to the peak a real run reaches.

    python scripts/benchmark_memory.py [CONFIG.yaml] [key=value ...] [--steps 2]

Plans the config (the programs compiled ahead of time for its mesh, nothing run), then trains
`--steps` steps of it in the same process and reads each device's `peak_bytes_in_use` from the
runtime. Prints both per phase and their ratio. Needs an accelerator: XLA's CPU client keeps no
memory statistics, so on CPU only the plan is printed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import jax


def main(argv: list[str] | None = None) -> int:
    from jgrpo.cli import parse_args
    from jgrpo.config import DEMO_OVERRIDES, load_config
    from jgrpo.plan import plan_memory
    from jgrpo.setup import Setup
    from jgrpo.train import train

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    path, overrides = parse_args(rest)
    if path is None:
        overrides = [*DEMO_OVERRIDES, *overrides]
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [
            *overrides,
            f"train.steps={args.steps}",
            "train.eval_every=0",
            "train.export=false",
            "train.progress=false",
            f"train.run_dir={run_dir}",
        ]
        config = load_config(path, overrides)
        plan = plan_memory(Setup(config), ())
        print(plan.report())
        stats = jax.local_devices()[0].memory_stats()
        if not stats:
            print(f"\n{jax.default_backend()}: the runtime keeps no memory statistics; run this")
            print("on a GPU or TPU for the measured peak.")
            return 0
        train(config)
    measured = max(d.memory_stats()["peak_bytes_in_use"] for d in jax.local_devices())
    gib = 1024**3
    print("\n| | GiB per device |")
    print("|---|---|")
    print(f"| planned peak (jgrpo.plan) | {plan.peak / gib:.3f} |")
    print(f"| measured peak ({args.steps} steps, peak_bytes_in_use) | {measured / gib:.3f} |")
    print(f"| measured / planned | {measured / plan.peak:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
