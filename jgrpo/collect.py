"""Collect: a step's prompts -> G completions each -> rewards -> the step's `Groups`.

`collect_groups` takes the next prompts of the task (order fixed by the seed, from the data
position), samples G completions of each on the mesh (`jgrpo.rollout.rollout`), decodes and
scores them (`jgrpo.rewards.score_completions`), adds the optional overlong penalty and
KL-in-reward term, and with dynamic sampling replaces groups whose rewards are all equal by
groups of new prompts. It returns this process's rows, the metrics of every process's rows,
and the new data position.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo import distributed, tasks
from jgrpo.batches import to_batch
from jgrpo.generation import encode_prompts, pad_prompts
from jgrpo.groups import Groups
from jgrpo.losses import sequence_kl
from jgrpo.programs import zero_signal_program
from jgrpo.rewards import Scores, score_completions
from jgrpo.rollout import Rollout, concurrent_rows
from jgrpo.sharding import rules_context

if TYPE_CHECKING:
    from jgrpo.rewards.pool import VerifierPool
    from jgrpo.setup import Setup


def collect_groups(
    setup: Setup, params, ref_params, key, position: int, pool: VerifierPool | None
) -> tuple[Groups, dict, int]:
    """Stages 1-3: rollouts (more than one with dynamic sampling) -> the step's groups.

    The groups are this process's rows; the metrics cover every process's rows.
    """
    c, g = setup.config, setup.group_size
    p = c.rollout.prompts_per_step
    first, stop = setup.block.bounds(p)
    local_prompts = stop - first
    attempts = 1 + (c.algorithm.max_extra_rollouts if c.algorithm.dynamic_sampling else 0)
    sampled: list[Groups] = []
    signal_free: list[np.ndarray] = []  # bool[local prompts] of each rollout
    kept: list[Groups] = []
    metrics: dict[str, float] = {"time/rollout": 0.0, "time/reward": 0.0}
    decode_steps = 0
    failures = 0
    episode_counts: dict[str, int] = {}  # multi-turn: tool calls, turns, truncations
    for attempt in range(attempts):
        examples = tasks.take(setup.task.train, p, position=position, seed=c.train.seed)
        position += p
        groups, timings = sample_and_score(
            setup, params, ref_params, examples, jax.random.fold_in(key, attempt), pool
        )
        metrics["time/rollout"] += timings["time/rollout"]
        metrics["time/reward"] += timings["time/reward"]
        failures += timings["reward_failures"]
        decode_steps += timings["decode_steps"]
        for name, count in timings.get("episodes", {}).items():
            episode_counts[name] = episode_counts.get(name, 0) + count
        sampled.append(groups)
        signal_free.append(zero_signal_of(groups, g))
        if not c.algorithm.dynamic_sampling:
            break
        with_signal = np.flatnonzero(~signal_free[-1])
        if with_signal.size:
            kept.append(groups.select_groups(with_signal, g))
        # Every process samples again until all of them have enough groups.
        if distributed.agree_all(sum(len(k.rewards) for k in kept) >= local_prompts * g):
            break
    everything = Groups.concatenate(sampled)
    flat_all = np.concatenate(signal_free)
    batch_groups = everything
    if c.algorithm.dynamic_sampling:
        missing = local_prompts - sum(len(k.rewards) for k in kept) // g
        if missing > 0:  # extra rollouts exhausted: fill with zero-signal groups
            kept.append(everything.select_groups(np.flatnonzero(flat_all)[:missing], g))
        batch_groups = Groups.concatenate(kept).select_groups(range(local_prompts), g)
        metrics["dynamic/extra_rollouts"] = len(sampled) - 1
        metrics["dynamic/zero_signal_kept"] = int(setup.block.gather([max(missing, 0)]).sum())

    gather = setup.block.gather  # every process's rows, for the metrics
    valid = gather(everything.valid)
    rewards = gather(everything.rewards)[valid]
    lengths = gather(everything.lengths)
    metrics["reward/mean"] = float(rewards.mean()) if rewards.size else float("nan")
    metrics["reward/std"] = float(rewards.std()) if rewards.size else float("nan")
    for name, values in everything.per_function.items():
        values = gather(values)
        scored = values[~np.isnan(values)]
        metrics[f"reward/{name}/mean"] = float(scored.mean()) if scored.size else float("nan")
        metrics[f"reward/{name}/std"] = float(scored.std()) if scored.size else float("nan")
    metrics["valid_frac"] = float(valid.mean())
    metrics["reward_failures"] = int(gather([failures]).sum())
    metrics["frac_zero_std"] = float(gather(flat_all).mean())
    metrics["completion_len/mean"] = float(lengths.mean())
    metrics["completion_len/max"] = int(lengths.max())
    metrics["truncated_frac"] = float(gather(everything.truncated).mean())
    metrics["tokens"] = int(lengths.sum())
    if episode_counts:  # multi-turn: per episode, over every process's rows
        counts = {name: int(gather([count]).sum()) for name, count in episode_counts.items()}
        episodes = len(lengths)
        metrics["turns/mean"] = counts["turns"] / episodes
        metrics["tools/calls_per_completion"] = counts["tools/calls"] / episodes
        metrics["tools/errors"] = counts["tools/errors"]
        metrics["truncated/turns"] = counts["truncated/turns"] / episodes
        metrics["truncated/tokens"] = counts["truncated/tokens"] / episodes
        metrics["model_tokens/mean"] = float(gather(everything.loss_mask.sum(1)).mean())
    # The decode loop: slots x decode steps it ran, and the share of them that wrote a token
    # (each row's first token comes from the prefill, outside the loop; a multi-turn row's
    # answers between turns are written by decode steps too, its rounds' steps summed).
    slots = concurrent_rows(setup.sampling.max_concurrent, p * g) or p * g
    metrics["rollout/concurrent"] = slots
    metrics["rollout/decode_steps"] = decode_steps
    decoded = int((lengths - 1).sum())
    metrics["rollout/slot_efficiency"] = decoded / (slots * decode_steps) if decode_steps else 1.0
    metrics["rollout/tokens_per_s"] = metrics["tokens"] / max(metrics["time/rollout"], 1e-9)
    return batch_groups, metrics, position


def sample_and_score(
    setup: Setup, params, ref_params, examples, key, pool: VerifierPool | None
) -> tuple[Groups, dict]:
    """Rollout and rewards of this process's share of `examples` (all of them with one
    process); the Groups hold only those rows. Multi-turn tasks: `sample_episodes_and_score`."""
    if setup.environment is not None:
        return sample_episodes_and_score(setup, params, ref_params, examples, key, pool)
    c, g = setup.config, setup.group_size
    timings = {}
    start = time.perf_counter()
    examples = setup.block.take(examples)
    prompt_ids, prompt_mask = encode_examples(
        setup.tokenizer, examples, setup.prompt_widths["train"], c.rollout.max_prompt_length
    )
    host = sample(setup, params, prompt_ids, prompt_mask, key, setup.sampling, g)
    timings["time/rollout"] = time.perf_counter() - start
    # decode steps the rollout ran (the same on every process)
    timings["decode_steps"] = distributed.agree_max(int(np.max(host.finished_at, initial=0)))

    start = time.perf_counter()
    tokens, lengths = np.asarray(host.tokens), np.asarray(host.lengths)
    rows_examples = [example for example in examples for _ in range(g)]
    prompts, texts, scores = score(setup, rows_examples, tokens, lengths, host.truncated, pool)
    rewards, per_function = rewards_with_penalties(setup, scores, lengths)
    timings["time/reward"] = time.perf_counter() - start

    repeat = lambda x: np.repeat(x, g, axis=0)  # noqa: E731
    groups = Groups(
        prompt_ids=repeat(prompt_ids),
        prompt_mask=repeat(prompt_mask),
        tokens=tokens,
        mask=np.asarray(host.mask),
        sampler_logprobs=np.asarray(host.sampler_logprobs),
        lengths=lengths,
        truncated=np.asarray(host.truncated),
        rewards=rewards,
        valid=scores.valid,
        per_function=per_function,
        texts=texts,
        prompts=prompts,
    )
    add_kl_to_rewards(setup, groups, np.asarray(host.logprobs), ref_params, timings)
    timings["reward_failures"] = sum(scores.failures.values())
    return groups, timings


def rewards_with_penalties(
    setup: Setup, scores: Scores, lengths: np.ndarray
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Each row's reward (f32[R]) and its parts by name: the scores, plus DAPO's overlong
    penalty when algorithm.overlong_buffer is set (over the row's whole completion)."""
    algo = setup.config.algorithm
    rewards, per_function = scores.total.copy(), dict(scores.per_function)
    if algo.overlong_buffer:
        penalty = overlong_penalty(
            lengths,
            setup.config.rollout.completion_tokens,
            algo.overlong_buffer,
            algo.overlong_penalty,
        )
        rewards += penalty
        per_function["overlong"] = penalty
    return rewards, per_function


