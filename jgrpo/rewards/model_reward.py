"""A learned reward model as one more reward function of a run.

`ModelReward` follows the reward protocol (prompts and completions in, one float per
completion out) like the verifiers, but scores with a Hugging Face sequence classifier
(`jgrpo.models.load_reward_model`) through its own tokenizer: chat prompts become the prompt's
messages plus the completion as the assistant's turn, rendered by the reward model's chat
template; text prompts are concatenated with the completion (TRL's convention). Sequences are
right-padded to a length bucket and scored `batch_size` at a time in one jitted program, so a
run compiles it once per bucket. It runs in the training process, on the device mesh, never
in a verifier worker (`in_process`).

In a multi-process run each process scores its own completions, and the processes agree on
the bucket and the number of calls first: every call is one program over the whole mesh, so
all of them make the same calls (a process with fewer rows pads). Nothing here raises for
one row and not another (a too-long row scores NaN), so no process is left waiting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jgrpo.generation import DEFAULT_BUCKETS, bucket_length
from jgrpo.rewards.scoring import completion_text

logger = logging.getLogger("jgrpo.rewards")

NORMALIZATIONS = ("none", "running")


@dataclasses.dataclass
class RunningMoments:
    """Mean and (population) standard deviation of every value seen so far (Chan et al.'s
    parallel update, in float64), kept in the checkpoint so a resumed run goes on with them."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0  # sum of squared deviations from the mean

    def update(self, values: np.ndarray) -> None:
        values = np.asarray(values, np.float64)
        if values.size == 0:
            return
        count = self.count + values.size
        delta = values.mean() - self.mean
        self.m2 += (
            (values - values.mean()) ** 2
        ).sum() + delta**2 * self.count * values.size / count
        self.mean += delta * values.size / count
        self.count = count

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 0.0

    def normalize(self, values: np.ndarray, eps: float = 1e-6) -> np.ndarray:
        return (np.asarray(values, np.float64) - self.mean) / (self.std + eps)

    def state(self) -> dict:
        return dataclasses.asdict(self)

    def load(self, state: dict) -> None:
        self.count, self.mean, self.m2 = (
            int(state["count"]),
            float(state["mean"]),
            float(state["m2"]),
        )


