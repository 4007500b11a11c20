"""ModelConfig: HF config translation both ways, presets, and validation."""

import dataclasses
import pathlib
import sys

import pytest
import transformers
from tiny_hf import FAMILIES, make_torch_model

from jgrpo.models.config import PRESETS, Llama3RopeScaling, ModelConfig, preset


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_from_hf_config_reads_each_family(family):
    hf_config = make_torch_model(family).config
    config = ModelConfig.from_hf_config(hf_config)
    assert config.model_type == hf_config.model_type
    assert (config.num_heads, config.num_kv_heads) == (4, 2)
    assert config.head_dim == (32 if family == "qwen3" else 16)
    assert config.qkv_bias == (family == "qwen2")
    assert config.qk_norm == (family == "qwen3")
    assert config.tie_word_embeddings == (family == "qwen2")
    if family == "llama3":
        assert config.rope_theta == 500_000.0
        assert config.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 32)
    else:
        assert config.rope_scaling is None


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


def test_mistral_keeps_its_sliding_window_and_refuses_inputs_longer_than_it(hf_checkpoint):
    """Mistral's window round-trips through config.json; the decoder attends in full, which
    equals the window up to W tokens, so a longer input (forward, rollout, update batch) and a
    config whose rows could outgrow it are refused, naming the window and the settings."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jgrpo.config import ConfigError, load_config
    from jgrpo.models.transformer import Transformer, forward
    from jgrpo.sampling import SamplingConfig, rollout
    from jgrpo.setup import Setup

    config = ModelConfig.from_hf_config(make_torch_model("mistral").config)
    assert config.sliding_window == 128 and config.to_hf_config()["sliding_window"] == 128
    small = config.replace(sliding_window=8)
    params = Transformer(small, rngs=nnx.Rngs(0)).params()
    ids = jnp.ones((1, 9), jnp.int32)
    assert forward(params, ids[:, :8], config=small).shape == (1, 8, small.vocab_size)
    with pytest.raises(ValueError, match="spans 9 tokens, more than the sliding window of 8"):
        forward(params, ids, config=small)
    with pytest.raises(ValueError, match="a rollout row spans 10 tokens"):
        rollout(
            params,
            ids[:, :6],
            ids[:, :6],
            jax.random.key(0),
            model_config=small,
            num_generations=2,
            sampling=SamplingConfig(max_new_tokens=4, stop_token_ids=(2,)),
        )
    with pytest.raises(ValueError, match="sliding_window is Mistral's"):
        preset("tiny").replace(sliding_window=8)

    directory, _ = hf_checkpoint("mistral")
    settings = [f"model.path={directory}", "rollout.max_prompt_length=120"]
    with pytest.raises(ConfigError, match="rollout.max_prompt_length \\+ rollout.max_new_tokens"):
        Setup(load_config(None, [*settings, "rollout.max_new_tokens=16", "train.run_dir=unused"]))
