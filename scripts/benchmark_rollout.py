"""Rollout speed: jgrpo's compiled group sampler next to transformers' `generate`.

One run, same weights, same shapes, printed side by side:
1. Generated tokens/s sampling G completions of P prompts (temperature 1, no top-k/top-p, no
   stop tokens, so every row produces exactly N tokens on both sides). transformers gets the
   prompts once with `num_return_sequences=G`, its own way of sampling a group.
2. jgrpo's prefill cost against G: the time of a rollout with one new token for G=1 and G=16
   (prefill dominates it), whose ratio shows that the prompt is prefilled once per prompt.

Compilation is excluded (one warm-up call first, whose time is reported separately). The
script runs in the environment `python -m jgrpo.train` gives itself (glibc's tunables where
they help, `jgrpo.huge_pages`), so both samplers run as under the CLI; jgrpo's programs also
run on the main thread where those tunables keep freed memory, as the CLI's do.
`--bf16-weights` adds a jgrpo row sampling with `rollout.weights_dtype=bfloat16` (bf16 weight
matrices, f32 sums; docs/training.md says what that rounds).

Run: python scripts/benchmark_rollout.py [--preset tiny|llama-125m] [--prompts 8]
     [--generations 8] [--prompt-length 64] [--new-tokens 128] [--repeats 3] [--bf16-weights]

`--ragged`: long, ragged completions instead (`rollout.max_concurrent`). Each row's length is
drawn from a log-normal spread (median `--median-share` of --new-tokens, sigma `--spread`,
within 1 .. N, seed 0) and forced with a stop token at that length, on both sides (jgrpo's
benchmark-only `stop_after`; a logits processor for transformers). Printed side by side from
one run: today's engine (every row at once), the slot engine with a KV budget of a quarter of
today's full-batch cache and with each of `--slots` (default R/2, R/8, R/16 of the R rows), and
transformers `generate`: decode steps, slot efficiency (tokens drawn by decode steps / (slots
x decode steps)), seconds, tokens/s, the KV cache (computed from the shapes: prompts once
+ completion buffers) and the speed against today's engine. For jgrpo's engines also the
fraction of the memory roofline: the bytes a decode loop cannot avoid reading (the weight
matrices once per decode step, and each real token's keys and values once for every later
token of its row that attends to them) over the peak bandwidth (`--peak-gbps`, e.g. an
accelerator's HBM figure; by default the bandwidth a jitted sum over 1 GiB reaches here), as a
share of the measured time. `--bf16-weights` samples every jgrpo engine with bf16 weights.
     python scripts/benchmark.py rollout --ragged --new-tokens 1024 [--preset smollm2-135m]

`--turns K`: ragged multi-turn episodes instead (jgrpo alone, random weights, no torch). Each
episode lasts 1 .. K model turns (uniform, seed 0), its turns have the row's log-normal length
as above (forced by `stop_after`, relative to each turn's start) and the environment's answers
1 .. 64 words (log-normal, median 8). Printed side by side from one run: every episode at
once, and `--slots` (default R/2, R/4, R/8) slots: decode steps, host rounds, slot efficiency
(tokens fed / (slots x decode steps)), seconds, the model's tokens per second, the KV cache
(prompts once + S records) and the speed against every episode at once.
     python scripts/benchmark.py rollout --turns 4 --new-tokens 64 --prompt-length 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from benchmark_models import write_checkpoint  # scripts/ is on sys.path when run as a script
from flax import nnx

from jgrpo import models
from jgrpo.huge_pages import reexec_with_huge_pages
from jgrpo.rollout import SamplingConfig, rollout


def run_seconds(run, repeats: int) -> list[float]:
    """The wall time of each of `repeats` calls run(0), run(1), ..."""
    times = []
    for repeat in range(repeats):
        start = time.perf_counter()
        run(repeat)
        times.append(time.perf_counter() - start)
    return times


def median_seconds(run, repeats: int) -> float:
    return statistics.median(run_seconds(run, repeats))


def import_torch():
    """torch, for the transformers side; where it is missing, an error that says what to do."""
    try:
        import torch
    except ModuleNotFoundError:
        raise SystemExit(
            "benchmark.py rollout times transformers' generate beside jgrpo, which needs torch: "
            "pip install torch==2.13.0 (its CPU build). `--ragged --skip-transformers` times "
            "jgrpo alone and needs only jgrpo."
        ) from None
    return torch


def torch_versions() -> str:
    torch = import_torch()
    return f"torch {torch.__version__} ({torch.get_num_threads()} threads)"


def jgrpo_sampler(model, ids, mask, generations, new_tokens, weights_dtype="float32"):
    sampling = SamplingConfig(
        max_new_tokens=new_tokens, temperature=1.0, weights_dtype=weights_dtype
    )
    params = model.params()

    def run(seed):
        result = rollout(
            params,
            ids,
            mask,
            jax.random.key(seed),
            model_config=model.config,
            num_generations=generations,
            sampling=sampling,
        )
        jax.block_until_ready(result)
        return result

    return run


def transformers_sample(torch_model, prompt_ids, generations: int, seed: int, **options):
    """transformers' `generate` sampling `generations` completions of each prompt (temperature
    1, no top-k / top-p), seeded; `options` are the run's own (lengths, stops)."""
    torch = import_torch()
    torch.manual_seed(seed)
    torch_ids = torch.tensor(prompt_ids)
    with torch.inference_mode():
        return torch_model.generate(
            torch_ids,
            attention_mask=torch.ones_like(torch_ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_return_sequences=generations,
            **options,
        )


def ragged_lengths(rows: int, new_tokens: int, median_share: float, spread: float) -> np.ndarray:
    """int32[rows]: log-normal lengths, median median_share x new_tokens, within 1 .. N."""
    rng = np.random.default_rng(0)
    drawn = rng.lognormal(np.log(median_share * new_tokens), spread, rows)
    return np.clip(np.round(drawn), 1, new_tokens).astype(np.int32)


def decode_weight_bytes(params: dict, dtype) -> int:
    """Bytes of the weights one decode step reads in `dtype`: every parameter except an untied
    embedding table, of which a step gathers only its rows' tokens."""
    sizes = sum(leaf.size for leaf in jax.tree.leaves(params))
    if "lm_head" in params:
        sizes -= params["embed"].size
    return sizes * jnp.dtype(dtype).itemsize


def attended_tokens(lengths: np.ndarray, prompt_length: int) -> int:
    """Cache slots the decode steps of rows of `lengths` tokens attend to: the step drawing a
    row's token t (t = 1 .. length - 1; token 0 comes from the prefill) reads the prompt and
    the t tokens before it."""
    steps = np.maximum(lengths.astype(np.int64) - 1, 0)
    return int((steps * prompt_length + steps * (steps + 1) // 2).sum())


def peak_bandwidth(gigabytes: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s a jitted sum over `gigabytes` of f32 reaches on the default device (best of
    `repeats`): the read bandwidth this process can get, for the roofline when no figure is
    given."""
    data = jnp.ones((int(gigabytes * 2**30) // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(data).block_until_ready()
    return data.nbytes / min(run_seconds(lambda _: total(data).block_until_ready(), repeats))


def transformers_ragged(args, torch_model, prompt_ids, lengths: np.ndarray, eos: int) -> tuple:
    """transformers' `generate` of the rows of `lengths` (its logits processor allows EOS at
    each row's chosen step only): (rows, decode steps, efficiency, seconds, tokens)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    torch = import_torch()
    rows = len(lengths)

    class ForcedStop(LogitsProcessor):
        """Row r's token lengths[r] - 1 is EOS, and no other (rows prompt-major, as generate
        orders them)."""

        def __call__(self, input_ids, scores):
            drawn = input_ids.shape[1] - args.prompt_length
            stop = torch.as_tensor(drawn + 1 >= lengths)
            scores[:, eos] = -float("inf")
            scores[stop] = -float("inf")
            scores[stop, eos] = 0.0
            return scores

    latest = {}

    def torch_generate(seed):
        latest["out"] = transformers_sample(
            torch_model,
            prompt_ids,
            args.generations,
            seed,
            max_new_tokens=args.new_tokens,
            logits_processor=LogitsProcessorList([ForcedStop()]),
            eos_token_id=eos,
            pad_token_id=0,
        )

    torch_generate(0)  # warm-up
    seconds = median_seconds(lambda r: torch_generate(r + 1), args.repeats)
    completions = latest["out"][:, args.prompt_length :].numpy()
    made = np.where(
        (completions == eos).any(1), (completions == eos).argmax(1) + 1, args.new_tokens
    )
    np.testing.assert_array_equal(made, lengths)
    steps = int(made.max()) - 1
    return rows, steps, (made.sum() - rows) / (rows * steps), seconds, made.sum()


def ragged(args, config, model, torch_model, prompt_ids) -> None:
    """The --ragged benchmark (see the module docstring); `torch_model` None: jgrpo alone."""
    from jgrpo.models.group_decode import cache_bytes_per_slot
    from jgrpo.rollout import kv_cache_bytes

    # jgrpo stops on an id outside the vocabulary, which it never samples; transformers on
    # EOS, which its logits processor allows only at the chosen step: every row ends exactly
    # at its drawn length on both sides.
    rows, new_tokens, eos = args.prompts * args.generations, args.new_tokens, 2
    never_sampled = config.vocab_size
    lengths = ragged_lengths(rows, new_tokens, args.median_share, args.spread)
    ids = jnp.asarray(prompt_ids, jnp.int32)
    mask = jnp.ones_like(ids)
    stop_after = jnp.asarray(lengths)
    params = model.params()
    weights_dtype = "bfloat16" if args.bf16_weights else "float32"
    # The roofline: bytes no decode loop can avoid reading, against the peak bandwidth.
    step_bytes = decode_weight_bytes(params, weights_dtype)
    attended_bytes = attended_tokens(lengths, args.prompt_length) * cache_bytes_per_slot(
        config, jnp.float32
    )
    peak = args.peak_gbps * 1e9 if args.peak_gbps else peak_bandwidth()

    def kv_bytes(slots: int) -> int:
        prompts = kv_cache_bytes(args.prompts, args.prompt_length, config, jnp.float32)
        completions = kv_cache_bytes(slots, new_tokens, config, jnp.float32, completion=True)
        return prompts + completions

    full_cache = kv_bytes(rows)
    per_slot = kv_cache_bytes(1, new_tokens, config, jnp.float32, completion=True)
    quarter = max(1, (full_cache // 4 - kv_bytes(0)) // per_slot)  # slots within 1/4 of it
    engines = {"today: every row at once": 0}
    engines[f"slots: {quarter} (KV budget 1/4)"] = quarter
    for slots in args.slots or [rows // 2, rows // 8, rows // 16]:
        if 0 < slots < rows:  # fewer slots than rows (0 or all rows: today's engine)
            engines[f"slots: {slots}"] = slots
    results, latest = {}, {}
    for name, slots in engines.items():
        sampling = SamplingConfig(
            max_new_tokens=new_tokens,
            temperature=1.0,
            stop_token_ids=(never_sampled,),
            max_concurrent=slots,
            weights_dtype=weights_dtype,
        )

        def run(seed, sampling=sampling):
            result = rollout(
                params,
                ids,
                mask,
                jax.random.key(seed),
                model_config=model.config,
                num_generations=args.generations,
                sampling=sampling,
                stop_after=stop_after,
            )
            latest["jgrpo"] = jax.block_until_ready(result)
            return latest["jgrpo"]

        run(0)  # compile
        seconds = median_seconds(lambda r, run=run: run(r + 1), args.repeats)
        last = latest["jgrpo"]  # the last timed run's
        made = np.asarray(last.lengths)
        np.testing.assert_array_equal(made, lengths)
        used, steps = slots or rows, int(np.asarray(last.finished_at).max())
        results[name] = (used, steps, (made.sum() - rows) / (used * steps), seconds, made.sum())

    if torch_model is not None:
        results["transformers generate"] = transformers_ragged(
            args, torch_model, prompt_ids, lengths, eos
        )

    print(
        f"preset {args.preset} ({config.num_params / 1e6:.1f}M params, f32; jgrpo samples with "
        f"{weights_dtype} weights); {args.prompts} "
        f"prompts x {args.generations} = {rows} sequences, prompt length {args.prompt_length}, "
        f"max_new_tokens {new_tokens}; lengths log-normal: median {int(np.median(lengths))}, "
        f"mean {lengths.mean():.0f}, max {lengths.max()} ({lengths.sum()} tokens); "
        f"median of {args.repeats}; jax {jax.__version__} ({jax.default_backend()})"
        + ("" if torch_model is None else f", {torch_versions()}")
    )
    source = "--peak-gbps" if args.peak_gbps else "a jitted sum over 1 GiB, measured here"
    print(
        f"roofline: {step_bytes / 2**20:.1f} MiB of weights per decode step, "
        f"{attended_bytes / 2**20:.1f} MiB of keys and values attended in all; peak "
        f"{peak / 1e9:.1f} GB/s ({source})"
    )
    print(
        f"\n{'engine':<34}{'slots':>6}{'steps':>7}{'efficiency':>12}{'seconds':>9}"
        f"{'tokens/s':>10}{'KV MiB':>9}{'today/this':>12}{'roofline':>10}"
    )
    today = results["today: every row at once"][3]
    for name, (slots, steps, efficiency, seconds, tokens) in results.items():
        kv, roofline = f"{'':>9}", f"{'':>10}"
        if not name.startswith("transformers"):
            kv = f"{kv_bytes(slots) / 2**20:9.1f}"
            least_seconds = (steps * step_bytes + attended_bytes) / peak
            roofline = f"{least_seconds / seconds:>10.3f}"
        print(
            f"{name:<34}{slots:>6}{steps:>7}{efficiency:>12.3f}{seconds:>9.2f}"
            f"{tokens / seconds:>10.0f}{kv}{today / seconds:>12.2f}{roofline}"
        )
    slotted = {name: result for name, result in results.items() if name.startswith("slots")}
    fastest = min(slotted, key=lambda name: slotted[name][3])
    budget = next(name for name in slotted if "budget" in name)
    print(
        f"\nfastest slots ({fastest}): {today / slotted[fastest][3]:.2f}x today's speed (target "
        f">= 2 at 1024 on CPU), efficiency {slotted[fastest][2]:.3f} (target >= 0.85); KV "
        f"budget 1/4: {slotted[budget][3] / today:.2f}x today's time and "
        f"{slotted[budget][3] / slotted[fastest][3]:.2f}x the fastest slots' (target <= 1.3)"
    )


def word_tokenizer(vocab_size: int):
    """A tokenizer of `vocab_size` + 1 words "w0" .. "w<V>" (w<V>, an id the model never
    samples, is the stop token), split on spaces, with a minimal chat template: enough for
    `run_episodes` to render prompts and answers for a random model of that vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab_size + 1)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="w0",
        pad_token="w0",
        chat_template=(
            "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
            "{% if add_generation_prompt %}w3 {% endif %}"
        ),
    )


class RaggedEpisode:
    """An environment whose episodes differ widely: episode e (in the order they are made)
    lasts turns[e] model turns, and its answers hold answers[e] words each."""

    def __init__(self, turns: int, answer_words: int):
        self.turns, self.answer_words = turns, answer_words

    def reset(self, example):
        return [{"role": "user", "content": example["prompt"]}]

    def step(self, messages):
        from jgrpo.tools import EnvironmentStep

        done = sum(m["role"] == "assistant" for m in messages) >= self.turns
        answer = " ".join(f"w{4 + i % 50}" for i in range(self.answer_words))
        return EnvironmentStep([{"role": "tool", "content": answer}], done=done, tool_calls=1)


def ragged_turns(args, config, model, prompt_ids) -> None:
    """The --turns benchmark: multi-turn episodes of ragged turns in slots against every episode
    at once (jgrpo alone: no peer decodes multi-turn episodes in one sequence)."""
    from jgrpo.models.group_decode import completion_cache_bytes
    from jgrpo.rollout import kv_cache_bytes
    from jgrpo.rollout.turns import run_episodes

    rows, max_turns = args.prompts * args.generations, args.turns
    turn_tokens = args.new_tokens
    rng = np.random.default_rng(0)
    episode_turns = rng.integers(1, max_turns + 1, rows)  # [R]
    answer_words = np.clip(rng.lognormal(np.log(8), 1.0, rows), 1, 64).astype(int)  # [R]
    lengths = ragged_lengths(rows, turn_tokens, args.median_share, args.spread)  # per turn
    # Each episode's room: its turns and its answers (with the template's two words around
    # each), so that none runs out of tokens; one record width for all.
    total = int(max_turns * turn_tokens + (max_turns - 1) * (answer_words.max() + 3))
    tokenizer = word_tokenizer(config.vocab_size)
    made = iter(range(rows))

    def new_environment():
        row = next(made)
        return RaggedEpisode(int(episode_turns[row]), int(answer_words[row]))

    examples = [{"prompt": " ".join(f"w{t}" for t in ids)} for ids in prompt_ids]
    params = model.params()
    weights_dtype = "bfloat16" if args.bf16_weights else "float32"
    prompt_width = args.prompt_length + 8  # the template's words around the prompt
    engines = {"every episode at once": 0}
    for slots in args.slots or [rows // 2, rows // 4, rows // 8]:
        if 0 < slots < rows:
            engines[f"slots: {slots}"] = slots
    results = {}
    for name, slots in engines.items():
        sampling = SamplingConfig(
            max_new_tokens=turn_tokens,
            temperature=1.0,
            stop_token_ids=(config.vocab_size,),
            max_concurrent=slots,
            weights_dtype=weights_dtype,
        )

        def run(seed, sampling=sampling):
            nonlocal made
            made = iter(range(rows))
            return run_episodes(
                params,
                examples,
                jax.random.key(seed),
                new_environment=new_environment,
                tokenizer=tokenizer,
                model_config=config,
                num_generations=args.generations,
                sampling=sampling,
                max_turns=max_turns,
                total_tokens=total,
                prompt_width=prompt_width,
                stop_after=jnp.asarray(lengths),
            )

        run(0)  # compile
        latest = []  # the last timed run's episodes
        seconds = median_seconds(
            lambda r, run=run, last=latest: last.append(run(r + 1)), args.repeats
        )
        episodes = latest[-1]
        np.testing.assert_array_equal(episodes.turns, episode_turns)
        used = slots or rows
        fed = int((episodes.lengths - 1).sum())
        efficiency = fed / (used * episodes.decode_steps)
        prompts = kv_cache_bytes(args.prompts, prompt_width, config, jnp.float32)
        kv = prompts + used * completion_cache_bytes(config, total, jnp.float32)
        model_tokens = int(episodes.model_mask.sum())
        results[name] = (
            used,
            episodes.decode_steps,
            episodes.rounds,
            efficiency,
            seconds,
            model_tokens,
            kv,
        )

    print(
        f"preset {args.preset} ({config.num_params / 1e6:.1f}M params, random weights; jgrpo "
        f"samples with {weights_dtype} weights); {args.prompts} prompts x {args.generations} = "
        f"{rows} episodes of 1 .. {max_turns} turns (mean {episode_turns.mean():.2f}); each "
        f"row's turns {int(np.median(lengths))} tokens at the median (log-normal, max "
        f"{lengths.max()}, max_new_tokens {turn_tokens}), answers of 1 .. {answer_words.max()} "
        f"words; records of {total} tokens; median of {args.repeats}; jax {jax.__version__} "
        f"({jax.default_backend()})"
    )
    print(
        f"\n{'engine':<24}{'slots':>6}{'steps':>7}{'rounds':>7}{'efficiency':>12}"
        f"{'seconds':>9}{'model tok/s':>13}{'KV MiB':>9}{'at once/this':>14}"
    )
    at_once = results["every episode at once"][4]
    for name, (slots, steps, rounds, efficiency, seconds, tokens, kv) in results.items():
        print(
            f"{name:<24}{slots:>6}{steps:>7}{rounds:>7}{efficiency:>12.3f}{seconds:>9.2f}"
            f"{tokens / seconds:>13.0f}{kv / 2**20:>9.1f}{at_once / seconds:>14.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--bf16-weights",
        action="store_true",
        help="also time jgrpo with bf16 sampling weights (--ragged: every jgrpo engine)",
    )
    parser.add_argument("--ragged", action="store_true", help="long ragged completions, slots")
    parser.add_argument(
        "--turns",
        type=int,
        default=0,
        help="ragged multi-turn episodes of 1 .. TURNS turns in slots (jgrpo alone, no torch)",
    )
    parser.add_argument(
        "--slots", type=int, nargs="*", default=[], help="--ragged: slot counts (R/2, R/8, R/16)"
    )
    parser.add_argument("--median-share", type=float, default=0.15)
    parser.add_argument("--spread", type=float, default=1.0, help="log-normal sigma")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--peak-gbps",
        type=float,
        default=None,
        help="--ragged: the device's peak memory bandwidth in GB/s for the roofline "
        "(default: measured with a jitted sum)",
    )
    args = parser.parse_args()
    reexec_with_huge_pages()  # as the CLI does; returns where it would not help

    config = models.preset(args.preset)
    rng = np.random.default_rng(0)
    prompt_ids = rng.integers(3, config.vocab_size, (args.prompts, args.prompt_length))  # [P, L]
    rows = args.prompts * args.generations
    generated = rows * args.new_tokens

    if args.turns:  # jgrpo alone: random weights, no torch
        model = models.Transformer(config, rngs=nnx.Rngs(0))
        ragged_turns(args, config, model, prompt_ids)
        return
    if args.ragged and args.skip_transformers:  # jgrpo alone: random weights, no torch
        ragged(args, config, models.Transformer(config, rngs=nnx.Rngs(0)), None, prompt_ids)
        return
    torch = import_torch()
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count())
    with tempfile.TemporaryDirectory() as directory:
        write_checkpoint(args.preset, directory)  # random Llama, seed 0: both sides load it
        model = models.from_pretrained(directory)
        torch_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()

    if args.ragged:
        ragged(args, config, model, torch_model, prompt_ids)
        return

    # --- 1. generated tokens/s -----------------------------------------------------------
    ids = jnp.asarray(prompt_ids, jnp.int32)
    mask = jnp.ones_like(ids)
    sample = jgrpo_sampler(model, ids, mask, args.generations, args.new_tokens)
    start = time.perf_counter()
    sample(0)
    first_call_seconds = time.perf_counter() - start  # compile + one run
    jgrpo_seconds = median_seconds(lambda r: sample(r + 1), args.repeats)
    bf16_seconds = None
    if args.bf16_weights:
        sample_bf16 = jgrpo_sampler(
            model, ids, mask, args.generations, args.new_tokens, weights_dtype="bfloat16"
        )
        sample_bf16(0)  # compile
        bf16_seconds = median_seconds(lambda r: sample_bf16(r + 1), args.repeats)

    def torch_generate(seed):
        out = transformers_sample(
            torch_model,
            prompt_ids,
            args.generations,
            seed,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            pad_token_id=0,
        )
        assert out.shape == (rows, args.prompt_length + args.new_tokens), out.shape
        return out

    torch_generate(0)  # warm-up
    torch_seconds = median_seconds(lambda r: torch_generate(r + 1), args.repeats)

    # --- 2. prefill cost against G -------------------------------------------------------
    long_ids = jnp.asarray(
        rng.integers(3, config.vocab_size, (args.prompts, args.prefill_length)), jnp.int32
    )
    prefill = {}
    for generations in (1, 16):
        run = jgrpo_sampler(model, long_ids, jnp.ones_like(long_ids), generations, 1)
        run(0)  # compile
        prefill[generations] = median_seconds(run, args.repeats)

    # --- report --------------------------------------------------------------------------
    print(
        f"preset {args.preset} ({config.num_params / 1e6:.1f}M params, f32); "
        f"{args.prompts} prompts x {args.generations} generations = {rows} sequences, "
        f"prompt length {args.prompt_length}, {args.new_tokens} new tokens each; "
        f"median of {args.repeats}"
    )
    print(
        f"jax {jax.__version__} ({jax.default_backend()}); torch {torch.__version__} "
        f"({torch.get_num_threads()} threads)"
    )
    print(f"\n{'sampler':<28}{'seconds':>10}{'tokens/s':>12}")
    print(f"{'jgrpo rollout':<28}{jgrpo_seconds:>10.2f}{generated / jgrpo_seconds:>12.0f}")
    print(f"{'transformers generate':<28}{torch_seconds:>10.2f}{generated / torch_seconds:>12.0f}")
    print(f"ratio jgrpo/transformers tokens/s: {torch_seconds / jgrpo_seconds:.2f}")
    if bf16_seconds is not None:
        label = "jgrpo rollout, bf16 weights"
        print(f"{label:<28}{bf16_seconds:>10.2f}{generated / bf16_seconds:>12.0f}")
        print(f"ratio jgrpo bf16 weights/transformers tokens/s: {torch_seconds / bf16_seconds:.2f}")
    print(f"jgrpo first call (compile + one run, excluded above): {first_call_seconds:.1f} s")
    print(
        f"\nprefill: {args.prompts} prompts x {args.prefill_length} tokens, 1 new token: "
        f"G=1 {prefill[1]:.3f} s, G=16 {prefill[16]:.3f} s, "
        f"ratio {prefill[16] / prefill[1]:.2f} (target <= 1.3)"
    )
    tunables = os.environ.get("GLIBC_TUNABLES")
    if tunables:
        print(f"\nBoth samplers ran with GLIBC_TUNABLES={tunables}, as jgrpo's CLI runs itself.")


if __name__ == "__main__":
    main()
