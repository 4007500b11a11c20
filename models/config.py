"""ModelConfig: one decoder description for the Llama, Qwen2/2.5, Qwen3, Qwen3-MoE, Mistral and
Gemma 2/3 families.

The families differ by switches (q/k/v bias, q/k RMSNorm, tied embeddings, rope scaling,
sliding-window layers, Gemma's norms, GeGLU and soft-capping, a mixture of experts), not by
code.
`from_hf_config` / `to_hf_config` translate to and from a Hugging Face `config.json`, in both
the transformers 4 (`rope_theta`, `rope_scaling`, `rope_local_base_freq`) and 5
(`rope_parameters`, per layer type for Gemma 3) spellings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma2", "gemma3_text")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
GEMMA_TYPES = ("gemma2", "gemma3_text")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # SwiGLU; GeGLU with tanh-approximated GELU
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"  # HF's layer_types


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.x frequency-dependent RoPE scaling (`rope_type: llama3` in HF configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
    """Position interpolation (`rope_type: linear`): every frequency divided by `factor`
    (Gemma 3's global layers at 4B and up)."""

    factor: float


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and switches of a decoder-only transformer (RMSNorm, RoPE, GQA, a gated MLP)."""

    model_type: str  # "llama" | "qwen2" | "qwen3" | "mistral": the HF family, for export
    vocab_size: int
    hidden_size: int  # embed
    intermediate_size: int  # mlp
    num_layers: int
    num_heads: int
    num_kv_heads: int  # grouped-query attention: num_heads % num_kv_heads == 0
    head_dim: int
    rope_theta: float = 10_000.0
    rope_scaling: Llama3RopeScaling | LinearRopeScaling | None = None
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False  # Qwen2/2.5
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k before RoPE
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    remat: bool = False  # recompute each layer in the backward pass (training memory)
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # Sliding-window attention (Mistral, Gemma 2/3): a token attends to itself and the W - 1
    # tokens before it. `layer_types` says which layers do ("sliding_attention") and which
    # attend to every earlier token ("full_attention"); None: every layer slides.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base, unscaled
    # Gemma 2/3 switches.
    hidden_act: str = "silu"  # the gated MLP's activation: SwiGLU, or GeGLU (gelu_pytorch_tanh)
    norm_weight_offset: float = 0.0  # RMSNorm scales by (offset + weight): Gemma's 1 + w
    post_norms: bool = False  # RMSNorm on the attention's and the MLP's outputs too
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: int | None = None  # attention scale s^-1/2; None: head_dim^-1/2
    attn_logit_softcapping: float | None = None  # scores -> c tanh(scores / c)
    final_logit_softcapping: float | None = None  # logits -> c tanh(logits / c)
    # Mixture of experts (Qwen3-MoE): every layer's MLP is `num_experts` gated MLPs of
    # `moe_intermediate_size`, of which a router picks `experts_per_token` per token and
    # weighs them by its softmax (renormalised over the chosen when `norm_topk_prob`).
    num_experts: int = 0  # 0: one dense MLP of intermediate_size
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False

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
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise ValueError(
                f"sliding_window must be a positive int or None, got {self.sliding_window!r}."
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= {
                FULL_ATTENTION,
                SLIDING_ATTENTION,
            }:
                raise ValueError(
                    f"layer_types must name {self.num_layers} layers, each "
                    f"{FULL_ATTENTION!r} or {SLIDING_ATTENTION!r}; got {self.layer_types!r}."
                )
            if SLIDING_ATTENTION in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding layers but sliding_window is None.")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act {self.hidden_act!r} is not supported; supported: "
                f"{', '.join(ACTIVATIONS)}."
            )
        if self.num_experts:
            if not 0 < self.experts_per_token <= self.num_experts:
                raise ValueError(
                    f"experts_per_token must be in [1, num_experts={self.num_experts}], got "
                    f"{self.experts_per_token}."
                )
            if self.moe_intermediate_size < 1:
                raise ValueError(
                    f"moe_intermediate_size must be a positive int, got "
                    f"{self.moe_intermediate_size!r}."
                )
        for name in (
            "query_pre_attn_scalar",
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "rope_local_theta",
        ):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value!r}.")

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """For each layer, whether it attends within the sliding window only."""
        if self.sliding_window is None:
            return (False,) * self.num_layers
        if self.layer_types is None:
            return (True,) * self.num_layers
        return tuple(kind == SLIDING_ATTENTION for kind in self.layer_types)

    @property
    def attention_scale(self) -> float:
        """The factor on q k^T: query_pre_attn_scalar^-1/2 (Gemma), else head_dim^-1/2."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

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
        mlp = 3 * e * m
        if self.num_experts:  # the experts and the router
            mlp = self.num_experts * 3 * e * self.moe_intermediate_size + e * self.num_experts
        layer = attention + mlp + (4 if self.post_norms else 2) * e
        embeddings = self.vocab_size * e * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embeddings + e

    def replace(self, **changes) -> ModelConfig:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any] | Any) -> ModelConfig:
        """From a transformers config object or its `config.json` dict.

        Refuses what the decoder does not implement (other rope types, Qwen2's sliding
        windows, biases outside Qwen2's q/k/v, other activations, bidirectional attention)
        rather than loading it wrong.
        """
        hf = dict(hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict())
        model_type = hf.get("model_type")
        if model_type == "gemma3":
            raise ValueError(
                "model_type 'gemma3' is the multimodal Gemma 3 (Gemma3ForConditionalGeneration); "
                "jgrpo loads the text-only Gemma3ForCausalLM checkpoints (model_type "
                "'gemma3_text': gemma-3-270m, gemma-3-1b)."
            )
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama 2/3.x, Qwen2/2.5, Qwen3, Mistral, "
                "Gemma 2, Gemma 3 text)."
            )
        gemma = model_type in GEMMA_TYPES
        activation = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
        expected_activation = "gelu_pytorch_tanh" if gemma else "silu"
        if activation != expected_activation:
            raise ValueError(
                f"hidden_act {activation!r} is not supported for {model_type}; only "
                f"{expected_activation!r}."
            )
        if hf.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported (full attention only).")
        if hf.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=true is not supported (causal only).")
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported.")
        if model_type != "qwen2" and hf.get("attention_bias"):
            raise ValueError(
                f"attention_bias=true is not supported for {model_type} (only Qwen2's q/k/v bias)."
            )

        num_layers = hf["num_hidden_layers"]
        moe = model_type == "qwen3_moe"
        if moe and (hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers")):
            raise ValueError(
                "decoder_sparse_step != 1 or mlp_only_layers (dense MLP layers between the "
                "mixture-of-experts ones) is not supported: every layer must be sparse."
            )
        sliding_window = hf.get("sliding_window") if model_type == "mistral" or gemma else None
        layer_types = None
        if gemma:
            layer_types = hf.get("layer_types")
            if layer_types is None:  # configs written before transformers listed them
                pattern = 2 if model_type == "gemma2" else hf.get("sliding_window_pattern", 6)
                layer_types = [
                    SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION
                    for i in range(num_layers)
                ]
            layer_types = tuple(layer_types)
            if sliding_window is None:  # no window: every layer attends in full
                layer_types = (FULL_ATTENTION,) * num_layers

        rope = dict(hf.get("rope_parameters") or {})  # transformers 5
        local_rope = None
        if FULL_ATTENTION in rope or SLIDING_ATTENTION in rope:  # per layer type (Gemma 3)
            local_rope = rope.get(SLIDING_ATTENTION)
            rope = dict(rope.get(FULL_ATTENTION) or {})
        legacy_scaling = hf.get("rope_scaling") or {}  # transformers 4
        rope = {**legacy_scaling, **rope}
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
        scaling = _rope_scaling(rope)
        rope_local_theta = None
        if model_type == "gemma3_text":
            if local_rope is not None:
                if _rope_scaling(local_rope) is not None:
                    raise ValueError("rope scaling on Gemma 3's sliding layers is not supported.")
                rope_local_theta = float(local_rope.get("rope_theta", 10_000.0))
            else:
                rope_local_theta = float(hf.get("rope_local_base_freq", 10_000.0))

        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=hf.get("pad_token_id"),
            sliding_window=sliding_window,
            layer_types=layer_types,
            rope_local_theta=rope_local_theta,
            hidden_act=activation,
            norm_weight_offset=1.0 if gemma else 0.0,
            post_norms=gemma,
            scale_embeddings=gemma,
            query_pre_attn_scalar=(
                int(hf.get("query_pre_attn_scalar") or head_dim) if gemma else None
            ),
            attn_logit_softcapping=_optional_float(hf.get("attn_logit_softcapping")),
            final_logit_softcapping=_optional_float(hf.get("final_logit_softcapping")),
            num_experts=(hf.get("num_experts") or hf.get("num_local_experts") or 0) if moe else 0,
            experts_per_token=hf["num_experts_per_tok"] if moe else 0,
            moe_intermediate_size=hf["moe_intermediate_size"] if moe else 0,
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)) if moe else False,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The `config.json` dict that transformers loads into the same architecture."""
        gemma = self.model_type in GEMMA_TYPES
        if self.qkv_bias != (self.model_type == "qwen2") or self.qk_norm != (
            self.model_type in ("qwen3", "qwen3_moe", "gemma3_text")
        ):
            raise ValueError(
                f"qkv_bias={self.qkv_bias}, qk_norm={self.qk_norm} has no HF equivalent for "
                f"model_type {self.model_type!r} (qwen2 has the bias, qwen3 and gemma3 the norm)."
            )
        gemma_switches = (
            self.hidden_act == "gelu_pytorch_tanh",
            self.norm_weight_offset == 1.0,
            self.post_norms,
            self.scale_embeddings,
        )
        if any(gemma_switches) != gemma or all(gemma_switches) != gemma:
            raise ValueError(
                f"model_type {self.model_type!r} has no HF equivalent with hidden_act="
                f"{self.hidden_act!r}, norm_weight_offset={self.norm_weight_offset}, "
                f"post_norms={self.post_norms}, scale_embeddings={self.scale_embeddings} "
                "(the Gemma families have all four, the others none)."
            )
        rope_parameters = _rope_parameters(self.rope_theta, self.rope_scaling)
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
            "hidden_act": self.hidden_act,
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
        if (self.model_type == "qwen3_moe") != bool(self.num_experts):
            raise ValueError(
                f"num_experts={self.num_experts} has no HF equivalent for model_type "
                f"{self.model_type!r} (qwen3_moe has experts, the others a dense MLP)."
            )
        if self.num_experts:
            config.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.experts_per_token,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            )
        if gemma:
            config.update(
                hidden_activation=self.hidden_act,
                query_pre_attn_scalar=self.query_pre_attn_scalar or self.head_dim,
                attn_logit_softcapping=self.attn_logit_softcapping,
                final_logit_softcapping=self.final_logit_softcapping,
                sliding_window=self.sliding_window,
                layer_types=list(self.layer_types or (FULL_ATTENTION,) * self.num_layers),
            )
        if self.model_type == "gemma3_text":
            local = _rope_parameters(self.rope_local_theta or self.rope_theta, None)
            config["rope_parameters"] = {
                FULL_ATTENTION: rope_parameters,
                SLIDING_ATTENTION: local,
            }
            config["rope_local_base_freq"] = local["rope_theta"]
        return config


def _rope_scaling(rope: Mapping[str, Any]) -> Llama3RopeScaling | LinearRopeScaling | None:
    """The scaling an HF rope dict names (`rope_type`: default, llama3 or linear)."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        return Llama3RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    if rope_type == "linear":
        return LinearRopeScaling(factor=float(rope["factor"]))
    if rope_type == "default":
        return None
    raise ValueError(
        f"rope_type {rope_type!r} is not supported; supported: 'default', 'llama3', 'linear'."
    )


