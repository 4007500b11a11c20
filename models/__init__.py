"""Flax NNX decoders (Llama, Qwen2/2.5, Qwen3, Mistral) with Hugging Face checkpoint import/export,
and sequence-classification reward models on the same decoder."""

from jgrpo.models.config import PRESETS, Llama3RopeScaling, ModelConfig, preset
from jgrpo.models.hf import CheckpointError, from_pretrained, save_pretrained
from jgrpo.models.reward_model import RewardModel, load_reward_model
from jgrpo.models.transformer import KVCache, Transformer, forward, init_cache

__all__ = [
    "PRESETS",
    "CheckpointError",
    "KVCache",
    "Llama3RopeScaling",
    "ModelConfig",
    "RewardModel",
    "Transformer",
    "forward",
    "from_pretrained",
    "init_cache",
    "load_reward_model",
    "preset",
    "save_pretrained",
]
