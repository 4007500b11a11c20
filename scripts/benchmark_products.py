"""The compare workload's products, each timed alone: how near jgrpo runs to XLA's kernels.

    python scripts/benchmark.py products [--model tiny] [--steps 3] [--repeats 5] [key=value ...]

Runs the workload of `benchmark.py compare` (`compare_workload.py`: 4 prompts x G = 8, 64 new
tokens, beta 0.04, f32) through the trainer's `Trainer.step`, as the compare does, and times
its rollout and update (medians of `--steps` steps after the first). Then it lists every
`dot_general` the two programs run, from their jaxprs: the update's (the reference pass, the
policy's forward and backward) with a scanned layer's products counted once per layer, the
rollout's (the prefill, then each decode step's products counted once per step of the decode
loop's phases). Each distinct product is compiled as a program of its own and timed alone:

- warm: the same operands every call, so they stay in the caches;
- cold: the larger operand cycled through copies that together exceed `--cold-mib`, so each
  call reads it from memory, as a decode step reads each layer's weights.

A program's products alone (warm) is the time it would take with every product at XLA's own
rate for its shapes and everything else (softmax, norms, attention's masking, copies, the
decode loop) free: the floor of this workload with these kernels on this host. (For the tiny
model's products, each call's dispatch takes longer than the product, so its sums say nothing.)
The GFLOP/s column is the products' FLOPs over the whole program's time. `key=value`
overrides change the workload (`rollout.weights_dtype=bfloat16`, ...). The script runs in the
environment `python -m jgrpo.train` gives itself (`jgrpo.huge_pages`), as the compare does.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

import compare_workload as workload  # noqa: E402
from benchmark_compare import jgrpo_config, jgrpo_task  # noqa: E402


class Product(NamedTuple):
    """One `dot_general`'s operand shapes and dtypes and its parameters."""

    lhs_shape: tuple[int, ...]
    lhs_dtype: str
    rhs_shape: tuple[int, ...]
    rhs_dtype: str
    dimension_numbers: tuple
    preferred_element_type: str | None

    @property
    def flops(self) -> int:
        """2 x the output's size x the contracted size."""
        (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = self.dimension_numbers
        contract = math.prod(self.lhs_shape[i] for i in lhs_contract)
        batch = math.prod(self.lhs_shape[i] for i in lhs_batch)
        lhs_free = math.prod(
            n for i, n in enumerate(self.lhs_shape) if i not in (*lhs_contract, *lhs_batch)
        )
        rhs_free = math.prod(
            n for i, n in enumerate(self.rhs_shape) if i not in (*rhs_contract, *rhs_batch)
        )
        return 2 * batch * lhs_free * rhs_free * contract

    def label(self) -> str:
        (lc, rc), (lb, rb) = self.dimension_numbers
        batch = f", batch {list(lb)}x{list(rb)}" if lb else ""
        shapes = f"{list(self.lhs_shape)} . {list(self.rhs_shape)}"
        return f"{shapes} (contract {list(lc)}x{list(rc)}{batch})"


def count_products(jaxpr, loop_trips: list[int]) -> collections.Counter[Product]:
    """How often each product runs in `jaxpr`: a scan's body once per iteration, the body of
    the i-th `while` loop (in program order) `loop_trips[i]` times."""
    counts: collections.Counter[Product] = collections.Counter()
    trips = iter(loop_trips)

    def walk(jaxpr, times: int) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == "dot_general":
                lhs, rhs = eqn.invars
                preferred = eqn.params.get("preferred_element_type")
                product = Product(
                    tuple(lhs.aval.shape),
                    str(lhs.aval.dtype),
                    tuple(rhs.aval.shape),
                    str(rhs.aval.dtype),
                    eqn.params["dimension_numbers"],
                    None if preferred is None else str(preferred),
                )
                counts[product] += times
                continue
            inner = times
            if name == "scan":
                inner = times * eqn.params["length"]
            elif name == "while":
                try:
                    inner = times * next(trips)
                except StopIteration:
                    raise ValueError("a while loop without a trip count in loop_trips") from None
                walk(eqn.params["body_jaxpr"].jaxpr, inner)  # the condition has no products
                continue
            elif name == "cond" and any(
                count_equations(branch.jaxpr, "dot_general") for branch in eqn.params["branches"]
            ):
                raise ValueError("a cond with products: which branch runs is not known")
            for inner_jaxpr in _inner_jaxprs(eqn):
                walk(inner_jaxpr, inner)

    walk(jaxpr, 1)
    if next(trips, None) is not None:
        raise ValueError("fewer while loops than loop_trips")
    return counts


def _inner_jaxprs(eqn):
    """The jaxprs an equation holds (a scan's body, a jit's program, a cond's branches...)."""
    from jax.extend.core import ClosedJaxpr, Jaxpr

    for value in eqn.params.values():
        for sub in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(sub, ClosedJaxpr):
                yield sub.jaxpr
            elif isinstance(sub, Jaxpr):
                yield sub


def count_equations(jaxpr, primitive: str) -> int:
    """How many `primitive` equations `jaxpr` holds, nested ones included (each once)."""
    return sum(
        (eqn.primitive.name == primitive)
        + sum(count_equations(inner, primitive) for inner in _inner_jaxprs(eqn))
        for eqn in jaxpr.eqns
    )


def decode_trips(new_tokens: int, loops: int) -> list[int]:
    """Decode steps in each of the rollout's `loops` while loops when every completion runs
    to `new_tokens` (no stop tokens): token 0 comes from the prefill, and phase k runs the
    steps after the previous phase's end up to its own (`jgrpo.rollout.attention_phases`)."""
    from jgrpo.rollout import attention_phases

    last = new_tokens - 1
    ends = [new_tokens] if loops == 1 else attention_phases(new_tokens)
    if len(ends) != loops:
        raise ValueError(f"the rollout has {loops} while loops, attention_phases {len(ends)}")
    starts = [0, *ends[:-1]]
    return [min(end, last) - start for start, end in zip(starts, ends, strict=True)]


def time_product(product: Product, repeats: int, cold_bytes: int) -> tuple[float, float]:
    """Median seconds of one call of `product` alone: warm (the same operands), and cold
    (the larger operand cycled through copies of at least `cold_bytes` in all); at least
    `repeats` calls of each, and as many as there are copies."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 2)
    lhs = jax.random.normal(keys[0], product.lhs_shape, product.lhs_dtype)
    rhs = jax.random.normal(keys[1], product.rhs_shape, product.rhs_dtype)
    preferred = product.preferred_element_type
    program = jax.jit(
        lambda a, b: jax.lax.dot_general(
            a,
            b,
            product.dimension_numbers,
            preferred_element_type=preferred and jnp.dtype(preferred),
        )
    )
    program(lhs, rhs).block_until_ready()

    def seconds(a, b) -> float:
        start = time.perf_counter()
        program(a, b).block_until_ready()
        return time.perf_counter() - start

    big_is_lhs = lhs.nbytes >= rhs.nbytes
    big = lhs if big_is_lhs else rhs
    copies = [big + 0 for _ in range(max(2, min(64, -(-cold_bytes // big.nbytes))))]
    calls = max(repeats, len(copies))  # as many warm calls as cold ones: medians as steady
    warm = statistics.median(seconds(lhs, rhs) for _ in range(calls))
    cold = []
    for call in range(calls):
        copy = copies[call % len(copies)]
        cold.append(seconds(copy, rhs) if big_is_lhs else seconds(lhs, copy))
    return warm, statistics.median(cold)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(workload.ARCHITECTURES))
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the first")
    parser.add_argument("--repeats", type=int, default=5, help="least timed calls of a product")
    parser.add_argument("--cold-mib", type=int, default=256, help="copies of a cold operand, MiB")
    parser.add_argument("--top", type=int, default=8, help="products listed per program")
    parser.add_argument("--workdir", default="/tmp/jgrpo-compare", help="where the checkpoint is")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    from jgrpo.huge_pages import reexec_with_huge_pages

    reexec_with_huge_pages()  # as `python -m jgrpo.train` starts (returns if not)

    import jax
    import jax.numpy as jnp
    from benchmark import matmul_peak_flops

    from jgrpo.sharding import rules_context
    from jgrpo.train import Trainer

    checkpoint = workload.build_checkpoint(Path(args.workdir) / args.model, args.model)
    config = jgrpo_config(checkpoint, args.steps + 1, overrides=tuple(args.overrides))
    trainer = Trainer(config, jgrpo_task())
    # Exactly max_new_tokens per completion: no stop tokens (benchmark only).
    trainer.sampling = dataclasses.replace(trainer.sampling, stop_token_ids=())
    trainer.compile_update_ahead()
    params = trainer.initial_params()
    reference = trainer.reference_params(params)
    state = trainer.initial_state(params)
    whole = {"rollout": [], "update": []}
    position = 0
    for step in range(args.steps + 1):
        state, metrics, position = trainer.step(state, reference, step, position)
        if step:  # the first compiles
            whole["rollout"].append(metrics["time/rollout"])
            whole["update"].append(metrics["time/update"])

    rollout_config = config.rollout
    prompts, generations = rollout_config.prompts_per_step, rollout_config.num_generations
    prompt_ids = jax.ShapeDtypeStruct((prompts, trainer.prompt_widths["train"]), jnp.int32)
    with rules_context(trainer.mesh):
        rollout_jaxpr = (
            trainer.rollout_program(trainer.sampling, generations)
            .trace(params, prompt_ids, prompt_ids, jax.random.key(0))
            .jaxpr.jaxpr
        )
        update_jaxpr = trainer.update.trace(*trainer.update_arguments()).jaxpr.jaxpr
    loops = count_equations(rollout_jaxpr, "while")
    programs = {
        "rollout": count_products(
            rollout_jaxpr, decode_trips(rollout_config.max_new_tokens, loops)
        ),
        "update": count_products(update_jaxpr, []),
    }

    timed: dict[Product, tuple[float, float]] = {}
    for counts in programs.values():
        for product in counts:
            if product not in timed:
                timed[product] = time_product(product, args.repeats, args.cold_mib << 20)
    peak = matmul_peak_flops()

    print(
        f"{args.model}, {jax.devices()[0].platform}, {prompts} prompts x G={generations}, "
        f"{rollout_config.max_new_tokens} new tokens, beta {config.algorithm.beta}; programs: "
        f"medians of {args.steps} Trainer steps after the first; products: medians of "
        f"at least {args.repeats} calls each (cold: the larger operand cycled through "
        f"{args.cold_mib} MiB of copies, a call for each); "
        f"f32 matmul peak {peak / 1e9:.1f} GFLOP/s\n"
    )
    print("| program | whole | products alone, warm | cold | whole / warm | products | GFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    floor = 0.0
    for name, counts in programs.items():
        program_s = statistics.median(whole[name])
        warm = sum(n * timed[p][0] for p, n in counts.items())
        cold = sum(n * timed[p][1] for p, n in counts.items())
        flops = sum(n * p.flops for p, n in counts.items())
        floor += warm
        print(
            f"| {name} | {program_s:.3f} s | {warm:.3f} s | {cold:.3f} s | "
            f"{program_s / warm:.2f} | {flops / 1e12:.3f} TFLOP | {flops / program_s / 1e9:.1f} |"
        )
    step_s = sum(statistics.median(times) for times in whole.values())
    print(
        f"\nrollout + update: {step_s:.3f} s; their products alone (warm): {floor:.3f} s, "
        "the floor with these kernels on this host"
    )
    for name, counts in programs.items():
        print(f"\n{name}: the {args.top} products that take longest (cold), calls per program")
        print("| product | calls | warm | cold | GFLOP/s cold |")
        print("|---|---|---|---|---|")
        ranked = sorted(counts.items(), key=lambda item: -item[1] * timed[item[0]][1])
        for product, n in ranked[: args.top]:
            warm_s, cold_s = timed[product]
            print(
                f"| {product.label()} | {n} | {n * warm_s:.3f} s | {n * cold_s:.3f} s | "
                f"{product.flops / cold_s / 1e9:.1f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
