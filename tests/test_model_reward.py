"""A reward model as a reward function: its own tokenizer, batches, and a training run."""

import math

import jax
import numpy as np
import pytest
import torch
from tiny_hf import COMMON
from transformers import LlamaConfig, LlamaForSequenceClassification

from jgrpo.config import ConfigError, load_config
from jgrpo.metrics import read_metrics
from jgrpo.plan import plan_memory
from jgrpo.rewards.model_reward import ModelReward
from jgrpo.rewards.scoring import score_completions
from jgrpo.sharding import make_mesh
from jgrpo.tasks.arithmetic import text_tokenizer
from jgrpo.train import Trainer, train

PROMPTS = ["3+4=", "12+30=", "0+0=", "7+8=", "9+9="]
COMPLETIONS = ["7", "42", "0", "15 is it", ""]


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    """A tiny random Llama reward model with a printable-ASCII tokenizer: not the demo
    policy's tokenizer (digits and + = only), so the two must not be confused."""
    directory = tmp_path_factory.mktemp("reward_model")
    tokenizer = text_tokenizer()
    config = {**COMMON, "vocab_size": len(tokenizer)}
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(**config, num_labels=1, pad_token_id=0))
    model.eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory, model, tokenizer


def hf_score(model, tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def test_scores_are_transformers_scores_of_each_text(reward_dir):
    directory, model, tokenizer = reward_dir
    reward = ModelReward(str(directory), dtype=np.float32, batch_size=2)  # 3 calls, 1 row padded
    scores = reward(PROMPTS, COMPLETIONS)
    pairs = zip(PROMPTS, COMPLETIONS, strict=True)
    expected = [hf_score(model, tokenizer, p + c) for p, c in pairs]
    np.testing.assert_allclose(scores, expected, atol=1e-4, rtol=0)
    assert np.ptp(expected) > 1e-3
    affine = ModelReward(str(directory), dtype=np.float32, scale=2.0, shift=-1.0)
    np.testing.assert_allclose(affine(PROMPTS, COMPLETIONS), 2 * np.array(expected) - 1, atol=2e-4)


def test_chat_prompts_use_the_reward_models_chat_template(reward_dir):
    directory, model, tokenizer = reward_dir
    reward = ModelReward(str(directory), dtype=np.float32)
    prompt = [{"role": "system", "content": "add"}, {"role": "user", "content": "3+4="}]
    completion = [{"role": "assistant", "content": "7"}]
    text = reward.text(prompt, completion)
    assert text == "system: add\nuser: 3+4=\nassistant: 7\n"
    (score,) = reward([prompt], [completion])
    assert math.isclose(score, hf_score(model, tokenizer, text), abs_tol=1e-4)


def test_too_long_is_refused_not_truncated(reward_dir):
    reward = ModelReward(str(reward_dir[0]), dtype=np.float32, max_length=5)
    with pytest.raises(ValueError, match=r"completion 1 is 8 tokens .* reward_model.max_length=5"):
        reward(["1+2=", "12+30="], ["3", "42"])
    # Through the scoring rules: only the long row scores None.
    scores = score_completions(
        {"rm": reward}, {"rm": 1.0}, ["1+2=", "12+30="], ["3", "42"], {}, max_failure_share=1.0
    )
    assert scores.valid.tolist() == [True, False] and scores.failures == {"rm": 1}


def test_on_a_mesh_it_scores_like_one_device(reward_dir):
    directory = str(reward_dir[0])
    plain = ModelReward(directory, dtype=np.float32)(PROMPTS, COMPLETIONS)
    meshed = ModelReward(directory, dtype=np.float32, batch_size=3, mesh=make_mesh((2, 2, 2)))
    assert meshed.batch_size == 4  # rounded up to whole rows per data x fsdp device
    np.testing.assert_allclose(meshed(PROMPTS, COMPLETIONS), plain, atol=1e-5, rtol=0)


def test_a_run_scores_with_a_reward_model_of_another_tokenizer(reward_dir, tmp_path):
    directory = reward_dir[0]
    config = load_config(
        None,
        [
            "smoke",
            f"train.run_dir={tmp_path}",
            "train.steps=2",
            "train.eval_every=0",
            "train.export=false",
            "train.tensorboard=false",
            "train.progress=false",
            "task.reward_workers=1",  # verifiers in a worker; the reward model stays here
            f"reward_model.path={directory}",
            "reward_model.weight=0.5",
            "reward_model.dtype=float32",
        ],
    )
    result = train(config)
    assert result.steps_done == 2
    lines = read_metrics(tmp_path)
    assert all(math.isfinite(line["reward/reward_model"]) for line in lines)
    assert {"reward/correct", "reward/format"} <= set(lines[-1])


def test_the_memory_plan_counts_its_shards(reward_dir):
    overrides = ["smoke", "mesh.devices=-1", "mesh.fsdp=8", "rollout.prompts_per_step=8"]
    without = plan_memory(Trainer(load_config(None, [*overrides, "task.reward_workers=0"])))
    trainer = Trainer(
        load_config(
            None, [*overrides, "task.reward_workers=0", f"reward_model.path={reward_dir[0]}"]
        )
    )
    plan = plan_memory(trainer)
    params = trainer.task.reward_fns["reward_model"].model.params
    assert all(x.dtype == np.dtype("bfloat16") for x in jax.tree.leaves(params))  # the default
    total = sum(x.size * 2 for x in jax.tree.leaves(params))
    # Every reward model parameter has an embed dimension (64) and fsdp = 8 splits it.
    assert without.reward_model == 0 and plan.reward_model == total // 8
    assert plan.resident == without.resident + plan.reward_model
    assert "reward model" in plan.report() and "reward model" not in without.report()


def test_a_name_clash_is_refused(reward_dir, tmp_path):
    config = load_config(
        None,
        [
            "smoke",
            f"train.run_dir={tmp_path}",
            "task.reward_workers=0",
            f"reward_model.path={reward_dir[0]}",
            "reward_model.name=correct",
        ],
    )
    with pytest.raises(ConfigError, match=r"reward_model.name='correct' is already a reward"):
        Trainer(config)


def test_config_checks():
    with pytest.raises(ConfigError, match=r"reward_model.dtype must be"):
        load_config(None, ["reward_model.dtype=float16"])
    with pytest.raises(ConfigError, match=r"reward_model.batch_size and"):
        load_config(None, ["reward_model.batch_size=0"])
