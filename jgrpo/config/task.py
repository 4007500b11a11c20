"""The `task` section: the data, its eval split and the reward functions."""

from __future__ import annotations

import dataclasses

from jgrpo._checks import check_choice
from jgrpo.config.fields import ConfigError, option

TASKS = ("addition", "lookup", "json_extraction", "gsm8k", "jsonl", "tfds")


@dataclasses.dataclass(frozen=True)
class TaskSection:
    """The data, its eval split and the reward functions (see docs/training.md)."""

    name: str = option(
        "addition",
        "addition (the demo), lookup (the multi-turn demo), json_extraction, gsm8k, jsonl or tfds",
    )
    dataset: str | None = option(None, "tfds: the TFDS dataset name")
    path: str | None = option(None, "jsonl: the data file; gsm8k: a folder of <split>.jsonl")
    eval_path: str | None = option(None, "jsonl: a separate eval file")
    data_dir: str | None = option(None, "gsm8k / tfds: the TFDS data_dir")
    split: str = option("train", "gsm8k / tfds: the training split")
    eval_split: str = option("test", "gsm8k / tfds: the eval split")
    prompt_field: str = option("prompt", "jsonl / tfds: the field that holds the prompt")
    system_prompt: str | None = option(
        None, "chat prompts start with this system message (gsm8k: None keeps its own)"
    )
    rewards: str | None = option(
        None,
        "'name:weight,...' of built-in rewards or your own module:function[:weight]; None: the "
        "task's own (jsonl, tfds: required)",
    )
    tools: str | None = option(
        None,
        "tools the model may call in multi-turn episodes (rollout.max_turns >= 2): built-in "
        "python, or your own module:function, comma-separated; None: the task's own",
    )
    on_error: str = option("reject", "malformed rows or too-long prompts: reject or skip")
    chat: bool = option(False, "addition / json_extraction / jsonl / tfds: as chat messages")
    max_operand: int = option(9, "addition: operands go from 0 to this")
    num_examples: int = option(2000, "json_extraction / lookup: examples generated")
    held_out: int = option(0, "examples kept out of training for eval (0: the task's eval split)")
    eval_size: int = option(0, "evaluate on the first N eval examples (0 = all)")
    max_reward_failure_share: float = option(
        0.1, "stop if more than this share of a step's reward scores fail"
    )
    reward_workers: int = option(2, "processes that run reward functions (0: in-process)")
    reward_timeout_s: float = option(60.0, "a reward call slower than this scores None")

    def check(self):
        if self.reward_workers < 0 or self.reward_timeout_s <= 0:
            raise ConfigError(
                "task.reward_workers must be >= 0 and task.reward_timeout_s > 0; got "
                f"{self.reward_workers}, {self.reward_timeout_s}."
            )
        check_choice("task.name", self.name, TASKS, ConfigError)
        check_choice("task.on_error", self.on_error, ("reject", "skip"), ConfigError)
        if self.name == "jsonl" and (self.path is None or self.rewards is None):
            raise ConfigError(
                "task.name=jsonl needs task.path (the data file) and task.rewards (e.g. "
                "'math:1.0,think_answer_format:0.2'); see docs/training.md."
            )
        if self.name == "tfds" and (self.dataset is None or self.rewards is None):
            raise ConfigError(
                "task.name=tfds needs task.dataset (a TFDS name) and task.rewards (e.g. "
                "'math:1.0'); see docs/training.md."
            )
        for name in ("max_operand", "num_examples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"task.{name} must be >= 1, got {getattr(self, name)}.")
        if self.held_out < 0 or self.eval_size < 0:
            raise ConfigError(
                "task.held_out and task.eval_size must be >= 0; got "
                f"{self.held_out}, {self.eval_size}."
            )
        if not 0 <= self.max_reward_failure_share <= 1:
            raise ConfigError(
                "task.max_reward_failure_share must be in [0, 1], got "
                f"{self.max_reward_failure_share}."
            )
