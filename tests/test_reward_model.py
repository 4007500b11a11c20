"""Reward models: HF sequence-classification checkpoints scored exactly as transformers does."""

import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from tiny_hf import COMMON, FAMILIES
from transformers import (
    Gemma2ForSequenceClassification,
    Gemma3TextForSequenceClassification,
    LlamaForSequenceClassification,
    MistralForSequenceClassification,
    Qwen2ForSequenceClassification,
    Qwen3ForSequenceClassification,
)

from jgrpo.models.hf import CheckpointError
from jgrpo.models.reward_model import last_token_index, load_reward_model, reward_param_axes
from jgrpo.sharding import make_mesh, row_shardings, rules_context, tree_shardings

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAD = 0
CLASSIFIERS = {
    "llama3": LlamaForSequenceClassification,
    "qwen2": Qwen2ForSequenceClassification,
    "qwen3": Qwen3ForSequenceClassification,
    "mistral": MistralForSequenceClassification,
    "gemma2": Gemma2ForSequenceClassification,
    "gemma3": Gemma3TextForSequenceClassification,
}
# Real tokens of four rows; row 2 ends with the pad id itself, which transformers skips.
ROWS = [[5, 9, 11, 40, 7, 3, 8, 60, 12], [14, 15, 16, 17, 18, 19], [30, 31, 32, PAD], [50, 51]]


