"""ModelConfig: HF config translation both ways, presets, and validation."""

import dataclasses
import pathlib
import sys

import pytest
import transformers
from tiny_hf import FAMILIES, make_torch_model

from jgrpo.models.config import (
    PRESETS,
    LinearRopeScaling,
    Llama3RopeScaling,
    ModelConfig,
    preset,
)

FULL, SLIDE = "full_attention", "sliding_attention"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_from_hf_config_reads_each_family(family):
    hf_config = make_torch_model(family).config
    config = ModelConfig.from_hf_config(hf_config)
    gemma = family.startswith("gemma")
    assert config.model_type == hf_config.model_type
    assert (config.num_heads, config.num_kv_heads) == (4, 2)
    assert config.head_dim == (32 if family in ("qwen3", "gemma3") else 16)
    assert config.qkv_bias == (family == "qwen2")
    assert config.qk_norm == (family in ("qwen3", "qwen3_moe", "gemma3"))
    experts = (config.num_experts, config.experts_per_token, config.moe_intermediate_size)
    assert experts == ((4, 2, 24) if family == "qwen3_moe" else (0, 0, 0))
    assert config.norm_topk_prob == (family == "qwen3_moe")
    assert config.tie_word_embeddings == (family == "qwen2" or gemma)
    switches = (config.hidden_act, config.norm_weight_offset, config.post_norms)
    assert switches == (("gelu_pytorch_tanh", 1.0, True) if gemma else ("silu", 0.0, False))
    assert config.scale_embeddings == gemma
    if family == "llama3":
        assert config.rope_theta == 500_000.0
        assert config.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 32)
    elif family == "gemma3":
        assert (config.rope_theta, config.rope_local_theta) == (100_000.0, 10_000.0)
        assert config.rope_scaling == LinearRopeScaling(2.0)
    else:
        assert config.rope_scaling is None and config.rope_local_theta is None
    sliding = {
        "mistral": (6, (True, True)),
        "gemma2": (5, (True, False)),
        "gemma3": (4, (True, True, False, True, False)),
    }
    window, kinds = sliding.get(family, (None, (False, False)))
    assert (config.sliding_window, config.sliding_layers) == (window, kinds)
    assert config.query_pre_attn_scalar == {"gemma2": 24, "gemma3": 20}.get(family)
    assert config.attention_scale == (config.query_pre_attn_scalar or config.head_dim) ** -0.5
    caps = (config.attn_logit_softcapping, config.final_logit_softcapping)
    assert caps == ((2.0, 3.0) if family == "gemma2" else (None, None))


