"""Benchmarks of the model stack on this machine: forward throughput and checkpoint-load memory.

1. Forward throughput. One random-initialised Llama checkpoint is written by transformers and
   read by both sides: jgrpo (`jgrpo.models.hf.from_pretrained`, forward under `jax.jit`) and
   transformers (`AutoModelForCausalLM`, PyTorch, eval mode, `torch.inference_mode()`). Both
   run the same [B, T] batch in f32, logits only. After a warm-up, `--repeats` timed runs each
   give the median tokens/s and the ratio jgrpo/torch; the jit compile (trace, lower, XLA
   compile) is timed separately. The max abs logit difference is a sanity check that both
   compute the same function.
2. Load memory. The peak host memory that `from_pretrained` adds while loading that checkpoint,
   as a multiple of its size on disk (sum of *.safetensors bytes; target: under 1.5x), loading
   into f32 and into bf16 parameters. Each load runs in a fresh subprocess of this script
   (`--measure-load DIR --load-dtype NAME`) so that earlier allocations do not hide its peak:
   ru_maxrss is read after importing jax, flax and models and running a tiny op, and again
   after the load.

Run: python scripts/benchmark_models.py [--preset llama-125m] [--batch 4] [--length 256]
                                        [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jgrpo.models.config import preset
from jgrpo.models.hf import from_pretrained

LOAD_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
LOAD_TARGET = 1.5  # peak added host memory / checkpoint bytes
MIB = 1024**2


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure_load(directory: str, dtype_name: str) -> dict:
    """Peak host memory that from_pretrained(directory) adds, in this (fresh) process."""
    jax.block_until_ready(jnp.ones(4) + 1)  # the backend and its allocator are up
    before = _maxrss_bytes()
    model = from_pretrained(directory, dtype=LOAD_DTYPES[dtype_name])
    jax.block_until_ready(nnx.state(model))
    peak = _maxrss_bytes()
    checkpoint = sum(f.stat().st_size for f in pathlib.Path(directory).glob("*.safetensors"))
    return {
        "dtype": dtype_name,
        "checkpoint_bytes": checkpoint,
        "rss_before_bytes": before,
        "peak_added_bytes": peak - before,
        "ratio": (peak - before) / checkpoint,
    }


def run_self(*flags: str) -> str:
    """The stdout of this script run in a fresh process with `flags`."""
    out = subprocess.run([sys.executable, __file__, *flags], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(flags)} failed:\n{out.stderr}")
    return out.stdout


def xla_cpu_threads() -> int:
    """Threads in XLA's CPU intra-op pool (Eigen), counted by name in /proc."""
    tasks = pathlib.Path("/proc/self/task")
    return sum((task / "comm").read_text().strip() == "tf_XLAEigen" for task in tasks.iterdir())


def tokens_per_second(run, tokens: int, repeats: int) -> tuple[float, float, float]:
    """Median, min and max tokens/s of `run()` over `repeats` calls after an untimed warm-up."""
    run()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates), min(rates), max(rates)


def benchmark_forward(args: argparse.Namespace, directory: str) -> dict:
    """Tokens/s of jgrpo and transformers on the checkpoint in `directory` (same batch)."""
    # Imported here, so the --measure-load subprocesses never carry torch.
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    ids = np.random.default_rng(0).integers(
        0, preset(args.preset).vocab_size, (args.batch, args.length), dtype=np.int32
    )  # [B, T]

    model = from_pretrained(directory)
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
    jax_ids = jnp.asarray(ids)  # [B, T]
    start = time.perf_counter()
    compiled = fwd.lower(state, jax_ids).compile()
    compile_s = time.perf_counter() - start
    tokens = args.batch * args.length
    jax_rates = tokens_per_second(
        lambda: compiled(state, jax_ids).block_until_ready(), tokens, args.repeats
    )
    jax_logits = np.asarray(compiled(state, jax_ids))  # [B, T, V]

    torch_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    torch_model.eval()
    torch_ids = torch.from_numpy(ids).long()  # [B, T]
    with torch.inference_mode():
        torch_rates = tokens_per_second(
            lambda: torch_model(input_ids=torch_ids, use_cache=False).logits, tokens, args.repeats
        )
        torch_logits = torch_model(input_ids=torch_ids, use_cache=False).logits.numpy()

    return {
        "jax_tokens_s": jax_rates,
        "torch_tokens_s": torch_rates,
        "compile_s": compile_s,
        "max_abs_diff": float(np.max(np.abs(jax_logits - torch_logits))),
        "max_abs_logit": float(np.max(np.abs(torch_logits))),
        "cores": cores,
        "jax_threads": xla_cpu_threads(),
        "torch_threads": torch.get_num_threads(),
        "attention": torch_model.config._attn_implementation,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }


