"""What a mixture-of-experts layer sends between devices: expert parallelism against FSDP.

    python scripts/benchmark.py experts [--shape qwen3-30b-a3b] [--fsdp 8] [--tokens 4096]

One MoE layer of the preset's shape (router and experts, bf16), its forward and backward
pass over `--tokens` tokens split over an fsdp mesh of `--fsdp` devices, is compiled twice
(nothing runs, so the real shapes fit on any host): with the rules table as it is, whole
experts on each device and the tokens gathered to them (`jgrpo.sharding.LOGICAL_RULES`), and
with the `expert` rule taken out, the experts split by `embed` as a dense MLP's weights are
(what FSDP does: every expert gathered where the layer runs). Printed: the bytes each device
receives from every collective of the compiled program (the sizes of their results), side
by side. On a CPU host the devices are XLA's virtual ones
(`--xla_force_host_platform_device_count`).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
DTYPE_BYTES = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "pred": 1}


def collective_bytes(program: str) -> dict[str, int]:
    """Bytes of the results of each kind of collective in a compiled program's HLO text."""
    totals = dict.fromkeys(COLLECTIVES, 0)
    for kind in COLLECTIVES:
        pattern = r"= (\w+)\[([\d,]*)\]\S* " + kind + r"(?:-start)?\("
        for dtype, dims in re.findall(pattern, program):
            count = 1
            for size in filter(None, dims.split(",")):
                count *= int(size)
            totals[kind] += count * DTYPE_BYTES[dtype]
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", help="a mixture-of-experts preset")
    parser.add_argument("--fsdp", type=int, default=8, help="devices in the fsdp mesh axis")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the batch")
    args = parser.parse_args()
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.fsdp}"

    import jax
    import jax.numpy as jnp

    from jgrpo.models.config import preset
    from jgrpo.models.mlp import mixture_of_experts
    from jgrpo.models.transformer import layer_param_specs
    from jgrpo.sharding import (
        LOGICAL_RULES,
        abstract_arrays,
        logical_sharding,
        make_mesh,
        rules_context,
        tree_shardings,
    )

    config = preset(args.shape)
    if not config.num_experts:
        parser.error(f"--shape {args.shape} is not a mixture of experts")
    if args.tokens % args.fsdp:
        parser.error(f"--tokens {args.tokens} must be divisible by --fsdp {args.fsdp}")
    names = ("router", "expert_gate_kernel", "expert_up_kernel", "expert_down_kernel")
    specs = {name: layer_param_specs(config)[name] for name in names}
    mesh = make_mesh((1, args.fsdp, 1), jax.devices()[: args.fsdp])
    batch = (args.fsdp, args.tokens // args.fsdp, config.hidden_size)  # a row per device

    def squared(params, h):
        out, _ = mixture_of_experts(config, params, h)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    placements = {
        "whole experts per device (expert parallelism)": LOGICAL_RULES,
        "experts split by embed (FSDP)": tuple(r for r in LOGICAL_RULES if r[0] != "expert"),
    }
    results = {}
    for label, rules in placements.items():
        with rules_context(mesh, rules):
            axes = {name: names for name, (_, names) in specs.items()}
            shapes = {
                name: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
                for name, (shape, _) in specs.items()
            }
            params = abstract_arrays(shapes, tree_shardings(shapes, axes, mesh, rules))
            h = jax.ShapeDtypeStruct(
                batch,
                jnp.bfloat16,
                sharding=logical_sharding(batch, ("batch", "length", "embed"), mesh, rules),
            )
            gradient = jax.jit(jax.grad(squared, argnums=(0, 1)))
            results[label] = collective_bytes(gradient.lower(params, h).compile().as_text())

    print(
        f"One {args.shape} MoE layer ({config.num_experts} experts of "
        f"{config.moe_intermediate_size}, {config.experts_per_token} per token, bf16), forward "
        f"and backward over {args.tokens} tokens on fsdp={args.fsdp}: MiB each device receives "
        "from the collectives of the compiled program\n"
    )
    kinds = [kind for kind in COLLECTIVES if any(r[kind] for r in results.values())]
    print(f"| experts | {' | '.join(kinds)} | total | vs expert parallelism |")
    print(f"|---|{'---|' * len(kinds)}---|---|")
    first = sum(next(iter(results.values())).values())
    for label, totals in results.items():
        cells = " | ".join(f"{totals[kind] / 2**20:.1f}" for kind in kinds)
        total = sum(totals.values())
        print(f"| {label} | {cells} | {total / 2**20:.1f} | {total / first:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
