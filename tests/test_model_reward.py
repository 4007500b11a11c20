"""A reward model as a reward function: its own tokenizer, batches, and a training run."""

import json
import math
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
from tiny_hf import COMMON
from transformers import LlamaConfig, LlamaForSequenceClassification
from xla_flags import xla_flags

from jgrpo.checkpoint import Checkpointer
from jgrpo.config import ConfigError, load_config
from jgrpo.metrics import read_metrics
from jgrpo.plan import plan_memory
from jgrpo.rewards.model_reward import ModelReward, RunningMoments
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


def test_too_long_is_refused_not_truncated(reward_dir, caplog):
    directory, model, tokenizer = reward_dir
    reward = ModelReward(str(directory), dtype=np.float32, max_length=5)
    short, long = reward(["1+2=", "12+30="], ["3", "42"])
    assert math.isclose(short, hf_score(model, tokenizer, "1+2=3"), abs_tol=1e-4)
    assert math.isnan(long)
    assert "completion 1 is 8 tokens" in caplog.text and "reward_model.max_length=5" in caplog.text
    # Through the scoring rules: only the long row scores None, counted as a failure.
    scores = score_completions(
        {"rm": reward}, {"rm": 1.0}, ["1+2=", "12+30="], ["3", "42"], {}, max_failure_share=1.0
    )
    assert scores.valid.tolist() == [True, False] and scores.failures == {"rm": 1}


def test_running_moments_match_numpy_over_every_update():
    values = np.random.default_rng(0).normal(3.0, 2.0, size=40)
    moments = RunningMoments()
    for part in np.split(values, [1, 8, 8, 25]):  # uneven parts, one empty
        moments.update(part)
    assert moments.count == 40
    assert math.isclose(moments.mean, values.mean(), rel_tol=1e-12)
    assert math.isclose(moments.std, values.std(), rel_tol=1e-12)
    restored = RunningMoments()
    restored.load(json.loads(json.dumps(moments.state())))  # as a checkpoint's meta keeps it
    assert restored == moments


def test_running_normalisation_uses_every_training_score_so_far(reward_dir):
    directory, model, tokenizer = reward_dir
    raw = np.array(
        [hf_score(model, tokenizer, p + c) for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    )
    reward = ModelReward(str(directory), dtype=np.float32, normalize="running", scale=2.0)
    first = reward(PROMPTS[:2], COMPLETIONS[:2])  # statistics of the first two scores
    np.testing.assert_allclose(first, 2 * (raw[:2] - raw[:2].mean()) / raw[:2].std(), atol=1e-3)
    with reward.frozen():  # evaluation: read, not updated
        (frozen,) = reward(PROMPTS[4:], COMPLETIONS[4:])
    assert reward.moments.count == 2
    assert math.isclose(frozen, 2 * (raw[4] - raw[:2].mean()) / raw[:2].std(), rel_tol=1e-3)
    second = reward(PROMPTS[2:], COMPLETIONS[2:])  # now over all five
    np.testing.assert_allclose(second, 2 * (raw[2:] - raw.mean()) / raw.std(), atol=1e-3)
    assert reward.moments.count == 5


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
            "train.eval_every=2",
            "train.export=false",
            "train.tensorboard=false",
            "train.progress=false",
            "task.reward_workers=1",  # verifiers in a worker; the reward model stays here
            f"reward_model.path={directory}",
            "reward_model.weight=0.5",
            "reward_model.dtype=float32",
            "reward_model.normalize=running",
        ],
    )
    result = train(config)
    assert result.steps_done == 2
    lines = read_metrics(tmp_path)
    assert {"reward/correct/mean", "reward/format/mean", "eval/reward"} <= set(lines[-1])
    # Step 1's scores are normalised by their own statistics: mean 0, std 1.
    assert abs(lines[0]["reward/reward_model/mean"]) < 1e-4
    assert math.isclose(lines[0]["reward/reward_model/std"], 1.0, abs_tol=1e-3)
    assert all(math.isfinite(line["reward/reward_model/mean"]) for line in lines)
    # The checkpoint keeps the statistics of both steps' completions (not the evaluation's),
    # and a resumed trainer starts from them.
    with Checkpointer(tmp_path / "checkpoints") as checkpointer:
        meta = checkpointer.restore_meta()
    rows = config.rollout.prompts_per_step * config.rollout.num_generations
    assert meta["reward_model_moments"]["count"] == 2 * rows
    resumed = Trainer(config)
    resumed.load_meta(meta)
    assert resumed.reward_model.moments.state() == meta["reward_model_moments"]


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
    # Its scoring scratch at the longest bucket (max_length 2048) holds at least one bf16
    # hidden state of its rows per device: 16 rows / 8 x 2048 tokens x 64 x 2 bytes.
    assert without.reward_scratch == 0 and plan.reward_scratch >= 2 * 2048 * 64 * 2
    assert plan.peak >= plan.reward_peak == plan.resident + plan.reward_scratch
    assert "scoring scratch" in plan.report()


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