def test_gemma_configs_of_transformers_4_are_read():
    """Hub config.json files written before transformers listed `layer_types`: Gemma 2
    alternates sliding and full layers from the first; Gemma 3 has every
    `sliding_window_pattern`-th layer full, its local RoPE base in `rope_local_base_freq`,
    and its linear scaling (4B and up) on the full layers only."""
    gemma = {**BASE, "hidden_activation": "gelu_pytorch_tanh", "num_hidden_layers": 6}
    gemma2 = ModelConfig.from_hf_config(
        {**gemma, "model_type": "gemma2", "sliding_window": 4096, "query_pre_attn_scalar": 256}
    )
    assert gemma2.layer_types == (SLIDE, FULL) * 3
    assert gemma2.query_pre_attn_scalar == 256.0 and gemma2.rope_local_theta is None
    gemma3 = ModelConfig.from_hf_config(
        {
            **gemma,
            "model_type": "gemma3_text",
            "sliding_window": 512,
            "sliding_window_pattern": 3,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        }
    )
    assert gemma3.layer_types == (SLIDE, SLIDE, FULL) * 2
    assert gemma3.rope_scaling == LinearRopeScaling(8.0)
    assert (gemma3.rope_theta, gemma3.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert gemma3.query_pre_attn_scalar == 16.0  # head_dim when the config has none
    # transformers reads what we write back the same way
    hf_config = transformers.AutoConfig.for_model(**gemma3.to_hf_config())
    assert hf_config.rope_parameters[SLIDE]["rope_theta"] == 10_000.0
    assert hf_config.rope_parameters[FULL]["factor"] == 8.0
    assert ModelConfig.from_hf_config(hf_config) == gemma3


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_to_hf_config_round_trips_through_transformers(family):
    config = ModelConfig.from_hf_config(make_torch_model(family).config)
    hf_config = transformers.AutoConfig.for_model(**config.to_hf_config())
    assert ModelConfig.from_hf_config(hf_config) == config


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip(name):
    config = preset(name)
    assert ModelConfig.from_hf_config(config.to_hf_config()) == config


BASE = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


MOE = {
    "model_type": "qwen3_moe",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 8,
}


def test_transformers_4_spelling_is_read():
    """Hub config.json files written by transformers 4: rope_theta and rope_scaling on top."""
    legacy = {
        **BASE,
        "num_key_value_heads": 1,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "eos_token_id": [128001, 128009],
    }
    config = ModelConfig.from_hf_config(legacy)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == Llama3RopeScaling(32.0, 1.0, 4.0, 8192)
    assert config.head_dim == 16
    assert config.eos_token_id == (128001, 128009)


def test_param_count_of_a_known_checkpoint():
    # Qwen2.5-0.5B is published as 494M parameters (tied embeddings).
    assert round(preset("qwen2.5-0.5b").num_params / 1e6) == 494
    # SmolLM2-135M: 134.5M parameters (tied embeddings), as transformers counts them.
    assert preset("smollm2-135m").num_params == 134_515_008
    # Gemma, as transformers counts the released checkpoints (tied embeddings).
    assert preset("gemma3-270m").num_params == 268_098_176
    assert preset("gemma3-1b").num_params == 999_885_952
    assert preset("gemma2-2b").num_params == 2_614_341_888
    # Qwen3-30B-A3B: 30.5B parameters, 128 experts in each of 48 layers.
    assert preset("qwen3-30b-a3b").num_params == 30_532_122_624


def test_the_smollm2_preset_is_the_compare_benchmarks_architecture():
    """scripts/compare_workload.py writes the checkpoint every library loads from its own HF
    config (it must import without jax); the preset must describe the same model."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "scripts"))
    from compare_workload import SMOLLM2_135M

    ours = preset("smollm2-135m")
    loaded = ModelConfig.from_hf_config({"model_type": "llama", **SMOLLM2_135M})
    ids = dict(bos_token_id=ours.bos_token_id, eos_token_id=ours.eos_token_id)
    assert loaded.replace(**ids, pad_token_id=ours.pad_token_id) == ours


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported; supported: llama, qwen2"),
        ({"model_type": "gemma3"}, "multimodal Gemma 3.*model_type 'gemma3_text'"),
        ({"model_type": "gemma2"}, "hidden_act 'silu' is not supported for gemma2"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({**MOE, "mlp_only_layers": [0]}, "mlp_only_layers .* every layer must be sparse"),
        ({**MOE, "decoder_sparse_step": 2}, "decoder_sparse_step != 1"),
        ({**MOE, "num_experts_per_tok": 5}, r"experts_per_token must be in \[1, num_experts=4\]"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"attention_bias": True}, "attention_bias=true is not supported for llama"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_key_value_heads": 3}, r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
    ],
)
def test_unsupported_hf_configs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config({**BASE, **change})


def test_validation_names_the_field():
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        dataclasses.replace(preset("tiny"), hidden_size=0)
    with pytest.raises(ValueError, match="unknown model preset 'huge'; known: tiny"):
        preset("huge")
    with pytest.raises(ValueError, match="layer_types must name 2 layers"):
        preset("tiny").replace(sliding_window=8, layer_types=(SLIDE,))
    with pytest.raises(ValueError, match="layer_types has sliding layers but sliding_window"):
        preset("tiny").replace(layer_types=(SLIDE, FULL))
    with pytest.raises(ValueError, match="hidden_act 'relu' is not supported"):
        preset("tiny").replace(hidden_act="relu")
    with pytest.raises(ValueError, match="final_logit_softcapping must be > 0"):
        preset("tiny").replace(final_logit_softcapping=0.0)
    with pytest.raises(ValueError, match="has no HF equivalent with hidden_act"):
        preset("tiny").replace(post_norms=True).to_hf_config()
