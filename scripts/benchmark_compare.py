"""One GRPO step of a fixed workload, timed for jgrpo and its peers side by side.

    python scripts/benchmark.py compare [--model smollm2-135m|tiny] [--steps 3]
        [--trl-python PATH] [--tunix-python PATH] [--workdir DIR] [--peer-environment own]

The workload (`compare_workload.py`): 4 chat prompts of 39 tokens, G = 8, exactly 64 new
tokens, temperature 1, beta 0.04, one optimizer step (mu = 1), AdamW, f32, on random weights
of the SmolLM2-135M architecture (or the tiny test model) written once as an HF checkpoint that
every library loads. Each library runs in its own fresh process: jgrpo with this Python,
TRL and Tunix with the Python of their own virtual environments (never project dependencies;
docs/benchmarks.md says how to make them) when the flags name one. Each prints a `RESULT`
JSON line: the first step (compilation / warm-up) apart, then per-step seconds of the whole
step, sampling, the reference pass and the update; the table shows medians and each peer's
time over jgrpo's. Every library's process gets the environment that `python -m jgrpo.train`
gives itself (glibc's tunables where they help: `jgrpo.huge_pages`), so all run alike; with
`--peer-environment own` the peers run in this shell's environment as it is, as their users
would run them. jgrpo's process also runs XLA's programs on its main thread where those
tunables keep freed memory, as the CLI does: a JAX setting in jgrpo's process, which the
peers' processes do not get.

jgrpo's step is `jgrpo.train.Trainer.step`, the training loop's own step. Its reference pass
runs inside the update program, so its column is that pass compiled on its own and timed on
the step's batch, next to a plain forward (logits) over the same batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

import compare_workload as workload  # noqa: E402

STAGES = ("step_s", "sampling_s", "reference_s", "update_s")


def jgrpo_config(
    checkpoint: Path,
    steps: int,
    sampling_weights: str = "float32",
    matmul: str = "float32",
    overrides: tuple[str, ...] = (),
    reference: str = "float32",
):
    """The workload as a jgrpo Config; `overrides` (`key=value`) are applied last. bf16
    sampling weights come with the sampler correction (algorithm.sampler_correction's
    default, `auto`), as a user would run them."""
    from jgrpo.config import load_config

    return load_config(
        None,
        [
            f"model.path={checkpoint}",
            "model.dtype=float32",
            f"rollout.prompts_per_step={workload.PROMPTS}",
            f"rollout.num_generations={workload.GENERATIONS}",
            f"rollout.max_new_tokens={workload.NEW_TOKENS}",
            "rollout.max_prompt_length=39",
            f"rollout.temperature={workload.TEMPERATURE}",
            f"algorithm.beta={workload.BETA}",
            "algorithm.num_iterations=1",
            "algorithm.num_minibatches=1",
            f"optim.lr={workload.LEARNING_RATE}",
            f"train.steps={steps}",
            "task.reward_workers=0",  # a cheap verifier: in-process
            "mesh.devices=1",
            f"rollout.weights_dtype={sampling_weights}",
            f"model.matmul_dtype={matmul}",
            f"model.reference_dtype={reference}",
            *overrides,
        ],
    )


def jgrpo_task():
    """The workload's prompts, with its distinct-words reward, as a jgrpo Task."""
    from jgrpo.tasks import Task

    examples = [{"prompt": prompt} for prompt in workload.prompts()]
    return Task(
        name="compare",
        train=examples,
        eval=examples,
        reward_fns={"distinct_words": workload.distinct_words_reward},
        reward_weights={"distinct_words": 1.0},
        correctness="distinct_words",
    )


