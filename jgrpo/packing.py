"""Packing a group's completions into fewer rows, so that the update skips their padding.

A rollout returns each completion right-padded to the batch's N columns, and the update's
layers run on every column (`algorithm.completion_buckets` only drops the columns that no
row uses). With `algorithm.pack_completions`, the completions of each group are placed,
longest first, into the first of Gb rows of N slots with room for them (first-fit
decreasing), several short ones to a row. The shared-prompt forward
(`jgrpo.models.group_forward`) then runs the group's prompt and its Gb packed rows, and each
token attends only to its prompt and its own completion's earlier tokens, so log-probs,
loss and gradients equal the padded batch's up to rounding.

Gb is the same for every group of a step (static shapes): the most rows any group needs,
rounded up to one of `packed_row_counts(G)`, so that a run compiles at most four programs
per completion width. The host plans the packing (numpy); the model reads it as indices.
"""

from __future__ import annotations

import numpy as np

from jgrpo.models.group_forward import PackedCompletions


def packed_row_counts(group_size: int) -> tuple[int, ...]:
    """The packed rows per group a step may use: multiples of ceil(G / 4), at most G."""
    step = -(-group_size // 4)
    return tuple(sorted({min(group_size, k * step) for k in range(1, 5)}))


def completion_lengths(mask: np.ndarray) -> np.ndarray:  # bool[B, N] -> int[B]
    """Real tokens per row; raises unless each row's real tokens come first (right padding)."""
    mask = np.asarray(mask, bool)
    lengths = mask.sum(axis=1)
    if not np.array_equal(mask, np.arange(mask.shape[1])[None] < lengths[:, None]):
        raise ValueError(
            "pack_completions needs right-padded completions (each row's real tokens first, "
            "then padding); got a completion mask with padding between real tokens."
        )
    return lengths


def first_fit(lengths: np.ndarray, capacity: int) -> list[tuple[int, int]]:
    """(packed row, first slot) of each length: longest first, into the first row with room."""
    free: list[int] = []  # slots left in each packed row
    placed = [(0, 0)] * len(lengths)
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = int(lengths[index])
        if length > capacity:
            raise ValueError(f"a completion of {length} tokens does not fit {capacity} slots.")
        row = next((r for r, room in enumerate(free) if room >= length), len(free))
        if row == len(free):
            free.append(capacity)
        placed[index] = (row, capacity - free[row])
        free[row] -= length
    return placed


def rows_needed(lengths: np.ndarray, group_size: int, width: int) -> int:
    """The most packed rows of `width` slots any group of `group_size` rows needs."""
    groups = np.asarray(lengths).reshape(-1, group_size)
    return max((1 + max((row for row, _ in first_fit(g, width)), default=0)) for g in groups)


def pack_completions(
    lengths: np.ndarray,  # int[B]: real completion tokens per row (prompt-major rows)
    *,
    group_size: int,
    width: int,  # N: the batch's completion columns, also each packed row's slots
    rows_per_group: int,  # Gb: from packed_row_counts, at least rows_needed
    prompt_length: int,  # Lp: the batch's prompt columns
) -> PackedCompletions:
    """The packing of each group's completions into `rows_per_group` rows (numpy arrays).

    Row g's token t (t < its length) lands in slot s of packed row r; the hidden state that
    predicts it is the previous token's slot, or the prompt's last column for t = 0. The
    predictor of a padding position points at the prompt's last column (any real token
    would do: the loss masks it).
    """
    lengths = np.asarray(lengths)
    groups = lengths.reshape(-1, group_size)  # [P, G]
    source = np.full((len(groups), rows_per_group, width), -1, np.int32)  # [P, Gb, N]
    predictor = np.full((len(lengths), width), prompt_length - 1, np.int32)  # [B, N]
    for p, group in enumerate(groups):
        placed = first_fit(group, width)
        if max(row for row, _ in placed) >= rows_per_group:
            raise ValueError(
                f"group {p}'s completions need more than rows_per_group={rows_per_group} "
                f"packed rows of {width} slots; use rows_needed."
            )
        for g, (row, start) in enumerate(placed):
            length = int(group[g])
            source[p, row, start : start + length] = g * width + np.arange(length)
            # token t > 0 is predicted by token t - 1, at group slot Lp + row * N + start + t - 1
            first = prompt_length + row * width + start
            predictor[p * group_size + g, 1:length] = first + np.arange(length - 1)
    return PackedCompletions(source=source.reshape(-1, width), predictor=predictor)
