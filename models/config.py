"""ModelConfig: one decoder description for the Llama, Qwen2/2.5, Qwen3 and Mistral families.

The families differ by switches (q/k/v bias, q/k RMSNorm, tied embeddings, Llama 3 rope
scaling), not by code. `from_hf_config` / `to_hf_config` translate to and from a Hugging Face
`config.json`, in both the transformers 4 (`rope_theta`, `rope_scaling`) and 5
(`rope_parameters`) spellings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.x frequency-dependent RoPE scaling (`rope_type: llama3` in HF configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and switches of a decoder-only transformer (RMSNorm, RoPE, GQA, SwiGLU)."""

    model_type: str  # "llama" | "qwen2" | "qwen3" | "mistral": the HF family, for export
    vocab_size: int
    hidden_size: int  # embed
    intermediate_size: int  # mlp
    num_layers: int
    num_heads: int
    num_kv_heads: int  # grouped-query attention: num_heads % num_kv_heads == 0
    head_dim: int
    rope_theta: float = 10_000.0
    rope_scaling: Llama3RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False  # Qwen2/2.5
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k before RoPE
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    remat: bool = False  # recompute each layer in the backward pass (training memory)
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # Mistral's sliding window: each token attends to the last W tokens. The decoder attends
    # to every token, which is the same for sequences of at most W tokens, so longer ones are
    # refused (`check_attention_length`) rather than computed wrong.
    sliding_window: int | None = None

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}."
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})."
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}.")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}.")
        if self.sliding_window is not None and self.model_type != "mistral":
            raise ValueError(
                f"sliding_window is Mistral's; model_type {self.model_type!r} attends in full."
            )
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise ValueError(
                f"sliding_window must be a positive int or None, got {self.sliding_window!r}."
            )

    def check_attention_length(self, length: int, what: str) -> None:
        """ValueError when `length` tokens would attend past the sliding window: full
        attention, which this decoder computes, equals the window's only up to W tokens."""
        if self.sliding_window is not None and length > self.sliding_window:
            raise ValueError(
                f"{what} spans {length} tokens, more than the sliding window of "
                f"{self.sliding_window} tokens of this {self.model_type} model: jgrpo attends "
                f"over every token, which equals the window only up to {self.sliding_window}; "
                f"keep it within {self.sliding_window} tokens."
            )

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        e, m, h, kv, d = (
            self.hidden_size,
            self.intermediate_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )
        attention = e * h * d * 2 + e * kv * d * 2
        attention += (h + 2 * kv) * d if self.qkv_bias else 0
        attention += 2 * d if self.qk_norm else 0
        layer = attention + 3 * e * m + 2 * e
        embeddings = self.vocab_size * e * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embeddings + e

    def replace(self, **changes) -> ModelConfig:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any] | Any) -> ModelConfig:
        """From a transformers config object or its `config.json` dict.

        Refuses what the decoder does not implement (other rope types, Qwen2's sliding
        windows, biases outside Qwen2's q/k/v, non-SiLU activations) rather than loading it
        wrong; Mistral's `sliding_window` is kept, and sequences longer than it are refused.
        """
        hf = dict(hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict())
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama 2/3.x, Qwen2/2.5, Qwen3, Mistral)."
            )
        activation = hf.get("hidden_act", "silu")
        if activation != "silu":
            raise ValueError(f"hidden_act {activation!r} is not supported; only 'silu'.")
        if hf.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported (full attention only).")
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported.")
        if model_type != "qwen2" and hf.get("attention_bias"):
            raise ValueError(
                f"attention_bias=true is not supported for {model_type} (only Qwen2's q/k/v bias)."
            )

        rope = dict(hf.get("rope_parameters") or {})  # transformers 5
        legacy_scaling = hf.get("rope_scaling") or {}  # transformers 4
        rope = {**legacy_scaling, **rope}
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "llama3":
            scaling = Llama3RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type == "default":
            scaling = None
        else:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported; supported: 'default', 'llama3'."
            )

        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=hf.get("pad_token_id"),
            sliding_window=hf.get("sliding_window") if model_type == "mistral" else None,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The `config.json` dict that transformers loads into the same architecture."""
        if self.qkv_bias != (self.model_type == "qwen2") or self.qk_norm != (
            self.model_type == "qwen3"
        ):
            raise ValueError(
                f"qkv_bias={self.qkv_bias}, qk_norm={self.qk_norm} has no HF equivalent for "
                f"model_type {self.model_type!r} (qwen2 has the bias, qwen3 the norm)."
            )
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters = {
                "rope_type": "llama3",
                "rope_theta": self.rope_theta,
                **dataclasses.asdict(self.rope_scaling),
            }
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        config = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_parameters": rope_parameters,
            # The transformers 4 spelling of the same, for older readers.
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else rope_parameters,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type != "qwen2":
            config["attention_bias"] = False
        if self.model_type == "mistral":
            config["sliding_window"] = self.sliding_window
        return config


PRESETS: dict[str, ModelConfig] = {
    # Tests and the CPU demo: every switch of the Llama family, milliseconds per step.
    "tiny": ModelConfig(
        model_type="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    ),
    # 124.7M parameters (GPT-2-small scale): the CPU forward and rollout benchmarks.
    "llama-125m": ModelConfig(
        model_type="llama",
        vocab_size=32_000,
        hidden_size=768,
        intermediate_size=2048,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        head_dim=64,
        rope_theta=10_000.0,
        rms_norm_eps=1e-5,
    ),
    # SmolLM2-135M's architecture: the workload of `python scripts/benchmark.py compare`.
    "smollm2-135m": ModelConfig(
        model_type="llama",
        vocab_size=49_152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100_000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
    # Shapes of released checkpoints (for memory planning; weights come from from_pretrained).
    "qwen2.5-0.5b": ModelConfig(
        model_type="qwen2",
        vocab_size=151_936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        rope_theta=1_000_000.0,
        qkv_bias=True,
        tie_word_embeddings=True,
        max_position_embeddings=32_768,
    ),
    "qwen2.5-1.5b": ModelConfig(
        model_type="qwen2",
        vocab_size=151_936,
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        head_dim=128,
        rope_theta=1_000_000.0,
        qkv_bias=True,
        tie_word_embeddings=True,
        max_position_embeddings=32_768,
    ),
    "qwen3-0.6b": ModelConfig(
        model_type="qwen3",
        vocab_size=151_936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1_000_000.0,
        qk_norm=True,
        tie_word_embeddings=True,
        max_position_embeddings=40_960,
    ),
    "llama3.2-1b": ModelConfig(
        model_type="llama",
        vocab_size=128_256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rope_theta=500_000.0,
        rope_scaling=Llama3RopeScaling(32.0, 1.0, 4.0, 8192),
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=131_072,
    ),
}


def preset(name: str) -> ModelConfig:
    """A named ModelConfig; the error lists the known names."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}.")
    return PRESETS[name]
