"""Batches: a step's `Groups` -> advantages -> the update's `Batch`.

Advantages come from each group's rewards (`jgrpo.group_advantages`, over every process's
rows). The batch keeps only the completion columns some row uses, rounded up to one of
`algorithm.completion_buckets` widths (each width is one compiled update), and with
`algorithm.pack_completions` packs each group's completions into fewer rows
(`jgrpo.packing`); either way the loss, gradients and metrics equal the padded batch's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo import distributed
from jgrpo.groups import Groups
from jgrpo.packing import completion_lengths, pack_completions, packed_row_counts, rows_needed
from jgrpo.programs import group_advantages_program
from jgrpo.update import Batch

if TYPE_CHECKING:
    from jgrpo.setup import Setup


def completion_width(setup: Setup, groups: Groups) -> int:
    """The narrowest of `completion_widths` that holds every process's longest completion.

    Completion tokens attend only to earlier ones, so dropping columns that no row uses
    changes no log-prob, loss or gradient beyond float rounding (`UpdateConfig`'s
    max_completion_length keeps dr_grpo's divisor)."""
    if len(setup.completion_widths) == 1:
        return setup.completion_widths[0]
    used = np.flatnonzero(groups.mask.any(axis=0))
    longest = distributed.agree_max(int(used[-1]) + 1 if used.size else 0)
    return next(width for width in setup.completion_widths if width >= longest)


def update_shape(setup: Setup, groups: Groups) -> tuple[int, int | None]:
    """The completion width and packed rows per group (None: no packing) of the step's
    update, the same on every process.

    Without `algorithm.pack_completions`: the narrowest width that holds every
    completion. With it: of the widths that hold every completion, each with the fewest
    of `packed_row_counts(G)` rows that hold every group's completions, the pair with
    the fewest slots per group (width x rows; on a tie the narrower width). A narrower
    width can need more rows: short completions pack better into wide rows.
    """
    if not setup.config.algorithm.pack_completions:
        return completion_width(setup, groups), None
    g = setup.group_size
    lengths = completion_lengths(groups.mask)
    longest = int(lengths.max(initial=0))
    # rows each width needs here; G + 1 marks a width some completion does not fit
    needed = [
        rows_needed(lengths, g, width) if longest <= width else g + 1
        for width in setup.completion_widths
    ]
    choices = []
    agreed = distributed.agree_max_each(needed)
    for width, rows in zip(setup.completion_widths, agreed, strict=True):
        if rows <= g:
            rows = next(count for count in packed_row_counts(g) if count >= rows)
            choices.append((width * rows, width, rows))
    _, width, rows = min(choices)
    return width, rows


def to_batch(
    setup: Setup,
    groups: Groups,
    advantages: np.ndarray,
    width: int | None = None,
    packed_rows: int | None = None,
) -> Batch:
    """The update's batch; `width` keeps the first `width` completion columns (None: all),
    and with `algorithm.pack_completions` each group's completions are packed into
    `packed_rows` rows (None: G). Attention sees every written token (`Groups.mask`), the
    loss only the model's own (`Groups.model_mask`)."""
    tokens, mask = groups.tokens[:, :width], groups.mask[:, :width]
    completion_mask = groups.loss_mask[:, :width]  # multi-turn: not the answers between turns
    if setup.config.algorithm.mask_truncated:
        completion_mask = completion_mask & ~groups.truncated[:, None]
    packed = None
    if setup.config.algorithm.pack_completions:
        packed = pack_completions(
            completion_lengths(mask),
            group_size=setup.group_size,
            width=tokens.shape[1],
            rows_per_group=setup.group_size if packed_rows is None else packed_rows,
            prompt_length=groups.prompt_ids.shape[1],
        )
    batch = Batch(
        input_ids=np.concatenate([groups.prompt_ids, tokens], axis=1),
        attention_mask=np.concatenate([groups.prompt_mask, mask.astype(np.int32)], axis=1),
        completion_mask=completion_mask,
        advantages=np.asarray(advantages, np.float32),
        packed=packed,
        sampler_logprobs=groups.sampler_logprobs[:, :width],
    )
    return jax.tree.map(setup.block.to_global, batch, setup.batch_shardings)


def advantages_of(setup: Setup, groups: Groups) -> np.ndarray:
    """f32[R] advantages of this process's rows, from the statistics of every process's
    rows (a collective): `algorithm.scale=batch` divides by the std of the whole batch,
    so every process normalises alike and as one process would."""
    algo, g = setup.config.algorithm, setup.group_size
    rewards = setup.block.gather(groups.rewards)  # [R_all], in row order
    valid = setup.block.gather(groups.valid)
    rows = len(rewards)
    advantages = group_advantages_program(
        jnp.asarray(rewards),
        jnp.asarray(np.arange(rows) // g, jnp.int32),
        rows // g,
        valid=jnp.asarray(valid),
        scale=algo.scale,
        std_ddof=algo.std_ddof,
        eps=algo.advantage_eps,
        clip=algo.advantage_clip,
    )
    return setup.block.take(np.asarray(advantages))
