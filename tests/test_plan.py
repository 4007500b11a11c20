"""Memory planning from the compiled programs, and the start-up check of the training loop."""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import pytest
from offline import forbid_tfds_downloads, refusing_url
from tiny_hf import save_char_checkpoint

from jgrpo import plan as plan_module
from jgrpo.config import load_config
from jgrpo.plan import OutOfMemoryPlan, micro_batch_candidates, plan_memory
from jgrpo.tasks import gsm8k
from jgrpo.train import Trainer, train

ROOT = pathlib.Path(__file__).parent.parent
SMALL = [
    "task.max_operand=4",
    "rollout.prompts_per_step=8",
    "rollout.num_generations=4",
    "rollout.max_new_tokens=4",
    "rollout.max_prompt_length=8",
    "algorithm.beta=0.04",
    "train.steps=1",
    "train.eval_every=0",
    "train.export=false",
    "train.tensorboard=false",
    "train.progress=false",
    "task.reward_workers=0",
]


# test_plan_sizes' programs are also what the training run below plans (compiled once).
PLANNED = [*SMALL, "rollout.num_generations=2", "mesh.fsdp=8"]


def test_plan_sizes_each_part_per_device():
    trainer = Trainer(load_config(None, PLANNED))
    plan = plan_memory(trainer, micro_batch_candidates(16))
    params = trainer.model.params()
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    # Every parameter of this model has an embed dimension (64) and fsdp = 8 splits it.
    assert plan.parameters == total // 8
    assert plan.reference == plan.parameters  # beta > 0: the frozen copy, sharded alike
    assert 2 * total // 8 <= plan.optimizer <= 2 * total // 8 + 64  # Adam's mu, nu; counts
    c = trainer.model_config
    per_device_prompts, per_device_rows = 8 // 8, 16 // 8
    assert plan.kv_cache == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * (
        per_device_prompts * 8 + per_device_rows * 4
    )
    assert plan.rollout_scratch >= plan.kv_cache  # the cache lives in the rollout's scratch
    # Candidates split evenly over the 8 devices: micro-batches of 8 and 16 rows. (8 rows hold
    # 4 prompts, too few for 8 batch shards, so that update runs every row in full; which of
    # the two needs less scratch depends on the shapes, so the test takes it from the plan.)
    assert sorted(plan.fits) == [8, 16] and plan.micro_batch_rows == 16
    smaller_peak, larger_peak = sorted(plan.fits.values())
    assert smaller_peak < larger_peak
    leaner = min(plan.fits, key=plan.fits.get)
    budget = (smaller_peak + larger_peak) // 2
    assert plan.largest_fitting(budget) == leaner
    assert plan.largest_fitting(larger_peak) == 16
    assert plan.largest_fitting(smaller_peak - 1) is None
    report = plan.report(budget)
    assert f"largest micro-batch that fits: {leaner} rows" in report and "fsdp=8" in report
    advice = plan.report(smaller_peak - 1).splitlines()[-1]
    assert advice == (
        "  no micro-batch fits: shard further (mesh.fsdp, mesh.tensor), use model.dtype=bfloat16, "
        "model.reference_dtype=bfloat16, model.remat=true, model.keep_logits_mib=0, "
        "model.lora_rank=16, or shorter rollout lengths"
    )
    nothing_left = dataclasses.replace(plan, knobs=()).report(smaller_peak - 1)
    assert nothing_left.endswith(
        "no micro-batch fits: shard further (mesh.fsdp, mesh.tensor) or use shorter rollout lengths"
    )


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["algorithm.beta=0.04"],
            "model.dtype=bfloat16 model.reference_dtype=bfloat16 model.remat=true "
            "model.keep_logits_mib=0 model.lora_rank=16",
        ),
        # no reference
        ([], "model.dtype=bfloat16 model.remat=true model.keep_logits_mib=0 model.lora_rank=16"),
        (
            ["algorithm.beta=0.04", "model.reference_dtype=bfloat16", "model.remat=true"],
            "model.dtype=bfloat16 model.keep_logits_mib=0 model.lora_rank=16",
        ),
        # a bf16 model's reference is already bf16
        (
            ["algorithm.beta=0.04", "model.dtype=bfloat16", "model.keep_logits_mib=0"],
            "model.remat=true model.lora_rank=16",
        ),
        (
            ["model.dtype=bfloat16", "model.remat=true", "model.keep_logits_mib=0"],
            "model.lora_rank=16",
        ),
        # LoRA's frozen base is the reference, with or without a KL term
        (
            ["model.lora_rank=8", "model.remat=true", "model.keep_logits_mib=0"],
            "model.dtype=bfloat16 model.reference_dtype=bfloat16",
        ),
    ],
)
def test_the_advice_names_only_settings_not_taken(overrides, expected):
    knobs = plan_module.memory_knobs(load_config(None, ["algorithm.beta=0", *overrides]))
    assert " ".join(knobs) == expected


FEW = ["rollout.prompts_per_step=2", "rollout.num_generations=2", "mesh.devices=1"]