class ModelReward:
    """Scores (prompt, completion) pairs with a reward model: `scale * score + shift`.

    Args:
      path: an HF `*ForSequenceClassification` checkpoint directory (or hub name) with its
        tokenizer files.
      dtype: the reward model's parameter dtype (bf16 keeps it small beside an f32 policy);
        scores are computed and returned in f32.
      batch_size: sequences per jitted call over all processes (the last call is padded
        with empty rows).
      max_length: the longest tokenized (prompt + completion) accepted; a longer one scores
        NaN (a logged failure of that row), never truncated.
      normalize: "none", or "running": the score becomes (score - mean) / std over every
        score of the run so far (this call's included) before the affine map; evaluation
        (`frozen()`) reads the statistics without adding to them.
      scale, shift: a fixed affine map of the (normalised) score, e.g. to put it on the
        verifiers' 0..1 scale.
      mesh: place the parameters on this mesh by the policy's rules table (default: the
        default device).
    """

    in_process = True  # holds device arrays: never sent to a verifier worker process

    def __init__(
        self,
        path: str,
        *,
        dtype=jnp.bfloat16,
        batch_size: int = 16,
        max_length: int = 2048,
        normalize: str = "none",
        scale: float = 1.0,
        shift: float = 0.0,
        mesh=None,
    ):
        from transformers import AutoTokenizer

        from jgrpo import models
        from jgrpo.models.hf import resolve
        from jgrpo.models.reward_model import (
            read_reward_config,
            reward_param_axes,
            reward_param_shapes,
        )

        if batch_size < 1 or max_length < 1:
            raise ValueError(
                f"batch_size and max_length must be >= 1, got {batch_size}, {max_length}."
            )
        if normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}.")
        directory = resolve(path)
        shardings = None
        self.mesh, self._block = mesh, None
        if mesh is not None:
            from jgrpo.distributed import RowBlock
            from jgrpo.sharding import row_shardings, tree_shardings

            config = read_reward_config(directory)
            shardings = tree_shardings(
                reward_param_shapes(config, dtype), reward_param_axes(config), mesh
            )
            batch_size = scoring_rows(batch_size, mesh)
            self._rows = row_shardings(mesh)[1]
            self._block = RowBlock(self._rows)
        self.model = models.load_reward_model(directory, dtype=dtype, shardings=shardings)
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        self.batch_size, self.max_length = batch_size, max_length
        self.normalize, self.moments, self._tracking = normalize, RunningMoments(), True
        self.scale, self.shift = float(scale), float(shift)
        pad = self.model.pad_token_id
        if pad is None:
            pad = self.tokenizer.pad_token_id
        self._pad_id = 0 if pad is None else int(pad)

    def text(self, prompt: Any, completion: Any) -> str:
        """What the reward model reads for one completion."""
        answer = completion_text(completion)
        if isinstance(prompt, str):
            return prompt + answer
        messages = [*prompt, {"role": "assistant", "content": answer}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    def token_ids(
        self, prompts: Sequence[Any], completions: Sequence[Any]
    ) -> list[list[int] | None]:
        """Token ids of every (prompt, completion); None (logged) where longer than max_length."""
        if any(not isinstance(p, str) for p in prompts) and not getattr(
            self.tokenizer, "chat_template", None
        ):
            raise ValueError(
                "the prompts are chat messages but the reward model's tokenizer has no chat "
                "template; use a reward model whose tokenizer has one, or text prompts."
            )
        ids: list[list[int] | None] = []
        for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            tokens = self.tokenizer(self.text(prompt, completion), add_special_tokens=False)
            tokens = list(tokens["input_ids"]) or [self._pad_id]
            if len(tokens) > self.max_length:
                logger.warning(
                    "completion %d is %d tokens for the reward model, more than "
                    "reward_model.max_length=%d: scored NaN (nothing is truncated; raise it)",
                    row,
                    len(tokens),
                    self.max_length,
                )
                tokens = None
            ids.append(tokens)
        return ids

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **_) -> list[float]:
        raw = self.raw_scores(self.token_ids(prompts, completions))  # f32[B], NaN: not scored
        if self.normalize == "running":
            if self._tracking:
                everyone = raw
                if self._block is not None:  # every process's scores, padded to one shape
                    (rows,) = _largest_everywhere(len(raw))
                    everyone = self._block.gather(
                        np.pad(raw, (0, rows - len(raw)), constant_values=np.nan)
                    )
                self.moments.update(everyone[~np.isnan(everyone)])
            raw = self.moments.normalize(raw)
        return (self.scale * raw + self.shift).astype(np.float32).tolist()

    @contextlib.contextmanager
    def frozen(self):
        """Scores inside use the running statistics without adding to them (evaluation)."""
        tracking, self._tracking = self._tracking, False
        try:
            yield self
        finally:
            self._tracking = tracking

    def raw_scores(self, ids: Sequence[list[int] | None]) -> np.ndarray:
        """f32[B] scores of token id lists, NaN for None; every process calls it together."""
        lengths = [len(tokens) for tokens in ids if tokens is not None]
        local_batch = self.batch_size
        if self._block is not None:
            start, stop = self._block.bounds(self.batch_size)
            local_batch = stop - start
        length = bucket_length(max(lengths, default=1), DEFAULT_BUCKETS)
        calls = -(-len(ids) // local_batch)
        length, calls = _largest_everywhere(length, calls)  # one program, same calls
        input_ids = np.full((calls * local_batch, length), self._pad_id, np.int32)  # [R, T]
        mask = np.zeros((calls * local_batch, length), np.int32)  # right-padded
        for row, tokens in enumerate(ids):
            if tokens is not None:
                input_ids[row, : len(tokens)] = tokens
                mask[row, : len(tokens)] = 1
        scores = [
            self._score(input_ids[start : start + local_batch], mask[start : start + local_batch])
            for start in range(0, calls * local_batch, local_batch)
        ]
        raw = np.concatenate(scores or [np.zeros(0, np.float32)])[: len(ids)]
        return np.where([tokens is None for tokens in ids], np.nan, raw).astype(np.float32)

    def _score(self, input_ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """f32[b] scores of this process's b rows of one call."""
        if self.mesh is None:
            return np.asarray(self.model(jnp.asarray(input_ids), jnp.asarray(mask)))
        from jgrpo.sharding import rules_context

        block = self._block
        with rules_context(self.mesh):
            scores = self.model(
                block.to_global(input_ids, self._rows), block.to_global(mask, self._rows)
            )
        return block.local(scores)


def scoring_rows(batch_size: int, mesh) -> int:
    """Rows per scoring call on a mesh: batch_size rounded up to whole rows on every device."""
    split = mesh.shape["data"] * mesh.shape["fsdp"]
    return -(-batch_size // split) * split


def _largest_everywhere(*values: int) -> list[int]:
    """The largest of each value over all processes (a collective: every process calls it)."""
    if jax.process_count() == 1:
        return list(values)
    return multihost_utils.process_allgather(np.array(values)).max(0).tolist()
