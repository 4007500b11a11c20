"""Learned reward models: Hugging Face `*ForSequenceClassification` checkpoints with one label.

A reward model is the same decoder as the policy with a score head [E, 1] in place of the
unembedding: it reads a whole (prompt, completion) text and returns one scalar, taken at the
sequence's last token. Supported: the `*ForSequenceClassification` of Llama, Qwen2, Qwen3,
Mistral, Gemma 2 and Gemma 3 text (`SUPPORTED_ARCHITECTURES`, over the model types
`ModelConfig.from_hf_config` accepts).

Which token is "last" follows transformers exactly: the rightmost token whose id is not the
checkpoint's `pad_token_id` (so a batch may be padded on either side, and a trailing token
equal to the pad id, such as an EOS doubling as pad, is skipped). Without a `pad_token_id`
the attention mask decides: the rightmost real token (transformers refuses such batches).

Positions are counted from each row's first real token (RoPE depends only on differences of
positions, so this equals transformers' numbering from the first pad), and a left-padded row
scores the same as the unpadded one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
from safetensors import safe_open

from jgrpo.models.config import ModelConfig
from jgrpo.models.hf import CheckpointError, _tensor_files, read_parameters, resolve
from jgrpo.models.transformer import forward, layer_param_specs, param_axes

SUPPORTED_ARCHITECTURES = (
    "LlamaForSequenceClassification",
    "Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification",
    "MistralForSequenceClassification",
    "Gemma2ForSequenceClassification",
    "Gemma3TextForSequenceClassification",
)


@dataclasses.dataclass
class RewardModel:
    """A loaded reward model: the decoder's parameters plus `score` [E, 1]."""

    config: ModelConfig
    params: dict  # Transformer.params() without lm_head, plus "score": [E, 1]
    pad_token_id: int | None  # from config.json: how transformers finds the last token
    source_dir: str

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None):
        """f32[B] scores of token ids [B, T] (1 in `attention_mask` on real tokens)."""
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, jnp.int32)
        return score_sequences(
            self.params,
            input_ids,
            attention_mask,
            config=self.config,
            pad_token_id=self.pad_token_id,
        )


def reward_param_axes(config: ModelConfig) -> dict:
    """Logical axis names of a reward model's parameters (for a mesh's rules table)."""
    axes = {k: v for k, v in param_axes(config).items() if k != "lm_head"}
    axes["score"] = ("embed", None)
    return axes


def read_reward_config(path: str | os.PathLike) -> ModelConfig:
    """The decoder's ModelConfig of a reward model checkpoint, after checking from its
    config.json that it is a supported sequence classifier."""
    return _classifier_config(resolve(path))[0]


def _classifier_config(directory) -> tuple[ModelConfig, dict]:
    """(ModelConfig, the config.json dict) of a supported sequence classifier."""
    config_file = directory / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"reward model {directory} has no config.json.")
    hf_config = json.loads(config_file.read_text())
    architectures = hf_config.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
        named = ", ".join(architectures) or "no architecture"
        raise CheckpointError(
            f"reward model {directory} is {named}; a reward model must be one of "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (an HF sequence-classification checkpoint "
            "with a one-label score head)."
        )
    try:
        return ModelConfig.from_hf_config(hf_config), hf_config
    except ValueError as error:
        raise CheckpointError(f"reward model {directory}: {error}") from error


def reward_param_shapes(config: ModelConfig, dtype=jnp.float32) -> dict:
    """ShapeDtypeStructs of a reward model's parameters (to plan memory or shardings)."""
    layers = {
        name: jax.ShapeDtypeStruct((config.num_layers, *shape), dtype)
        for name, (shape, _) in layer_param_specs(config).items()
    }
    return {
        "embed": jax.ShapeDtypeStruct((config.vocab_size, config.hidden_size), dtype),
        "layers": layers,
        "final_norm": jax.ShapeDtypeStruct((config.hidden_size,), dtype),
        "score": jax.ShapeDtypeStruct((config.hidden_size, 1), dtype),
    }


def load_reward_model(
    path: str | os.PathLike, *, dtype=jnp.float32, shardings: dict | None = None
) -> RewardModel:
    """A reward model from an HF directory (or hub name) of a sequence-classification
    checkpoint with safetensors weights, its parameters in `dtype` (f32 or bf16) and, with
    `shardings` (a pytree shaped like the parameters), sent straight to their shards."""
    directory = resolve(path)
    config, hf_config = _classifier_config(directory)
    files = _tensor_files(directory)
    if "score.weight" not in files:
        raise CheckpointError(
            f"reward model {directory} has no score head (tensor score.weight): its "
            "config.json says sequence classification but the weights do not hold the head. "
            "Save it with transformers' AutoModelForSequenceClassification.save_pretrained."
        )
    num_labels = _score_rows(files["score.weight"])
    if num_labels != 1:
        raise CheckpointError(
            f"reward model {directory} has a score head with {num_labels} labels; a reward "
            "model gives one scalar per sequence (num_labels=1). A classifier with several "
            "labels is not a reward model: wrap it in a reward function of your own."
        )
    abstract = reward_param_shapes(config)  # paths as in PARAM_TO_HF, layers per layer
    shapes = {name: leaf.shape for name, leaf in abstract.items() if name != "layers"}
    shapes.update({f"layers.{name}": leaf.shape[1:] for name, leaf in abstract["layers"].items()})
    params: dict = {"layers": {}}
    for path, value in read_parameters(directory, files, config, shapes, dtype, shardings):
        if path.startswith("layers."):
            params["layers"][path.removeprefix("layers.")] = value
        else:
            params[path] = value
    pad = hf_config.get("pad_token_id")
    return RewardModel(
        config=config,
        params=params,
        pad_token_id=pad if isinstance(pad, int) else None,
        source_dir=str(directory),
    )


def _score_rows(file) -> int:
    with safe_open(file, framework="np") as f:
        return int(f.get_slice("score.weight").get_shape()[0])


def last_token_index(
    input_ids: jax.Array,  # int[B, T]
    attention_mask: jax.Array,  # [B, T]
    pad_token_id: int | None,
) -> jax.Array:  # int32[B]
    """Where transformers reads a sequence classifier's score: the rightmost token that is not
    `pad_token_id` (0 when every token is), or without one the rightmost real token."""
    positions = jnp.arange(input_ids.shape[1], dtype=jnp.int32)
    if pad_token_id is None:
        keep = attention_mask.astype(jnp.int32)
    else:
        keep = (input_ids != pad_token_id).astype(jnp.int32)
    return jnp.argmax(positions * keep, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "pad_token_id"))
def score_sequences(
    params: dict,
    input_ids: jax.Array,  # int[B, T]
    attention_mask: jax.Array,  # [B, T], 1 on real tokens
    *,
    config: ModelConfig,
    pad_token_id: int | None,
) -> jax.Array:  # f32[B]
    """The reward model's score of each sequence (one jitted forward, no logits)."""
    hidden = forward(
        params, input_ids, attention_mask=attention_mask, config=config, return_hidden=True
    )  # [B, T, E]
    index = last_token_index(input_ids, attention_mask, pad_token_id)  # [B]
    last = jnp.take_along_axis(hidden, index[:, None, None], axis=1)[:, 0]  # [B, E]
    scores = jnp.einsum("be,el->bl", last, params["score"], preferred_element_type=jnp.float32)
    return scores[:, 0]
