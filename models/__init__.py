"""Flax NNX decoders (Llama, Qwen2/2.5, Qwen3) with Hugging Face checkpoint import/export,
and sequence-classification reward models on the same decoder."""

from models.config import PRESETS, Llama3RopeScaling, ModelConfig, preset
from models.hf import CheckpointError, from_pretrained, save_pretrained
from models.reward_model import RewardModel, load_reward_model
from models.transformer import KVCache, Transformer, forward, init_cache

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
