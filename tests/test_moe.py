"""Mixture-of-experts models (Qwen3-MoE) through the trainer: on a mesh as on one device,
exported to transformers, planned, and LoRA's targets on them. (Logit, decode and gradient
parity with transformers: the family tests of test_transformer, test_group_decode and
test_group_forward, which include a tiny Qwen3-MoE.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tiny_hf import save_char_checkpoint
from transformers import AutoModelForCausalLM

from jgrpo.config import ConfigError, load_config
from jgrpo.metrics import read_metrics
from jgrpo.models.hf import from_pretrained
from jgrpo.setup import Setup
from jgrpo.train import train

COMMON = [
    "task.max_operand=4",
    "rollout.prompts_per_step=8",
    "rollout.num_generations=4",
    "rollout.max_new_tokens=4",
    "rollout.max_prompt_length=64",
    "algorithm.beta=0.04",
    "optim.lr=1e-3",
    "optim.eps=1e-6",  # as test_sharding's mesh run: bounds Adam's amplification of rounding
    "train.steps=2",
    "train.eval_every=0",
    "train.tensorboard=false",
    "train.progress=false",
    "task.reward_workers=0",
]


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    return save_char_checkpoint(tmp_path_factory.mktemp("moe"), moe=True)


def test_a_moe_model_trains_on_a_mesh_as_on_one_device_and_exports(moe_checkpoint, tmp_path):
    """Two GRPO steps of a tiny Qwen3-MoE on fsdp=4 x tensor=2 (the experts' weights split
    as a dense MLP's): the same rewards, losses and nearly the same parameters as on one
    device; the export loads in transformers with our logits."""
    runs = {}
    for name, mesh in [("one", ["mesh.devices=1"]), ("mesh", ["mesh.fsdp=4", "mesh.tensor=2"])]:
        overrides = [
            *COMMON,
            *mesh,
            f"model.path={moe_checkpoint}",
            f"train.run_dir={tmp_path / name}",
        ]
        runs[name] = train(load_config(None, overrides))
    for a, b in zip(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "mesh"), strict=True):
        assert a["reward/mean"] == b["reward/mean"]  # the same completions were sampled
        np.testing.assert_allclose(a["loss"], b["loss"], atol=1e-6)
    one, sharded = runs["one"].state.params, runs["mesh"].state.params
    assert one["layers"]["expert_gate_kernel"].shape == (2, 4, 64, 32)  # [L, X, E, M]
    difference = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(sharded), strict=True)
    )
    assert difference < 1e-5
    moved = np.abs(np.asarray(one["layers"]["expert_down_kernel"])).max()
    assert moved > 0  # the experts trained

    exported = from_pretrained(tmp_path / "one" / "hf")
    ids = np.arange(3, 23).reshape(2, 10)
    torch_model = AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "hf")
    with torch.no_grad():
        expected = torch_model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(exported(jnp.asarray(ids)), expected, atol=1e-4, rtol=0)


def test_lora_on_a_moe_model_adapts_the_attention(moe_checkpoint):
    """The experts are not LoRA targets yet: the default (every projection) is refused with
    the targets that work, which then build adapters for the attention alone."""
    base = [*COMMON, f"model.path={moe_checkpoint}", "model.lora_rank=4", "train.run_dir=unused"]
    with pytest.raises(ConfigError, match="Set model.lora_targets=q_proj,k_proj,v_proj,o_proj"):
        Setup(load_config(None, base))
    setup = Setup(load_config(None, [*base, "model.lora_targets=q_proj,k_proj,v_proj,o_proj"]))
    adapters = setup.initial_params()
    assert sorted(adapters["layers"]) == ["k_kernel", "o_kernel", "q_kernel", "v_kernel"]
