"""HF checkpoint import/export: round trips through transformers, sharding, bad checkpoints."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from tiny_hf import VOCAB
from transformers import AutoModelForCausalLM, AutoTokenizer

from jgrpo.models.hf import CheckpointError, from_pretrained, save_pretrained

IDS = np.random.default_rng(0).integers(3, VOCAB, size=(2, 9))


def torch_logits(directory):
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.numpy()


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_round_trip_through_transformers(family, hf_checkpoint, tmp_path):
    source, torch_model = hf_checkpoint(family)
    model = from_pretrained(source)
    out = save_pretrained(model, tmp_path / "export")
    # transformers loads the export and computes the same logits as the original model.
    with torch.no_grad():
        original = torch_model(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(torch_logits(out), original, atol=1e-5, rtol=0)
    np.testing.assert_allclose(model(jnp.asarray(IDS)), original, atol=1e-4, rtol=0)
    # The tokenizer came along, byte for byte, and loads as the original does.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes()
    text = "w5 w7"
    assert AutoTokenizer.from_pretrained(out)(text) == AutoTokenizer.from_pretrained(source)(text)
    exported_config = json.loads((out / "config.json").read_text())
    assert exported_config["model_type"] == torch_model.config.model_type


def test_sharded_export_and_import(hf_checkpoint, tmp_path):
    model = from_pretrained(hf_checkpoint("llama3")[0])
    out = save_pretrained(model, tmp_path / "sharded", max_shard_bytes=40_000)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and (out / "model.safetensors.index.json").exists()
    np.testing.assert_array_equal(from_pretrained(out)(jnp.asarray(IDS)), model(jnp.asarray(IDS)))
    np.testing.assert_allclose(torch_logits(out), model(jnp.asarray(IDS)), atol=1e-4, rtol=0)


def test_bf16_export(hf_checkpoint, tmp_path):
    model = from_pretrained(hf_checkpoint("qwen3")[0], dtype=jnp.bfloat16)
    out = save_pretrained(model, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    reloaded = from_pretrained(out, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(reloaded(jnp.asarray(IDS)), model(jnp.asarray(IDS)))


def copy_checkpoint(source, destination, edit):
    """A copy of a checkpoint whose tensor dict (and config) `edit` changes."""
    destination.mkdir()
    tensors = load_file(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    edit(tensors, config)
    save_file(tensors, destination / "model.safetensors", metadata={"format": "pt"})
    (destination / "config.json").write_text(json.dumps(config))
    return destination


def test_tied_checkpoint_may_also_store_lm_head(hf_checkpoint, tmp_path):
    source, _ = hf_checkpoint("qwen2")  # tied embeddings

    def add_copy(tensors, config):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()

    directory = copy_checkpoint(source, tmp_path / "tied", add_copy)
    np.testing.assert_array_equal(
        from_pretrained(directory)(jnp.asarray(IDS)), from_pretrained(source)(jnp.asarray(IDS))
    )


def drop(name):
    return lambda tensors, config: tensors.pop(name)


def add(name):
    return lambda tensors, config: tensors.__setitem__(name, np.zeros(3, np.float32))


def reshape(name):
    def edit(tensors, config):
        tensors[name] = tensors[name][:-1]

    return edit


def set_model_type(tensors, config):
    config["model_type"] = "phi3"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            drop("model.layers.1.mlp.up_proj.weight"),
            r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight",
        ),
        (
            add("model.layers.0.extra.weight"),
            r"unexpected tensors: model\.layers\.0\.extra\.weight",
        ),
        (
            reshape("model.layers.0.self_attn.k_proj.weight"),
            r"tensor model\.layers\.0\.self_attn\.k_proj\.weight has shape \(31, 64\), "
            r"expected \(32, 64\)",
        ),
        (
            set_model_type,
            "model_type 'phi3' is not supported; supported: llama, qwen2, qwen3, qwen3_moe",
        ),
    ],
)
def test_bad_checkpoints_get_clear_errors(edit, message, hf_checkpoint, tmp_path):
    directory = copy_checkpoint(hf_checkpoint("llama3")[0], tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=message):
        from_pretrained(directory)


def test_directory_without_safetensors(hf_checkpoint, tmp_path):
    source, torch_model = hf_checkpoint("llama3")
    directory = tmp_path / "pickle"
    directory.mkdir()
    (directory / "config.json").write_text((source / "config.json").read_text())
    torch.save(torch_model.state_dict(), directory / "pytorch_model.bin")
    with pytest.raises(
        CheckpointError, match=r"no \.safetensors files .* pytorch_model\.bin: pickle"
    ):
        from_pretrained(directory)


def test_missing_directory():
    with pytest.raises(FileNotFoundError, match="not a directory"):
        from_pretrained("/nonexistent/checkpoint")


@pytest.fixture
def hub_offline(monkeypatch, tmp_path):
    """huggingface_hub offline with an empty cache: a machine without network, for a model it
    never downloaded (the same error as a failed connection, without waiting for one)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


def test_a_hub_name_without_network_names_the_local_route(hub_offline):
    with pytest.raises(ConnectionError) as raised:
        from_pretrained("Qwen/Qwen2.5-0.5B-Instruct")
    assert str(raised.value) == (
        "Qwen/Qwen2.5-0.5B-Instruct is not a local directory, and the Hugging Face hub, where "
        "it would be downloaded from, cannot be reached (offline?): give a local HF checkpoint "
        "directory instead (model.path=, reward_model.path=)."
    )


def test_a_mistyped_local_path_says_so_in_one_line(hub_offline):
    with pytest.raises(FileNotFoundError) as raised:
        from_pretrained("runs/demo/hf_")
    assert str(raised.value) == (
        "runs/demo/hf_ is neither a local directory nor a hub name (owner/name): give a local "
        "HF checkpoint directory instead (model.path=, reward_model.path=)."
    )
