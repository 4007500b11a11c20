"""Format rewards: does a completion follow the layout the prompt asked for?

Reasoning-style GRPO (DeepSeek-R1 and its reproductions) asks for a think block and then an
answer block, and rewards the layout apart from correctness so the policy learns the form
early. A layout check is all or nothing over the whole completion: a reply with two answer
blocks, an empty think block or prose after the answer must not earn format credit, or the
policy learns to pad. `tag_count_reward` is the optional partial credit for each tag.

Some chat templates open the think block in the prompt (the completion starts inside it);
pass a `pattern` without the leading `<think>` for those models.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from jgrpo.rewards.math import Completion, completion_text

# A block's body: at least one non-space character, and no think/answer tag inside it.
_BODY = r"\s*(?:(?!</?(?:think|answer)>)\S)(?:(?!</?(?:think|answer)>).)*"
THINK_ANSWER = rf"<think>{_BODY}</think>\s*<answer>{_BODY}</answer>"

TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def _compile(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as error:
        raise ValueError(f"invalid layout pattern {pattern!r}: {error}") from error


def layout_reward(
    prompts: Sequence[Any],
    completions: Sequence[Completion],
    *,
    pattern: str = THINK_ANSWER,
    **_,
) -> list[float]:
    """1.0 when the whole stripped completion matches `pattern` (re.fullmatch, DOTALL)."""
    regex = _compile(pattern)
    return [
        float(regex.fullmatch(completion_text(completion).strip()) is not None)
        for completion in completions
    ]


def make_layout_reward(pattern: str, name: str | None = None) -> Callable[..., list[float]]:
    """A reward function for a custom layout regex, named `name` (default "layout_reward").

    The pattern is checked here, so a typo fails when the task is built, not mid-run.
    """
    _compile(pattern)

    def reward(prompts, completions, **_) -> list[float]:
        return layout_reward(prompts, completions, pattern=pattern)

    reward.__name__ = reward.__qualname__ = name or "layout_reward"
    reward.__doc__ = f"1.0 when the whole stripped completion matches {pattern!r}."
    return reward


def tag_count_reward(prompts: Sequence[Any], completions: Sequence[Completion], **_) -> list[float]:
    """0.25 for each of <think>, </think>, <answer>, </answer> that appears exactly once."""
    return [
        0.25 * sum(completion_text(completion).count(tag) == 1 for tag in TAGS)
        for completion in completions
    ]