def score_episodes(
    setup: Setup, row_examples: Sequence[Mapping[str, Any]], episodes, pool: VerifierPool | None
) -> tuple[list[Any], list[str], Scores]:
    """`score` for multi-turn episodes: their conversations are the completions."""
    return score(
        setup,
        row_examples,
        episodes.tokens,
        episodes.lengths,
        episodes.truncated,
        pool,
        conversations=episodes.conversations,
        model_mask=episodes.model_mask,
    )


def add_kl_to_rewards(setup: Setup, groups: Groups, logprobs, ref_params, timings: dict) -> None:
    """With algorithm.kl_in_reward: subtracts beta x each row's KL to the reference (over the
    model's tokens; `logprobs` are the policy's, not top-k/p-filtered) from its reward."""
    if not setup.kl_weight_in_reward:
        return
    start = time.perf_counter()
    batch = to_batch(setup, groups, np.zeros(len(groups.texts), np.float32))
    ref = setup.block.local(setup.frozen_logprobs(ref_params, batch))
    kl = np.asarray(
        sequence_kl(
            jnp.asarray(logprobs),
            jnp.asarray(ref),
            jnp.asarray(groups.loss_mask),
            kl_estimator=setup.config.algorithm.kl_estimator,
        )
    )
    groups.rewards = groups.rewards - setup.kl_weight_in_reward * kl
    groups.per_function["kl_penalty"] = -setup.kl_weight_in_reward * kl
    timings["time/reward"] += time.perf_counter() - start


