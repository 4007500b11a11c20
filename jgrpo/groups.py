"""`Groups`: the rows of a step's sampled groups with their rewards, as the collect stage
hands them to the batch stage (host arrays, prompt-major: group g is rows g*G .. g*G+G-1)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass
class Groups:
    """Rows of sampled groups with their rewards: host arrays of this process's rows (all
    P * G with one process), prompt-major."""

    prompt_ids: np.ndarray  # int32[R, L]
    prompt_mask: np.ndarray  # int32[R, L]
    tokens: np.ndarray  # int32[R, N]
    mask: np.ndarray  # bool[R, N]: every written token (what attention sees)
    sampler_logprobs: np.ndarray  # f32[R, N]: Rollout.sampler_logprobs, 0 where masked
    lengths: np.ndarray  # int32[R]
    truncated: np.ndarray  # bool[R]
    rewards: np.ndarray  # f32[R]: weighted sum + penalties
    valid: np.ndarray  # bool[R]
    per_function: dict[str, np.ndarray]  # name -> f32[R] (NaN where not scored)
    texts: list[str]
    prompts: list[Any]
    # bool[R, N]: the model's own tokens, what the loss sees; multi-turn episodes: not the
    # answers between turns. None: every written token (`mask`), as for single turns.
    model_mask: np.ndarray | None = None

    @property
    def loss_mask(self) -> np.ndarray:  # bool[R, N]
        """The tokens the update trains on: `model_mask`, or `mask` for single turns."""
        return self.mask if self.model_mask is None else self.model_mask

    def select_groups(self, groups: Sequence[int], group_size: int) -> Groups:
        """The rows of the given groups, in that order."""
        rows = np.concatenate([np.arange(g * group_size, (g + 1) * group_size) for g in groups])
        return Groups(**{name: _take(value, rows) for name, value in vars(self).items()})

    @staticmethod
    def concatenate(parts: Sequence[Groups]) -> Groups:
        names = vars(parts[0])
        return Groups(**{name: _join([vars(p)[name] for p in parts]) for name in names})


def _take(field, rows: np.ndarray):
    """Rows of one Groups field: an array, a dict of arrays, a list or None."""
    if field is None:
        return None
    if isinstance(field, dict):
        return {key: value[rows] for key, value in field.items()}
    if isinstance(field, list):
        return [field[row] for row in rows]
    return field[rows]


def _join(fields: list):
    """One Groups field of several parts, stacked along the rows."""
    if fields[0] is None:
        return None
    if isinstance(fields[0], dict):
        return {key: np.concatenate([f[key] for f in fields]) for key in fields[0]}
    if isinstance(fields[0], list):
        return [item for f in fields for item in f]
    return np.concatenate(fields)
