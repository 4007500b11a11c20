"""The multi-turn demo task: a value only a lookup can give.

    user ">k"  ->  model "?"  ->  lookup answers "=7"  ->  model "7"

Each example pairs a key (a letter) with a digit drawn for that example alone, so no policy
can know it: the model must look it up. Its environment (`LookupEnvironment`) answers a turn
that is exactly "?" with the example's value, as a tool message, and ends the episode on any
other turn (the answer). Two rewards, logged apart: `correct` (1 when the last turn is the
value) and `lookup` (1 when the model looked the value up, 0.5 when its first turn only began
with "?"; weighted 0.2, so that asking never outweighs a right answer).

It comes with a character tokenizer of its 24 characters and a chat template of one-character
role marks (">" user, "=" tool, ":" assistant), so a model initialised from scratch can learn
it on a CPU in minutes (`configs/tool-demo.yaml`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jgrpo.tasks.arithmetic import char_tokenizer
from jgrpo.tasks.base import Task
from jgrpo.tools import EnvironmentStep

KEYS = "klmnopqrsw"
_ALPHABET = "0123456789?" + KEYS + ">=:\n"
_ROLE_MARKS = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}>{% elif m['role'] == 'tool' %}={% else %}:{% endif %}"
    "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}:{% endif %}"
)


def lookup_tokenizer():
    """One token per character of the task, with the role-mark chat template."""
    tokenizer = char_tokenizer(_ALPHABET)
    tokenizer.chat_template = _ROLE_MARKS
    return tokenizer


class LookupEnvironment:
    """One episode: the model may ask "?" for the example's value, then answers."""

    def reset(self, example: Mapping[str, Any]) -> list[dict[str, Any]]:
        self.value = example["answer"]
        return list(example["prompt"])

    def step(self, messages: Sequence[Mapping[str, Any]]) -> EnvironmentStep:
        if messages[-1]["content"] == "?":
            return EnvironmentStep([{"role": "tool", "content": self.value}], False, 1)
        return EnvironmentStep([], done=True)


def _turns(completion) -> list[str]:
    return [m["content"] for m in completion if m["role"] == "assistant"]


def correct_reward(completions, answer, **_) -> list[float]:
    """1.0 when the episode's last turn is exactly the value."""
    return [float(_turns(c)[-1].strip() == a) for c, a in zip(completions, answer, strict=True)]


def lookup_reward(completions, **_) -> list[float]:
    """1.0 when the value was looked up; 0.5 when the first turn began with "?"."""
    return [
        1.0 if any(m["role"] == "tool" for m in c) else 0.5 * _turns(c)[0].startswith("?")
        for c in completions
    ]


def lookup_task(num_examples: int = 2000, held_out: int = 0, seed: int = 0) -> Task:
    """`num_examples` (key, digit) examples drawn with the seed; `held_out` of them (or, with
    0, another 100 drawn alike) are the eval split."""
    rng = np.random.default_rng(seed)
    total = num_examples + (held_out or 100)

    def example(index: int) -> dict:
        key, value = KEYS[rng.integers(len(KEYS))], str(rng.integers(10))
        return {"prompt": [{"role": "user", "content": key}], "answer": value, "id": index}

    examples = [example(i) for i in range(total)]
    return Task(
        name="lookup",
        train=examples[:num_examples],
        eval=examples[num_examples:],
        reward_fns={"correct": correct_reward, "lookup": lookup_reward},
        reward_weights={"correct": 1.0, "lookup": 0.2},
        correctness="correct",
        tokenizer=lookup_tokenizer(),
        environment=LookupEnvironment,
    )