TWO_PROCESS_SCRIPT = """
import json, sys
from jgrpo import distributed
address, process, directory, rows = sys.argv[1:]
distributed.initialize(coordinator_address=address, num_processes=2, process_id=int(process))
import numpy as np
from jgrpo.rewards.model_reward import ModelReward
from jgrpo.sharding import make_mesh
prompts, completions = json.loads(rows)
reward = ModelReward(
    directory, dtype=np.float32, batch_size=2, max_length=40, normalize="running",
    mesh=make_mesh((2, 1, 2)),  # data split over the two processes
)
scores = reward(prompts, completions)
print("RESULT " + json.dumps({"scores": scores, "moments": reward.moments.state()}))
"""


@pytest.mark.slow
def test_two_processes_score_their_own_rows_together(reward_dir):
    """Each process scores its own completions, of different counts and length buckets (one
    too long), in the same sharded calls; the running statistics cover both processes."""
    directory, model, tokenizer = reward_dir
    rows = [
        (["1+2=", "3+4="], ["3", "7"]),  # bucket 16, one call
        (["12+30=", "99+1=", "5+5="], ["42 " * 8, "100", "10 " * 20]),  # bucket 32, 2 calls
    ]
    with socket.socket() as s:
        s.bind(("localhost", 0))
        address = f"localhost:{s.getsockname()[1]}"
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(2),
        "JAX_PLATFORMS": "cpu",
    }
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                TWO_PROCESS_SCRIPT,
                address,
                str(index),
                str(directory),
                json.dumps(rows[index]),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for index in range(2)
    ]
    try:
        outputs = [process.communicate(timeout=300)[0] for process in processes]
    finally:
        for process in processes:
            process.kill()
    results = []
    for process, output in zip(processes, outputs, strict=True):
        assert process.returncode == 0, output[-3000:]
        (line,) = [line for line in output.splitlines() if line.startswith("RESULT ")]
        results.append(json.loads(line.removeprefix("RESULT ")))

    texts = [
        p + c for prompts, completions in rows for p, c in zip(prompts, completions, strict=True)
    ]
    lengths = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    assert lengths[0] <= 16 < lengths[2] <= 32 < 40 < lengths[4]  # the buckets tested
    raw = np.array([hf_score(model, tokenizer, text) for text in texts[:4]])
    for result in results:  # both processes hold the statistics of all four scored rows
        assert result["moments"]["count"] == 4
        assert math.isclose(result["moments"]["mean"], raw.mean(), abs_tol=1e-4)
    normalised = (raw - raw.mean()) / raw.std()
    np.testing.assert_allclose(results[0]["scores"], normalised[:2], atol=1e-3)
    np.testing.assert_allclose(results[1]["scores"][:2], normalised[2:4], atol=1e-3)
    assert math.isnan(results[1]["scores"][2])
