"""Evaluation: greedy completions of the task's eval split (greedy episodes for multi-turn
tasks), scored by its reward functions (mean reward, and accuracy: the share whose
correctness reward is 1), with a few samples."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jgrpo.collect import encode_examples, run_setup_episodes, sample, score, score_episodes

if TYPE_CHECKING:
    from jgrpo.rewards.pool import VerifierPool
    from jgrpo.setup import Setup


def evaluate_greedy(
    setup: Setup, params, pool: VerifierPool | None
) -> tuple[dict[str, float], list[tuple[Any, str, float]]]:
    """Greedy completions of the eval examples: mean reward and accuracy (over every
    process's rows; the samples to log are this process's)."""
    c, task = setup.config, setup.task
    examples = list(task.eval[: c.task.eval_size] if c.task.eval_size else task.eval)
    chunk = c.rollout.prompts_per_step
    totals, correct, real, samples = [], [], [], []
    for start in range(0, len(examples), chunk):
        part = examples[start : start + chunk]
        padded = part + [part[-1]] * (chunk - len(part))  # same shape for every chunk
        local = setup.block.take(padded)
        is_real = setup.block.take(np.arange(chunk)) < len(part)  # padding at the end
        rows = int(is_real.sum())
        # Padding rows are scored too: a reward model's scoring is a collective call
        # that every process makes, even one whose rows are all padding.
        if setup.environment is not None:  # multi-turn: greedy episodes, their conversations
            episodes = run_setup_episodes(setup, params, local, jax.random.key(0), setup.greedy, 1)
            with setup.frozen_reward_statistics():
                prompts, texts, scores = score_episodes(setup, local, episodes, pool)
        else:
            ids, mask = encode_examples(
                setup.tokenizer, local, setup.prompt_widths["eval"], c.rollout.max_prompt_length
            )
            result = sample(setup, params, ids, mask, jax.random.key(0), setup.greedy, 1)
            with setup.frozen_reward_statistics():
                prompts, texts, scores = score(
                    setup, local, result.tokens, result.lengths, result.truncated, pool
                )
        real_rows = zip(prompts, texts, scores.total.tolist(), strict=True)
        samples.extend(list(real_rows)[:rows])
        totals.append(setup.block.gather(scores.total.astype(np.float64)))
        correct.append(setup.block.gather(scores.per_function[task.correctness] >= 1.0))
        real.append(setup.block.gather(is_real))
    real = np.concatenate(real)
    metrics = {
        "eval/reward": float(np.concatenate(totals)[real].mean()),
        "eval/accuracy": float(np.concatenate(correct)[real].mean()),
    }
    spread = max(1, len(samples) // max(c.train.log_samples, 1))  # across the eval set
    return metrics, samples[::spread][: c.train.log_samples]