def sample_episodes_and_score(
    setup: Setup, params, ref_params, examples, key, pool: VerifierPool | None
) -> tuple[Groups, dict]:
    """`sample_and_score` for multi-turn tasks: episodes of turns and tool or environment
    answers (`jgrpo.rollout.turns`), scored on their conversations."""
    g = setup.group_size
    timings = {}
    start = time.perf_counter()
    examples = setup.block.take(examples)
    episodes = run_setup_episodes(setup, params, examples, key, setup.sampling, g)
    timings["time/rollout"] = time.perf_counter() - start
    timings["decode_steps"] = episodes.decode_steps  # every round's, the same on every process

    start = time.perf_counter()
    rows_examples = [example for example in examples for _ in range(g)]
    prompts, texts, scores = score_episodes(setup, rows_examples, episodes, pool)
    rewards, per_function = rewards_with_penalties(setup, scores, episodes.lengths)
    timings["time/reward"] = time.perf_counter() - start
    groups = Groups(
        prompt_ids=np.repeat(episodes.prompt_ids, g, axis=0),
        prompt_mask=np.repeat(episodes.prompt_mask, g, axis=0),
        tokens=episodes.tokens,
        mask=episodes.mask,
        model_mask=episodes.model_mask,
        sampler_logprobs=episodes.sampler_logprobs,
        lengths=episodes.lengths,
        truncated=episodes.truncated,
        rewards=rewards,
        valid=scores.valid,
        per_function=per_function,
        texts=texts,
        prompts=prompts,
    )
    add_kl_to_rewards(setup, groups, episodes.logprobs, ref_params, timings)
    timings["reward_failures"] = sum(scores.failures.values())
    timings["episodes"] = {
        "tools/calls": int(episodes.tool_calls.sum()),
        "tools/errors": int(episodes.tool_errors.sum()),
        "turns": int(episodes.turns.sum()),
        "truncated/turns": int(episodes.out_of_turns.sum()),
        "truncated/tokens": int(episodes.out_of_tokens.sum()),
    }
    return groups, timings


def run_setup_episodes(setup: Setup, params, examples, key, sampling, num_generations):
    """This process's episodes of `examples` (`jgrpo.rollout.turns.run_episodes`) on the mesh."""
    from jgrpo.rollout.turns import run_episodes

    width = setup.prompt_widths["train"]
    with rules_context(setup.mesh):
        return run_episodes(
            params,
            examples,
            key,
            new_environment=setup.environment,
            tokenizer=setup.tokenizer,
            model_config=setup.model_config,
            num_generations=num_generations,
            sampling=sampling,
            max_turns=setup.config.rollout.max_turns,
            total_tokens=setup.config.rollout.completion_tokens,
            prompt_width=width,
            tools=setup.tool_schemas,
            place=lambda x: setup.block.to_global(x, _sharding_of(setup, x)),
            local=setup.block.local,
        )


def _sharding_of(setup: Setup, array: np.ndarray):
    """Rows split like the batch: a [B] array's or a [B, T] array's sharding."""
    return setup.rows if np.ndim(array) == 1 else setup.row_matrix


