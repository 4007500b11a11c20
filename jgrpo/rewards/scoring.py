"""Calls a task's reward functions on a batch of completions and combines them.

Rules (those of TRL's GRPOTrainer, plus failure handling):
- each function gets `prompts`, `completions` and every other example field as a keyword
  argument holding one value per completion (plus `completion_ids`), and returns one
  float (or None) per completion;
- None means "cannot score": that function is left out of the completion's weighted sum;
  a completion no function could score is invalid (left out of its group's statistics,
  advantage 0);
- an exception is caught: the function is called again row by row to find the offending
  examples, which are logged and scored None; a non-finite score (NaN, +-inf, or beyond
  float32's range) is treated the same way, since one would make the loss NaN;
- with a `VerifierPool`, each call runs in a worker process (or, for functions no worker can
  import, in a thread here) and a call that outlasts its timeout or whose worker dies counts
  as an exception (see jgrpo/rewards/pool.py); functions marked `in_process = True` (a reward
  model, which holds device arrays) are called directly;
- a step stops with `RewardError` only if more than `max_failure_share` of its
  (function, completion) scores failed, or a function returns the wrong number of values. It
  stops as soon as the share is passed, so a function that always fails, hangs or kills its
  worker costs its batch call and about `max_failure_share` x B row calls, not B of them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the pool raises RewardError: it imports this module
    from jgrpo.rewards.pool import VerifierPool

RewardFn = Callable[..., Sequence[float | None]]

logger = logging.getLogger("jgrpo.rewards")
_FLOAT32_MAX = float(np.finfo(np.float32).max)


class RewardError(RuntimeError):
    """A reward function is broken beyond what a run should tolerate."""


@dataclasses.dataclass
class Scores:
    """Rewards of B completions."""

    total: np.ndarray  # f32[B]: weighted sum over the functions that scored (0 if none did)
    valid: np.ndarray  # bool[B]: at least one function scored the completion
    per_function: dict[str, np.ndarray]  # name -> f32[B], NaN where it could not score
    failures: dict[str, int]  # name -> scores lost to exceptions, timeouts or non-finite values


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


def _finite(score: float) -> bool:
    """Whether a score is a finite float32 (1e39 is a finite float but inf as a float32)."""
    return math.isfinite(score) and abs(score) <= _FLOAT32_MAX


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


class _Failures:
    """Scores lost this step, per function. `lose` raises RewardError as soon as more than the
    allowed share is lost, so a function that always fails or hangs stops the step after about
    share x completions retries (and timeouts), not one per completion."""

    def __init__(self, names: Sequence[str], rows: int, share: float):
        self.counts = dict.fromkeys(names, 0)
        self.scores, self.share = rows * len(self.counts), share

    def lose(self, name: str) -> None:
        self.counts[name] += 1
        lost = sum(self.counts.values())
        if lost > self.share * self.scores:
            detail = ", ".join(f"{key}: {n}" for key, n in self.counts.items() if n)
            raise RewardError(
                f"{lost} of {self.scores} reward scores failed this step ({detail}), more than "
                f"the allowed share {self.share}; see the logged examples, fix the reward "
                "function, or raise task.max_reward_failure_share."
            )


def _call_row_by_row(
    fn, name, prompts, completions, fields, error, pool, failures: _Failures
) -> list[float | None]:
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
            failures.lose(name)
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
    failures = _Failures(list(reward_fns), rows, max_failure_share)
    for name, fn in reward_fns.items():
        try:
            scores = _call(fn, name, prompts, completions, fields, pool)
        except RewardError:
            raise
        except Exception as error:  # noqa: BLE001 (isolated per row below)
            scores = _call_row_by_row(fn, name, prompts, completions, fields, error, pool, failures)
        for row, score in enumerate(scores):
            if score is not None and not _finite(score):
                logger.warning(
                    "reward function %r gave %r on completion %d (scored None)", name, score, row
                )
                scores[row] = None
                failures.lose(name)
        per_function[name] = np.array(
            [np.nan if s is None else s for s in scores], np.float32
        ).reshape(rows)

    stacked = np.stack([per_function[name] for name in reward_fns], axis=0)  # [F, B]
    weight = np.array([weights.get(name, 1.0) for name in reward_fns], np.float32)[:, None]
    scored = ~np.isnan(stacked)
    total = np.where(scored, stacked * weight, 0.0).sum(axis=0).astype(np.float32)
    return Scores(
        total=total,
        valid=scored.any(axis=0),
        per_function=per_function,
        failures=failures.counts,
    )