def _rope_parameters(theta: float, scaling) -> dict[str, Any]:
    """HF's rope dict for a RoPE base and its scaling."""
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    kind = "llama3" if isinstance(scaling, Llama3RopeScaling) else "linear"
    return {"rope_type": kind, "rope_theta": theta, **dataclasses.asdict(scaling)}


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


def _every_nth_full(layers: int, n: int) -> tuple[str, ...]:
    """Gemma's layer_types: sliding layers, every n-th one full."""
    return tuple(SLIDING_ATTENTION if (i + 1) % n else FULL_ATTENTION for i in range(layers))


_GEMMA = dict(  # the switches every Gemma 2/3 checkpoint has
    hidden_act="gelu_pytorch_tanh",
    norm_weight_offset=1.0,
    post_norms=True,
    scale_embeddings=True,
    query_pre_attn_scalar=256,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
)

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
    # Qwen3-30B-A3B: 128 experts of 768 per layer, 8 per token (3.3B parameters active).
    "qwen3-30b-a3b": ModelConfig(
        model_type="qwen3_moe",
        vocab_size=151_936,
        hidden_size=2048,
        intermediate_size=6144,  # in config.json, unused: every layer is sparse
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1_000_000.0,
        qk_norm=True,
        max_position_embeddings=40_960,
        num_experts=128,
        experts_per_token=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
    # Gemma: sliding-window layers (every sixth full in Gemma 3, every second in Gemma 2).
    "gemma3-270m": ModelConfig(
        model_type="gemma3_text",
        vocab_size=262_144,
        hidden_size=640,
        intermediate_size=2048,
        num_layers=18,
        num_heads=4,
        num_kv_heads=1,
        head_dim=256,
        rope_theta=1_000_000.0,
        qk_norm=True,
        tie_word_embeddings=True,
        max_position_embeddings=32_768,
        sliding_window=512,
        layer_types=_every_nth_full(18, 6),
        rope_local_theta=10_000.0,
        **_GEMMA,
    ),
    "gemma3-1b": ModelConfig(
        model_type="gemma3_text",
        vocab_size=262_144,
        hidden_size=1152,
        intermediate_size=6912,
        num_layers=26,
        num_heads=4,
        num_kv_heads=1,
        head_dim=256,
        rope_theta=1_000_000.0,
        qk_norm=True,
        tie_word_embeddings=True,
        max_position_embeddings=32_768,
        sliding_window=512,
        layer_types=_every_nth_full(26, 6),
        rope_local_theta=10_000.0,
        **_GEMMA,
    ),
    "gemma2-2b": ModelConfig(
        model_type="gemma2",
        vocab_size=256_000,
        hidden_size=2304,
        intermediate_size=9216,
        num_layers=26,
        num_heads=8,
        num_kv_heads=4,
        head_dim=256,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        sliding_window=4096,
        layer_types=_every_nth_full(26, 2),
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        **_GEMMA,
    ),
}


def preset(name: str) -> ModelConfig:
    """A named ModelConfig; the error lists the known names."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}.")
    return PRESETS[name]
