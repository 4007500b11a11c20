"""A learned reward model as one more reward function of a run.

`ModelReward` follows the reward protocol (prompts and completions in, one float per
completion out) like the verifiers, but scores with a Hugging Face sequence classifier
(`models.load_reward_model`) through its own tokenizer: chat prompts become the prompt's
messages plus the completion as the assistant's turn, rendered by the reward model's chat
template; text prompts are concatenated with the completion (TRL's convention). Sequences are
right-padded to a length bucket and scored `batch_size` at a time in one jitted program, so a
run compiles it once per bucket. It runs in the training process, on the device mesh, never
in a verifier worker (`in_process`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo.generation import DEFAULT_BUCKETS, bucket_length
from jgrpo.rewards.scoring import completion_text


class ModelReward:
    """Scores (prompt, completion) pairs with a reward model: `scale * score + shift`.

    Args:
      path: an HF `*ForSequenceClassification` checkpoint directory (or hub name) with its
        tokenizer files.
      dtype: the reward model's parameter dtype (bf16 keeps it small beside an f32 policy);
        scores are computed and returned in f32.
      batch_size: sequences per jitted call (the last call is padded with empty rows).
      max_length: the longest tokenized (prompt + completion) accepted; a longer one raises
        (the scoring then retries row by row and scores that row None), never truncated.
      scale, shift: a fixed affine map of the raw score, e.g. to put it on the verifiers'
        0..1 scale.
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
        scale: float = 1.0,
        shift: float = 0.0,
        mesh=None,
    ):
        from transformers import AutoTokenizer

        import models
        from models.hf import resolve
        from models.reward_model import read_reward_config, reward_param_axes, reward_param_shapes

        if batch_size < 1 or max_length < 1:
            raise ValueError(
                f"batch_size and max_length must be >= 1, got {batch_size}, {max_length}."
            )
        directory = resolve(path)
        shardings = None
        self.mesh = mesh
        if mesh is not None:
            from jgrpo.sharding import row_shardings, tree_shardings

            config = read_reward_config(directory)
            shardings = tree_shardings(
                reward_param_shapes(config, dtype), reward_param_axes(config), mesh
            )
            split = mesh.shape["data"] * mesh.shape["fsdp"]
            batch_size = -(-batch_size // split) * split  # whole rows on every device
            self._rows = row_shardings(mesh)[1]
        self.model = models.load_reward_model(directory, dtype=dtype, shardings=shardings)
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        self.batch_size, self.max_length = batch_size, max_length
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
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "the prompts are chat messages but the reward model's tokenizer has no chat "
                "template; use a reward model whose tokenizer has one, or text prompts."
            )
        messages = [*prompt, {"role": "assistant", "content": answer}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    def token_ids(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[list[int]]:
        """Token ids of every (prompt, completion), checked against max_length."""
        ids = []
        for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            tokens = self.tokenizer(self.text(prompt, completion), add_special_tokens=False)
            tokens = list(tokens["input_ids"])
            if len(tokens) > self.max_length:
                raise ValueError(
                    f"completion {row} is {len(tokens)} tokens for the reward model, more than "
                    f"reward_model.max_length={self.max_length}; raise it (nothing is "
                    "truncated)."
                )
            ids.append(tokens or [self._pad_id])
        return ids

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **_) -> list[float]:
        ids = self.token_ids(prompts, completions)
        length = bucket_length(max(map(len, ids)), DEFAULT_BUCKETS)
        rows = -(-len(ids) // self.batch_size) * self.batch_size
        input_ids = np.full((rows, length), self._pad_id, np.int32)  # [R, T], right-padded
        mask = np.zeros((rows, length), np.int32)
        for row, tokens in enumerate(ids):
            input_ids[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = 1
        scores = []
        for start in range(0, rows, self.batch_size):
            part = slice(start, start + self.batch_size)
            scores.append(np.asarray(self._score(input_ids[part], mask[part])))
        raw = np.concatenate(scores)[: len(ids)]  # f32[B]
        return (self.scale * raw + self.shift).astype(np.float32).tolist()

    def _score(self, input_ids: np.ndarray, mask: np.ndarray) -> jax.Array:
        if self.mesh is None:
            return self.model(jnp.asarray(input_ids), jnp.asarray(mask))
        from jgrpo.sharding import rules_context

        with rules_context(self.mesh):
            return self.model(
                jax.device_put(input_ids, self._rows), jax.device_put(mask, self._rows)
            )