def run_jgrpo(
    checkpoint: Path,
    steps: int,
    sampling_weights: str = "float32",
    matmul: str = "float32",
    reference: str = "float32",
) -> str:
    """`steps` + 1 trainer steps of the workload (the first compiles): the RESULT line."""
    import jax
    import jax.numpy as jnp
    from benchmark import forward_flops, matmul_peak_flops

    from jgrpo.huge_pages import reexec_with_huge_pages
    from jgrpo.models.transformer import forward
    from jgrpo.train import Trainer

    reexec_with_huge_pages()  # as `python -m jgrpo.train` starts (returns if not)
    config = jgrpo_config(checkpoint, steps + 1, sampling_weights, matmul, reference=reference)
    trainer = Trainer(config, jgrpo_task())
    # Exactly NEW_TOKENS per completion: no stop tokens (benchmark only).
    trainer.sampling = dataclasses.replace(trainer.sampling, stop_token_ids=())
    started = time.perf_counter()
    trainer.compile_update_ahead()  # as `jgrpo.train.train` does
    params = trainer.initial_params()
    ref_params = trainer.reference_params(params)  # model.reference_dtype's
    state = trainer.initial_state(params)
    metrics, position, peaks = [], 0, []
    for step in range(steps + 1):
        state, step_metrics, position = trainer.step(state, ref_params, step, position)
        metrics.append(step_metrics)
        if step == 0:  # warm-up: from the start of the update's compile to the first step's end
            step_metrics["time/step"] = time.perf_counter() - started
        else:  # the peak right after each timed step, in the host's state of that step
            peaks.append(matmul_peak_flops(dtype=jnp.dtype(matmul)))

    # The reference pass and a plain forward, each compiled alone, on one step's batch.
    key = jax.random.key(steps + 1)
    groups, _, _ = trainer.collect(state.params, ref_params, key, position)
    batch = trainer.to_batch(groups, trainer.advantages(groups))
    reference_s = _median_time(lambda: trainer.frozen_logprobs(ref_params, batch), steps)
    forward_s = _median_time(
        lambda: forward(
            state.params,
            batch.input_ids,
            attention_mask=batch.attention_mask,
            config=trainer.model_config,
        ),
        steps,
    )
    rows, length = batch.input_ids.shape
    shared = trainer.update_config.shared_prompt_rows
    flops = forward_flops(trainer.model_config, rows, length, workload.NEW_TOKENS, shared)
    label = f"jgrpo (jax {jax.__version__})"
    if matmul != "float32":
        label = f"jgrpo, {matmul} matmuls (sampling and update)"
    elif reference != "float32":
        label = f"jgrpo, {sampling_weights} sampling weights and reference, corrected"
    elif sampling_weights != "float32":
        label = f"jgrpo, {sampling_weights} sampling weights, corrected"
    return workload.result_line(
        label,
        [
            {
                "step": m["time/step"],
                "sampling": m["time/rollout"],
                "reference": reference_s,
                "update": m["time/update"],
            }
            for m in metrics
        ],
        [round(m["completion_len/mean"] * rows) for m in metrics],
        reference_in_update=True,
        reward_s=[m["time/reward"] for m in metrics[1:]],
        plain_forward_s=forward_s,
        update_flops=3 * flops,  # forward + backward
        reference_flops=flops,
        matmul_peak_flops=statistics.median(peaks),
        matmul_dtype=matmul,
        reference_dtype=reference,
    )