def save_classifier(family, directory, *, num_labels=1, pad_token_id=PAD, seed=0):
    """A random f32 *ForSequenceClassification checkpoint; norms and biases perturbed."""
    config_class, _, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_class(**{**COMMON, **extra}, num_labels=num_labels, pad_token_id=pad_token_id)
    config._attn_implementation = "eager"  # soft-capping and windows as written
    model = CLASSIFIERS[family](config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(directory)
    return model


def padded(side):
    """ROWS padded to a common length on `side`: (ids, mask) int[B, T]."""
    length = max(map(len, ROWS)) + 2
    ids = np.full((len(ROWS), length), PAD, np.int64)
    mask = np.zeros((len(ROWS), length), np.int64)
    for row, tokens in enumerate(ROWS):
        span = slice(0, len(tokens)) if side == "right" else slice(length - len(tokens), length)
        ids[row, span], mask[row, span] = tokens, 1
    return ids, mask


def torch_scores(model, ids, mask):
    """transformers' scores: its plain forward with the attention mask."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    return out.logits[:, 0].numpy()


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_scores_equal_transformers(family, side, tmp_path):
    torch_model = save_classifier(family, tmp_path)
    reward_model = load_reward_model(tmp_path)
    assert set(reward_model.params) == {"embed", "layers", "final_norm", "score"}
    assert reward_model.params["score"].shape == (COMMON["hidden_size"], 1)
    ids, mask = padded(side)
    expected = torch_scores(torch_model, ids, mask)
    scores = np.asarray(reward_model(jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)))
    assert scores.dtype == np.float32 and scores.shape == (len(ROWS),)
    np.testing.assert_allclose(scores, expected, atol=1e-4, rtol=0)
    assert np.ptp(scores) > 1e-2  # the rows really score differently


def test_left_and_right_padding_score_alike(tmp_path):
    save_classifier("llama3", tmp_path)
    reward_model = load_reward_model(tmp_path)
    right = reward_model(*(jnp.asarray(a, jnp.int32) for a in padded("right")))
    left = reward_model(*(jnp.asarray(a, jnp.int32) for a in padded("left")))
    np.testing.assert_allclose(left, right, atol=1e-5, rtol=0)


def test_the_last_token_is_found_as_transformers_finds_it():
    ids = jnp.asarray([[7, 8, 0, 0], [0, 0, 7, 8], [7, 0, 8, 0], [0, 0, 0, 0]])
    mask = jnp.asarray([[1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]])
    # The rightmost token that is not the pad id, whatever the mask says; 0 if none is.
    np.testing.assert_array_equal(last_token_index(ids, mask, 0), [1, 3, 2, 0])
    # Without a pad id: the rightmost real token of the mask.
    np.testing.assert_array_equal(last_token_index(ids, mask, None), [1, 3, 3, 0])


def test_a_checkpoint_without_pad_token_uses_the_mask(tmp_path):
    torch_model = save_classifier("qwen2", tmp_path, pad_token_id=None)
    reward_model = load_reward_model(tmp_path)
    assert reward_model.pad_token_id is None
    ids, mask = padded("right")
    ids[2, 3] = 70  # no token is special now; row 2's last real token is scored
    expected = [torch_scores(torch_model, ids[i : i + 1, : len(r)], mask[i : i + 1, : len(r)])[0]
                for i, r in enumerate(ROWS)]  # fmt: skip
    scores = reward_model(jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32))
    np.testing.assert_allclose(scores, expected, atol=1e-4, rtol=0)


def test_sharded_like_the_policy_scores_like_one_device(tmp_path):
    save_classifier("qwen3", tmp_path)
    plain = load_reward_model(tmp_path)
    mesh = make_mesh((2, 2, 2))
    shardings = tree_shardings(plain.params, reward_param_axes(plain.config), mesh)
    sharded = load_reward_model(tmp_path, shardings=shardings)
    for leaf, sharding in zip(
        jax.tree.leaves(sharded.params), jax.tree.leaves(shardings), strict=True
    ):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    q = sharded.params["layers"]["q_kernel"]  # [L, E, H, D]: E over fsdp, H over tensor
    assert q.sharding.shard_shape(q.shape) == (q.shape[0], q.shape[1] // 2, q.shape[2] // 2, 32)
    score = sharded.params["score"]  # [E, 1]: E over fsdp
    assert score.sharding.shard_shape(score.shape) == (score.shape[0] // 2, 1)
    _, row_matrix = row_shardings(mesh)
    ids, mask = (jnp.asarray(a, jnp.int32) for a in padded("left"))
    with rules_context(mesh):
        scores = sharded(jax.device_put(ids, row_matrix), jax.device_put(mask, row_matrix))
    np.testing.assert_allclose(scores, plain(ids, mask), atol=1e-5, rtol=0)


def test_bf16_reward_model_is_close_to_f32(tmp_path):
    save_classifier("llama3", tmp_path)
    ids, mask = (jnp.asarray(a, jnp.int32) for a in padded("right"))
    f32 = load_reward_model(tmp_path)(ids, mask)
    bf16_model = load_reward_model(tmp_path, dtype=jnp.bfloat16)
    assert bf16_model.params["score"].dtype == jnp.bfloat16
    bf16 = bf16_model(ids, mask)
    assert bf16.dtype == jnp.float32
    # bf16 weights keep 8 bits of mantissa: scores of O(1) agree to a few hundredths.
    np.testing.assert_allclose(bf16, f32, atol=5e-2, rtol=0)


def test_more_than_one_label_is_refused(tmp_path):
    save_classifier("llama3", tmp_path, num_labels=3)
    with pytest.raises(CheckpointError, match=r"score head with 3 labels.*num_labels=1"):
        load_reward_model(tmp_path)


def test_a_causal_lm_checkpoint_is_refused(hf_checkpoint):
    directory, _ = hf_checkpoint("llama3")
    with pytest.raises(CheckpointError, match=r"is LlamaForCausalLM; a reward model must be"):
        load_reward_model(directory)


def test_a_missing_score_head_is_named(tmp_path):
    save_classifier("qwen2", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["score.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"no score head \(tensor score.weight\)"):
        load_reward_model(tmp_path)


def test_an_unsupported_architecture_is_refused(tmp_path):
    save_classifier("llama3", tmp_path)
    hf_config = json.loads((tmp_path / "config.json").read_text())
    hf_config["architectures"] = ["Phi3ForSequenceClassification"]
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(CheckpointError, match=r"Phi3ForSequenceClassification; a reward model"):
        load_reward_model(tmp_path)
    # A supported architecture name over a model type we do not implement is refused too.
    hf_config["architectures"] = ["LlamaForSequenceClassification"]
    hf_config["model_type"] = "phi3"
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(CheckpointError, match=r"model_type 'phi3' is not supported"):
        load_reward_model(tmp_path)


def test_library_docs_example_runs(tmp_path):
    save_classifier("llama3", tmp_path)
    text = (ROOT / "docs" / "library.md").read_text()
    block = next(
        b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "load_reward_model" in b
    )
    namespace = {"reward_dir": tmp_path}
    # the page's first block imports
    source = "import jax.numpy as jnp\nfrom jgrpo import models\n" + block
    exec(compile(source, "docs/library.md", "exec"), namespace)
    assert namespace["scores"].shape == (2,) and namespace["scores"].dtype == jnp.float32
    reward_model = load_reward_model(tmp_path)
    single = reward_model(jnp.asarray([[5, 9]]), jnp.asarray([[1, 1]]))
    np.testing.assert_allclose(namespace["scores"][1], single[0], atol=1e-5, rtol=0)
