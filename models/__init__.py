"""Flax NNX decoders (Llama, Qwen2/2.5, Qwen3) with Hugging Face checkpoint import/export."""

from models.config import PRESETS, Llama3RopeScaling, ModelConfig, preset
from models.hf import CheckpointError, from_pretrained, save_pretrained
from models.transformer import KVCache, Transformer, forward, init_cache

__all__ = [
    "PRESETS",
    "CheckpointError",
    "KVCache",
    "Llama3RopeScaling",
    "ModelConfig",
    "Transformer",
    "forward",
    "from_pretrained",
    "init_cache",
    "preset",
    "save_pretrained",
]
