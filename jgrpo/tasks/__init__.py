"""Tasks: a dataset of examples, how each becomes a prompt, and the rewards that score it.

An example is a dict with a "prompt" (plain text, or chat messages for the tokenizer's chat
template) and any other fields its reward functions read (e.g. "answer"). Examples are
drawn in an order fixed by the seed, so a run's data position is a single integer that a
checkpoint can store and a resumed run can continue from.
"""

from __future__ import annotations

from typing import Any

from jgrpo.tasks.base import Task, take


def get_task(name: str, **options: Any) -> Task:
    """A built-in task by name, built with `options` (the builder's keyword arguments)."""
    from jgrpo.tasks import arithmetic, datasets, gsm8k, json_extraction, lookup

    builders = {
        "addition": arithmetic.addition_task,
        "lookup": lookup.lookup_task,
        "json_extraction": json_extraction.json_extraction_task,
        "gsm8k": gsm8k.gsm8k_task,
        "jsonl": datasets.jsonl_task,
        "tfds": datasets.tfds_task,
    }
    if name not in builders:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(builders)}.")
    return builders[name](**options)


__all__ = ["Task", "get_task", "take"]