def _median_time(run, repeats: int) -> float:
    import jax

    jax.block_until_ready(run())  # compile
    times = []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_library(
    name: str, python: str, checkpoint: Path, steps: int, environment: dict[str, str]
) -> dict | None:
    """Runs one library's step script in a fresh process and parses its RESULT line."""
    if name.startswith("jgrpo"):  # "jgrpo[:sampling weights[:update matmuls[:reference]]]"
        weights, matmul, reference = (name.split(":")[1:] + ["float32"] * 3)[:3]
        command = [python, __file__, "--_library", "jgrpo", "--sampling-weights", weights]
        command += ["--matmul-dtype", matmul, "--reference-dtype", reference]
    else:  # "trl" or "trl:bf16" (its mixed precision)
        peer, _, mode = name.partition(":")
        command = [python, str(SCRIPTS / "peers" / f"{peer}_step.py")]
        command += ["--bf16"] if mode == "bf16" else []
    command += ["--checkpoint", str(checkpoint), "--steps", str(steps)]
    print(f"running {name}: {' '.join(command)}", file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True, env=environment)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not results:
        print(f"{name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(results[-1].removeprefix("RESULT "))


def child_environment() -> dict[str, str]:
    """The environment of every library's process: the one `python -m jgrpo.train` gives
    itself (glibc's huge-page tunable where it helps, `jgrpo.huge_pages`), for all alike."""
    from jgrpo.huge_pages import local_huge_page_environment

    return local_huge_page_environment(os.environ) or dict(os.environ)


def table(results: list[dict]) -> str:
    """Medians per stage; each peer's step over jgrpo's (the first result)."""
    ours = statistics.median(results[0]["step_s"])
    lines = [
        "| library | step | sampling | reference pass | update | warm-up | step / jgrpo |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        cells = []
        for stage in STAGES:
            values = result.get(stage)
            cells.append(f"{statistics.median(values):.3f} s" if values else "-")
        if result.get("reference_in_update"):  # timed alone; the update column includes it
            cells[2] += " (in update)"
        step = statistics.median(result["step_s"])
        lines.append(
            f"| {result['library']} | {' | '.join(cells)} | {result['warmup_s']:.1f} s "
            f"| {step / ours:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(workload.ARCHITECTURES))
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the first")
    parser.add_argument("--trl-python", help="the python of a virtual env with TRL installed")
    parser.add_argument("--tunix-python", help="the python of a virtual env with Tunix installed")
    parser.add_argument("--workdir", default="/tmp/jgrpo-compare", help="where the checkpoint is")
    parser.add_argument(
        "--bf16-sampling",
        action="store_true",
        help="also run jgrpo with rollout.weights_dtype=bfloat16 and "
        "algorithm.sampler_correction=token (a row of its own)",
    )
    parser.add_argument(
        "--bf16-reference",
        action="store_true",
        help="also run jgrpo with bf16 sampling weights and a bf16 reference "
        "(rollout.weights_dtype and model.reference_dtype=bfloat16, the sampler correction "
        "on; the update's products stay f32; a row of its own)",
    )
    parser.add_argument(
        "--bf16-matmuls",
        action="store_true",
        help="also run jgrpo with bf16 products in sampling and update (rollout.weights_dtype "
        "and model.matmul_dtype=bfloat16: mixed precision, f32 parameters; the sampler "
        "correction on), and TRL with its "
        "bf16 mixed precision when --trl-python is given (rows of their own)",
    )
    parser.add_argument(
        "--peer-environment",
        choices=("cli", "own"),
        default="cli",
        help="cli (default): the peers run with the environment jgrpo's CLI gives itself "
        "(glibc tunables), as jgrpo does; own: with this shell's environment as it is",
    )
    parser.add_argument("--sampling-weights", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--matmul-dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--reference-dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--_library", help=argparse.SUPPRESS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1 (timed steps after the first), got {args.steps}")
    if args._library == "jgrpo":  # the child process
        print(
            run_jgrpo(
                Path(args.checkpoint),
                args.steps,
                args.sampling_weights,
                args.matmul_dtype,
                args.reference_dtype,
            ),
            flush=True,
        )
        return 0

    checkpoint = workload.build_checkpoint(Path(args.workdir) / args.model, args.model)
    libraries = [("jgrpo", sys.executable)]
    if args.bf16_sampling:
        libraries.append(("jgrpo:bfloat16", sys.executable))
    if args.bf16_reference:
        libraries.append(("jgrpo:bfloat16:float32:bfloat16", sys.executable))
    if args.bf16_matmuls:
        libraries.append(("jgrpo:bfloat16:bfloat16", sys.executable))
    libraries += [
        (name, python)
        for name, python in (("tunix", args.tunix_python), ("trl", args.trl_python))
        if python
    ]
    if args.bf16_matmuls and args.trl_python:
        libraries.append(("trl:bf16", args.trl_python))
    ours = child_environment()
    theirs = ours if args.peer_environment == "cli" else dict(os.environ)
    results = [
        run_library(
            name, python, checkpoint, args.steps, ours if name.startswith("jgrpo") else theirs
        )
        for name, python in libraries
    ]
    if results[0] is None:
        return 1
    results = [r for r in results if r is not None]
    print(
        f"GRPO step, {args.model} architecture (random weights), {workload.PROMPTS} prompts x "
        f"G={workload.GENERATIONS}, {workload.NEW_TOKENS} new tokens, beta {workload.BETA}, "
        f"f32 parameters; medians of {args.steps} steps after the first\n"
    )
    print(table(results))
    tunables = ours.get("GLIBC_TUNABLES")
    peers = any(not name.startswith("jgrpo") for name, _ in libraries)
    if args.peer_environment == "own" and peers:
        print(
            f"\njgrpo ran with GLIBC_TUNABLES={tunables or '(unset)'}, as its CLI runs itself; "
            f"the peers with GLIBC_TUNABLES={theirs.get('GLIBC_TUNABLES') or '(unset)'}."
        )
    elif tunables:
        print(f"\nEvery library ran with GLIBC_TUNABLES={tunables}, as jgrpo's CLI runs itself.")
    for result in results:
        if "update_flops" in result:
            print(f"\n{result['library']}: " + update_summary(result))
    return 0


def update_summary(result: dict) -> str:
    """jgrpo's reference pass and the update's rate against the matmul peak measured in its
    process, in its matmul dtype (products summed in f32): the median of the peaks measured
    right after each timed step, as the host's speed drifts within a run."""
    peak = result["matmul_peak_flops"]
    update = statistics.median(result["update_s"])  # the reference pass runs inside it
    flops = result["update_flops"] + result["reference_flops"]
    dtype = {"float32": "f32", "bfloat16": "bf16"}[result.get("matmul_dtype", "float32")]
    bf16_reference = result.get("reference_dtype", "float32") == "bfloat16"
    return (
        f"{result['completion_tokens'][0]} completion tokens per step; reward "
        f"{statistics.median(result['reward_s']):.3f} s; reference pass "
        f"{result['reference_s'][0]:.3f} s next to a plain forward (logits) "
        f"{result['plain_forward_s']:.3f} s. The update program (reference pass, forward, "
        f"backward, AdamW): {flops / 1e9:.1f} GFLOP counted from the shapes in {update:.3f} s "
        f"= {flops / update / 1e9:.1f} GFLOP/s, {flops / update / peak:.0%} of the {dtype} "
        f"matmul peak measured in the same process after each step (median "
        f"{peak / 1e9:.1f} GFLOP/s)"
        + (" with the reference pass in bf16." if bf16_reference else ".")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
