"""Completions from a model for text or chat prompts; `main` is `python -m jgrpo.generate`.

Prompts are tokenized on the host, left-padded to a length bucket (so new prompts of similar
length reuse the compiled program), and sampled with `jgrpo.rollout.rollout`.

    python -m jgrpo.generate --model PATH --prompt "What is 2 + 2?" --num-generations 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo.rollout import Rollout, SamplingConfig, rollout

DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

Prompt = str | Sequence[dict[str, str]]  # plain text, or chat messages [{"role", "content"}]


def bucket_length(length: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """The smallest bucket >= length; past the largest, the next multiple of the largest."""
    for bucket in sorted(buckets):
        if length <= bucket:
            return bucket
    largest = max(buckets)
    return -(-length // largest) * largest


def encode_prompts(tokenizer, prompts: Sequence[Prompt]) -> list[list[int]]:
    """Token ids of each prompt; chat messages go through the tokenizer's chat template."""
    encoded = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids = tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, Sequence) and all(isinstance(m, dict) for m in prompt):
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError(
                    f"prompt {i} is a list of chat messages but the tokenizer has no chat "
                    "template; pass plain text or a tokenizer with a chat_template."
                )
            text = tokenizer.apply_chat_template(
                list(prompt), add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            raise ValueError(
                f"prompt {i} must be a string or a list of chat messages "
                f"({{'role': ..., 'content': ...}}), got {type(prompt).__name__}."
            )
        if not ids:
            raise ValueError(f"prompt {i} encodes to no tokens.")
        encoded.append(list(ids))
    return encoded


def pad_prompts(
    token_lists: Sequence[Sequence[int]], buckets: Sequence[int] = DEFAULT_BUCKETS
) -> tuple[np.ndarray, np.ndarray]:  # (int32[P, L], int32[P, L])
    """Left-pads to the bucket of the longest prompt; the mask comes from the lengths."""
    length = bucket_length(max(len(t) for t in token_lists), buckets)
    ids = np.zeros((len(token_lists), length), np.int32)
    mask = np.zeros((len(token_lists), length), np.int32)
    for row, tokens in enumerate(token_lists):
        ids[row, length - len(tokens) :] = tokens
        mask[row, length - len(tokens) :] = 1
    return ids, mask


def generation_eos_token_ids(checkpoint_dir: str | os.PathLike | None) -> tuple[int, ...]:
    """`eos_token_id` of the checkpoint's generation_config.json (an int or a list), the ids
    transformers' `generate` stops on; () without the file or the key."""
    if checkpoint_dir is None:
        return ()
    path = pathlib.Path(checkpoint_dir) / "generation_config.json"
    if not path.exists():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, int) else tuple(int(t) for t in eos)


def stop_token_ids(
    tokenizer, model_config, checkpoint_dir: str | os.PathLike | None = None
) -> tuple[int, ...]:
    """The ids that end a completion: EOS of the tokenizer (for chat models: the end-of-turn
    token), of the model config (config.json) and, when `checkpoint_dir` is given, of its
    generation_config.json (Qwen2.5-Instruct lists <|im_end|> and <|endoftext|> there)."""
    ids = set(generation_eos_token_ids(checkpoint_dir))
    for eos in (getattr(tokenizer, "eos_token_id", None), model_config.eos_token_id):
        if isinstance(eos, int):
            ids.add(eos)
        elif eos is not None:
            ids.update(eos)
    return tuple(sorted(ids))


@dataclasses.dataclass
class Generations:
    """Completion g of prompt p: `texts[p][g]` and `token_ids[p][g]`; `rollout` row p * G + g."""

    texts: list[list[str]]  # decoded, special tokens (the stop token too) skipped
    token_ids: list[list[list[int]]]  # up to and including the stop token
    rollout: Rollout  # the arrays, [P * G, N], as `jgrpo.rollout` returns them


def generate(
    model,
    tokenizer,
    prompts: Sequence[Prompt],
    *,
    num_generations: int = 1,
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    stop_tokens: Sequence[int] | None = None,
    key: jax.Array | int = 0,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
) -> Generations:
    """G completions of each prompt from a `jgrpo.models.Transformer`, decoded to text.

    Prompts are tokenized, left-padded to the smallest of `buckets` that holds the longest
    (so prompts of similar length reuse one compiled program) and sampled by `rollout`.

    Args:
      model: a `jgrpo.models.Transformer`, e.g. from `jgrpo.models.from_pretrained`.
      tokenizer: its Hugging Face tokenizer (chat messages need a chat template).
      prompts: plain strings, or chat messages `[{"role": ..., "content": ...}]`; a single
        string is one prompt.
      num_generations: G, completions per prompt.
      temperature: 0 samples greedily; top_p, top_k and min_p as in `SamplingConfig`.
      stop_tokens: default: the EOS ids of the tokenizer, of the model config and of the
        generation_config.json of the checkpoint the model was loaded from (`stop_token_ids`).
      key: a PRNG key or an int seed; the same key and inputs give the same completions.
    """
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}.")
    if isinstance(prompts, str):
        prompts = [prompts]
    if stop_tokens is None:
        stop_tokens = stop_token_ids(tokenizer, model.config, getattr(model, "source_dir", None))
    pad_id = getattr(tokenizer, "pad_token_id", None)
    sampling = SamplingConfig(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        stop_token_ids=tuple(stop_tokens),
        pad_token_id=pad_id if pad_id is not None else 0,
    )
    ids, mask = pad_prompts(encode_prompts(tokenizer, prompts), buckets)
    if isinstance(key, int):
        key = jax.random.key(key)
    result = rollout(
        model.params(),
        jnp.asarray(ids),
        jnp.asarray(mask),
        key,
        model_config=model.config,
        num_generations=num_generations,
        sampling=sampling,
    )
    tokens, lengths = np.asarray(result.tokens), np.asarray(result.lengths)
    token_ids = [
        [
            tokens[p * num_generations + g, : lengths[p * num_generations + g]].tolist()
            for g in range(num_generations)
        ]
        for p in range(len(prompts))
    ]
    texts = [[tokenizer.decode(t, skip_special_tokens=True) for t in row] for row in token_ids]
    return Generations(texts=texts, token_ids=token_ids, rollout=result)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m jgrpo.generate",
        description="Print completions of a Hugging Face checkpoint (a local directory or hub "
        "name) for one or more prompts.",
    )
    parser.add_argument("--model", required=True, help="checkpoint directory or hub name")
    parser.add_argument("--prompt", action="append", required=True, help="repeat for several")
    parser.add_argument("--num-generations", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap each prompt as a user message in the chat template (default: when the "
        "tokenizer has one)",
    )
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from jgrpo import models

    model = models.from_pretrained(args.model, dtype=jnp.dtype(args.dtype))
    tokenizer = AutoTokenizer.from_pretrained(models.hf.resolve(args.model))
    chat = bool(getattr(tokenizer, "chat_template", None)) if args.chat is None else args.chat
    prompts: list[Any] = [[{"role": "user", "content": p}] if chat else p for p in args.prompt]
    result = generate(
        model,
        tokenizer,
        prompts,
        num_generations=args.num_generations,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        key=args.seed,
    )
    truncated = np.asarray(result.rollout.truncated).reshape(len(prompts), -1)
    for p, prompt in enumerate(args.prompt):
        print(f"=== prompt {p}: {prompt}")
        for g, text in enumerate(result.texts[p]):
            ending = "truncated" if truncated[p, g] else "stopped"
            print(f"--- generation {g} ({len(result.token_ids[p][g])} tokens, {ending})")
            print(text)
