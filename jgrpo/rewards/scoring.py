"""Calls a task's reward functions on a batch of completions and combines them.

Rules (those of TRL's GRPOTrainer, plus failure handling):
- each function gets `prompts`, `completions` and every other example field as a keyword
  argument holding one value per completion (plus `completion_ids`), and returns one
  float (or None) per completion;
- None means "cannot score": that function is left out of the completion's weighted sum;
  a completion no function could score is invalid (left out of its group's statistics,
  advantage 0);
- an exception is caught: the function is called again row by row to find the offending
  examples, which are logged and scored None; NaN is treated the same way;
- with a `VerifierPool`, each call runs in a worker process and a call that outlasts its
  timeout counts as an exception (see jgrpo/rewards/pool.py), except for functions marked
  `in_process = True` (a reward model, which holds device arrays);
- a step stops with `RewardError` only if more than `max_failure_share` of its
  (function, completion) scores failed, or a function returns the wrong number of values.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jgrpo.rewards.pool import VerifierPool

RewardFn = Callable[..., Sequence[float | None]]

logger = logging.getLogger("jgrpo.rewards")


class RewardError(RuntimeError):
    """A reward function is broken beyond what a run should tolerate."""


@dataclasses.dataclass
class Scores:
    """Rewards of B completions."""

    total: np.ndarray  # f32[B]: weighted sum over the functions that scored (0 if none did)
    valid: np.ndarray  # bool[B]: at least one function scored the completion
    per_function: dict[str, np.ndarray]  # name -> f32[B], NaN where it could not score
    failures: dict[str, int]  # name -> scores lost to exceptions or NaN


def completion_text(completion: Any) -> str:
    """A completion's text: the string itself, or the content of the last chat message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return completion["content"]
    return completion[-1]["content"]


def _as_score(value: Any, name: str, row: int) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool | int | float | np.number) or (
        isinstance(value, np.ndarray) and value.ndim == 0
    ):
        return float(value)
    raise RewardError(
        f"reward function {name!r} returned {value!r} ({type(value).__name__}) for completion "
        f"{row}; it must return a float or None per completion."
    )


def _call(fn: RewardFn, name: str, prompts, completions, fields, pool) -> list[float | None]:
    kwargs = dict(prompts=list(prompts), completions=list(completions), **fields)
    if pool is None or getattr(fn, "in_process", False):
        values = fn(**kwargs)
    else:
        values = pool.run(fn, kwargs, name=name)
    if values is None or len(values) != len(completions):
        got = "None" if values is None else f"{len(values)} values"
        raise RewardError(
            f"reward function {name!r} returned {got} for {len(completions)} completions; "
            "it must return one float (or None) per completion."
        )
    return [_as_score(v, name, row) for row, v in enumerate(values)]


def _call_row_by_row(fn, name, prompts, completions, fields, error, pool) -> list[float | None]:
    """After a batch call raised: score each row alone, logging the rows that fail."""
    logger.warning("reward function %r raised %r; retrying row by row", name, error)
    scores: list[float | None] = []
    for row in range(len(completions)):
        row_fields = {key: values[row : row + 1] for key, values in fields.items()}
        try:
            (value,) = _call(
                fn, name, prompts[row : row + 1], completions[row : row + 1], row_fields, pool
            )
        except RewardError:
            raise
        except Exception:  # a reward function may raise anything; it must not kill the run
            logger.warning(
                "reward function %r failed on completion %d (scored None)\nprompt: %r\n"
                "completion: %r\n%s",
                name,
                row,
                prompts[row],
                completions[row],
                traceback.format_exc(limit=3),
            )
            value = None
        scores.append(value)
    return scores


def score_completions(
    reward_fns: Mapping[str, RewardFn],
    weights: Mapping[str, float],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    fields: Mapping[str, Sequence[Any]],
    *,
    max_failure_share: float = 0.1,
    pool: VerifierPool | None = None,
) -> Scores:
    """Scores B completions with every function; see the module docstring for the rules.

    `prompts`, `completions` and each entry of `fields` hold one value per completion. With
    a `pool`, each call runs in a worker process with its timeout (a timeout is a failure).
    """
    rows = len(completions)
    fields = {key: list(values) for key, values in fields.items()}
    per_function: dict[str, np.ndarray] = {}
    failures: dict[str, int] = {}
    for name, fn in reward_fns.items():
        try:
            scores = _call(fn, name, prompts, completions, fields, pool)
            failed = 0
        except RewardError:
            raise
        except Exception as error:  # noqa: BLE001 (isolated per row below)
            scores = _call_row_by_row(fn, name, prompts, completions, fields, error, pool)
            failed = sum(score is None for score in scores)
        nan_rows = [row for row, s in enumerate(scores) if s is not None and math.isnan(s)]
        for row in nan_rows:
            logger.warning("reward function %r gave NaN on completion %d (scored None)", name, row)
        failed += len(nan_rows)
        per_function[name] = np.array(
            [np.nan if s is None else s for s in scores], np.float32
        ).reshape(rows)
        failures[name] = failed

    lost = sum(failures.values())
    if rows and lost > max_failure_share * rows * len(reward_fns):
        detail = ", ".join(f"{name}: {n}" for name, n in failures.items() if n)
        raise RewardError(
            f"{lost} of {rows * len(reward_fns)} reward scores failed this step ({detail}), "
            f"more than the allowed share {max_failure_share}; see the logged examples, fix the "
            "reward function, or raise task.max_reward_failure_share."
        )
    stacked = np.stack([per_function[name] for name in reward_fns], axis=0)  # [F, B]
    weight = np.array([weights.get(name, 1.0) for name in reward_fns], np.float32)[:, None]
    scored = ~np.isnan(stacked)
    total = np.where(scored, stacked * weight, 0.0).sum(axis=0).astype(np.float32)
    return Scores(
        total=total, valid=scored.any(axis=0), per_function=per_function, failures=failures
    )