def score(
    setup: Setup,
    row_examples: Sequence[Mapping[str, Any]],
    tokens,
    lengths,
    truncated,
    pool: VerifierPool | None,
    *,
    conversations: Sequence[list[dict[str, Any]]] | None = None,
    model_mask: np.ndarray | None = None,
) -> tuple[list[Any], list[str], Scores]:
    """Decodes each row's completion and scores it against the example it answers. Episodes
    (multi-turn) pass their `conversations`, the completions the rewards get (the model's
    turns and the answers, as messages), and their `model_mask` (completion_ids: the model's
    tokens)."""
    tokens, lengths = np.asarray(tokens), np.asarray(lengths)
    prompts = [example["prompt"] for example in row_examples]
    if conversations is None:
        texts = decode_completions(setup.tokenizer, tokens, lengths, np.asarray(truncated))
        completions = [as_completion(p, t) for p, t in zip(prompts, texts, strict=True)]
    else:
        texts = ["\n".join(f"{m['role']}: {m['content']}" for m in c) for c in conversations]
        completions = list(conversations)
    fields = {
        key: [example.get(key) for example in row_examples]
        for key in row_examples[0]
        if key != "prompt"
    }
    fields["completion_ids"] = [
        tokens[row, : lengths[row]].tolist()
        if model_mask is None
        else tokens[row][model_mask[row]].tolist()
        for row in range(len(texts))
    ]
    scores = score_completions(
        setup.task.reward_fns,
        setup.task.reward_weights,
        prompts,
        completions,
        fields,
        max_failure_share=setup.config.task.max_reward_failure_share,
        pool=pool,
    )
    return prompts, texts, scores


def sample(
    setup: Setup, params, prompt_ids, prompt_mask, key, sampling, num_generations
) -> Rollout:
    """G completions of each prompt, sampled on the mesh: this process's prompts in, its
    rows of the result out (host arrays)."""
    prompt_ids = setup.block.to_global(prompt_ids, setup.row_matrix)
    prompt_mask = setup.block.to_global(prompt_mask, setup.row_matrix)
    with rules_context(setup.mesh):
        result = setup.rollout_program(sampling, num_generations)(
            params, prompt_ids, prompt_mask, key
        )
    return jax.tree.map(setup.block.local, result)


def encode_examples(
    tokenizer, examples: Sequence[Mapping[str, Any]], width: int, max_prompt_length: int
) -> tuple[np.ndarray, np.ndarray]:  # (int32[P, width], int32[P, width])
    """Left-pads prompts to exactly `width` columns (static shapes for the whole run)."""
    token_lists = encode_prompts(tokenizer, [example["prompt"] for example in examples])
    for example, tokens in zip(examples, token_lists, strict=True):
        if len(tokens) > max_prompt_length:
            raise ValueError(
                f"prompt {example['prompt']!r} is {len(tokens)} tokens, more than "
                f"rollout.max_prompt_length={max_prompt_length}; raise it (nothing is truncated)."
            )
        if len(tokens) > width:
            raise ValueError(
                f"prompt {example['prompt']!r} is {len(tokens)} tokens, more than the {width} "
                "columns this Trainer pads prompts to (the longest prompt of the task's data "
                "when it was built); build the Trainer after changing the task's examples."
            )
    return pad_prompts(token_lists, buckets=(width,))


def decode_completions(
    tokenizer, tokens: np.ndarray, lengths: np.ndarray, truncated: np.ndarray
) -> list[str]:
    """Text of each completion without its final stop token.

    Other special tokens stay visible (not skipped as TRL does), so a policy cannot satisfy
    a text verifier by emitting tokens that decode to nothing.
    """
    ends = lengths - (~truncated).astype(lengths.dtype)  # drop the stop token
    return [
        tokenizer.decode(tokens[row, : ends[row]], skip_special_tokens=False)
        for row in range(tokens.shape[0])
    ]


def as_completion(prompt: Any, text: str) -> Any:
    """TRL's convention: chat prompts get chat completions, text prompts get text."""
    return text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]


def zero_signal_of(groups: Groups, group_size: int) -> np.ndarray:
    """bool[groups]: `jgrpo.zero_signal_groups` of prompt-major rows (advantage 0, no
    gradient); one compiled program per run, as every rollout has the same rows."""
    rows = len(groups.rewards)
    group_ids = jnp.asarray(np.arange(rows) // group_size, jnp.int32)
    return np.asarray(
        zero_signal_program(groups.rewards, group_ids, rows // group_size, valid=groups.valid)
    )


def overlong_penalty(lengths: np.ndarray, limit: int, buffer: int, factor: float) -> np.ndarray:
    """DAPO's soft penalty: 0 up to limit - buffer tokens, then linear down to -factor."""
    if buffer == 0:
        return np.zeros(lengths.shape, np.float32)
    excess = np.clip(lengths - (limit - buffer), 0, buffer)
    return (-factor * excess / buffer).astype(np.float32)