def test_training_stops_before_step_one_when_the_plan_does_not_fit(tmp_path):
    config = load_config(
        None, [*PLANNED, "mesh.memory_budget_gib=1e-4", f"train.run_dir={tmp_path}"]
    )
    with pytest.raises(OutOfMemoryPlan, match="would run out of device memory") as error:
        train(config)
    assert "peak" in str(error.value) and "algorithm.grad_accumulation" in str(error.value)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_plan_command_line(capsys):
    code = plan_module.main([*SMALL, *FEW])
    out = capsys.readouterr().out
    assert code == 0
    assert "memory per device, mesh data=1 x fsdp=1 x tensor=1" in out
    assert float(out.split("peak")[1].split()[0]) > 0


def test_plan_help_shows_the_config_and_the_overrides(capsys):
    with pytest.raises(SystemExit) as exited:
        plan_module.main(["--help"])
    usage = " ".join(capsys.readouterr().out.split())  # as wrapped for any terminal width
    assert exited.value.code == 0
    assert usage.startswith(
        "usage: python -m jgrpo.plan [-h] [--budget-gib GIB] [CONFIG.yaml] [section.key=value ...]"
    )
    assert "smoke" in usage and "python -m jgrpo.train --help" in usage


def test_plan_of_the_gsm8k_recipe_without_network_is_one_line(tmp_path, monkeypatch, capsys):
    """It hung in TFDS's download retries; now the download host is tried first."""
    forbid_tfds_downloads(monkeypatch)
    recipe = str(ROOT / "configs" / "gsm8k-qwen2.5-0.5b.yaml")
    with refusing_url() as url:
        monkeypatch.setattr(gsm8k, "DOWNLOAD_URL", url)
        code = plan_module.main([recipe, "smoke", f"task.data_dir={tmp_path}"])
    error = capsys.readouterr().err
    assert code == 2
    assert error.startswith("error: TFDS gsm8k is not prepared in") and error.count("\n") == 1
    assert error.endswith(f"{gsm8k.OFFLINE_HINT}\n")


def test_smaller_micro_batches_are_planned_as_the_trainer_would_run_them():
    """With G = 2, a 1-row micro-batch splits groups: the update runs every row in full."""
    trainer = Trainer(load_config(None, [*SMALL, *FEW]))
    assert trainer.update_config.shared_prompt_rows == 2
    plan = plan_memory(trainer, micro_batch_candidates(4))
    assert sorted(plan.fits) == [1, 2, 4]
    # The 1-row candidate is planned with the update a 1-row run compiles: every row in full.
    one_row = Trainer(load_config(None, [*SMALL, *FEW, "algorithm.grad_accumulation=4"]))
    assert one_row.update_config.shared_prompt_rows == 1
    scratch = one_row.compiled_update().memory_analysis().temp_size_in_bytes
    assert plan.fits[1] == plan.resident + plan.batch + scratch


def test_packing_plans_only_micro_batches_of_whole_groups():
    """A packed update needs whole groups per micro-batch: with G = 2 a 1-row micro-batch would
    run unpacked (the trainer turns packing off), so the packed plan names it without a peak."""
    trainer = Trainer(load_config(None, [*SMALL, *FEW, "algorithm.pack_completions=true"]))
    plan = plan_memory(trainer, micro_batch_candidates(4))
    assert sorted(plan.fits) == [2, 4] and plan.unplanned == [1]
    report = plan.report(budget=2**40)
    assert "micro-batch     1 rows: splits groups, so runs unpacked" in report
    assert "largest micro-batch that fits: 4 rows" in report


def test_a_bf16_reference_is_planned_and_placed_at_its_rounded_size(tmp_path):
    """model.reference_dtype=bfloat16 on a checkpoint with tied embeddings: the reference
    holds its kernels and its one table (input and output) in bf16, beside f32 norms, each
    split like the parameter it rounds; the plan counts those bytes, and the update compiles
    for them."""
    directory = save_char_checkpoint(tmp_path / "tied", tied=True)
    overrides = [*PLANNED, f"model.path={directory}", "model.reference_dtype=bfloat16"]
    trainer = Trainer(load_config(None, overrides))
    params = trainer.initial_params()
    reference = trainer.reference_params(params)
    assert "lm_head" not in reference and reference["embed"].dtype == jnp.bfloat16
    for rounded, param in zip(jax.tree.leaves(reference), jax.tree.leaves(params), strict=True):
        assert rounded.sharding.is_equivalent_to(param.sharding, param.ndim)
    f32 = sum(x.size * 4 for x in jax.tree.leaves(params))
    matrices = params["embed"].size + sum(
        x.size for name, x in params["layers"].items() if name.endswith("_kernel")
    )
    expected = f32 - 2 * matrices  # each matrix at 2 bytes a value instead of 4
    assert sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(reference)) == expected
    plan = plan_memory(trainer)
    assert plan.reference == expected // 8  # every leaf has an embed dimension: fsdp splits it


def test_the_reference_of_kl_in_reward_is_planned():
    """algorithm.kl_in_reward=true: the update takes no reference (its beta is 0), but the
    frozen copy still lives beside the policy to score the rewards' KL, so the plan counts it."""
    trainer = Trainer(load_config(None, [*SMALL, *FEW, "algorithm.kl_in_reward=true"]))
    assert trainer.update_config.beta == 0 and trainer.update_arguments()[2] is None
    plan = plan_memory(trainer)
    assert plan.reference == plan.parameters > 0