def write_checkpoint(preset_name: str, directory: str) -> None:
    """A random-initialised (seed 0) transformers Llama of the preset's shapes, saved in f32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**preset(preset_name).to_hf_config()))
    model.save_pretrained(directory)


def report(args: argparse.Namespace, forward: dict, loads: list[dict]) -> None:
    config = preset(args.preset)
    tokens = args.batch * args.length
    print(
        f"preset {args.preset} ({config.num_params / 1e6:.1f}M params), f32, batch {args.batch} x "
        f"length {args.length} = {tokens} tokens per forward, median of {args.repeats} runs"
    )
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; "
        f"torch {forward['torch_version']}, transformers {forward['transformers_version']}"
    )
    print()
    print(
        f"{'forward':<22}{'tokens/s':>10}{'min-max':>16}{'compile s':>11}"
        f"  threads (cores: {forward['cores']})"
    )
    rows = [
        (
            "jgrpo (jax.jit)",
            forward["jax_tokens_s"],
            f"{forward['compile_s']:.1f}",
            f"{forward['jax_threads']} (XLA's default CPU pool)",
        ),
        (
            "transformers (torch)",
            forward["torch_tokens_s"],
            "-",
            f"{forward['torch_threads']} (torch.set_num_threads), attention {forward['attention']}",
        ),
    ]
    for name, (median, low, high), compile_s, threads in rows:
        spread = f"{low:,.0f}-{high:,.0f}"
        print(f"{name:<22}{median:>10,.0f}{spread:>16}{compile_s:>11}  {threads}")
    ratio = forward["jax_tokens_s"][0] / forward["torch_tokens_s"][0]
    print(f"ratio jgrpo/torch (medians): {ratio:.2f}")
    print(
        f"max |logit difference| on the batch: {forward['max_abs_diff']:.2e} "
        f"(max |logit| {forward['max_abs_logit']:.2f})"
    )
    print()
    checkpoint_mib = loads[0]["checkpoint_bytes"] / MIB
    print(
        f"from_pretrained peak host memory, fresh process each; checkpoint: "
        f"{checkpoint_mib:.0f} MiB of f32 safetensors"
    )
    print(f"{'load into':<12}{'before MiB':>12}{'peak added MiB':>16}{'/ checkpoint':>14}  target")
    for load in loads:
        verdict = "ok" if load["ratio"] < LOAD_TARGET else "OVER"
        print(
            f"{load['dtype']:<12}{load['rss_before_bytes'] / MIB:>12.0f}"
            f"{load['peak_added_bytes'] / MIB:>16.0f}{load['ratio']:>13.2f}x"
            f"  < {LOAD_TARGET}x: {verdict}"
        )
    print("(bf16 is loaded from the same f32 checkpoint; its ratio is relative to the f32 file.)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-125m")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write-checkpoint", metavar="DIR", help="internal: write, then exit")
    parser.add_argument("--measure-load", metavar="DIR", help="internal: one load, JSON out")
    parser.add_argument("--load-dtype", choices=LOAD_DTYPES, default="float32")
    args = parser.parse_args()

    if args.write_checkpoint:
        write_checkpoint(args.preset, args.write_checkpoint)
        return
    if args.measure_load:
        print(json.dumps(measure_load(args.measure_load, args.load_dtype)))
        return

    with tempfile.TemporaryDirectory() as directory:
        # On Linux a child's ru_maxrss starts at its parent's peak RSS (it survives exec), so
        # this process stays lean until the loads are measured: the checkpoint is written in a
        # child too, and the models of the forward benchmark come last.
        run_self("--write-checkpoint", directory, "--preset", args.preset)
        loads = [
            json.loads(run_self("--measure-load", directory, "--load-dtype", name))
            for name in LOAD_DTYPES
        ]
        forward = benchmark_forward(args, directory)
    report(args, forward, loads)


if __name__ == "__main__":
    main()
