"""LoRA (`model.lora_rank`): adapters on a frozen base, the base as the KL reference; the
unmerged product equals the merged model, gradients reach only the adapters, checkpoints hold
the adapters and resume exactly, the PEFT export loads in transformers with the merged
export's logits, and a run on a mesh splits the adapters by the rules."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from test_update import rollout_batch

from jgrpo import train as train_module
from jgrpo.checkpoint import Checkpointer
from jgrpo.config import ConfigError, load_config
from jgrpo.metrics import read_metrics
from jgrpo.models.config import preset
from jgrpo.models.hf import from_pretrained
from jgrpo.models.lora import (
    LoraConfig,
    adapter_axes,
    init_adapters,
    merge_adapters,
    parse_targets,
    with_adapters,
)
from jgrpo.models.transformer import Transformer, forward
from jgrpo.rollout import SamplingConfig, rollout
from jgrpo.sharding import tree_shardings
from jgrpo.tasks import Task
from jgrpo.update import UpdateConfig, completion_logprobs, init_state, make_optimizer, train_step

CONFIG = preset("tiny")


def random_adapters(config, lora, seed=1):
    """Adapters with B != 0 too (fresh ones have B = 0, which would hide a wrong product)."""
    adapters = init_adapters(config, lora, jax.random.key(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 1), 64))
    return jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape), adapters)


@pytest.mark.parametrize(
    ("family", "targets"),
    [("qwen2", "all-linear"), ("llama3", "q_proj,v_proj,o_proj"), ("qwen3", "down_proj")],
)
def test_unmerged_adapters_compute_the_merged_model(family, targets, hf_checkpoint):
    """with_adapters (x W + s (x A) B) gives the logits of merge_adapters (W + s A B), and of
    the base exactly while B = 0; on odd shapes (qkv biases, q/k norms, o's two input axes)."""
    model = from_pretrained(hf_checkpoint(family)[0])
    base, config = model.params(), model.config
    lora = LoraConfig(rank=3, alpha=5.0, targets=parse_targets(targets))
    ids = jax.random.randint(jax.random.key(0), (2, 9), 0, config.vocab_size)
    plain = forward(base, ids, config=config)
    fresh = init_adapters(config, lora, jax.random.key(2))
    assert set(fresh["layers"]) == set(lora.kernels)
    np.testing.assert_array_equal(
        forward(with_adapters(base, fresh, lora.scale), ids, config=config), plain
    )

    adapters = random_adapters(config, lora)
    unmerged = forward(with_adapters(base, adapters, lora.scale), ids, config=config)
    merged = forward(merge_adapters(base, adapters, lora.scale), ids, config=config)
    np.testing.assert_allclose(unmerged, merged, atol=2e-5, rtol=0)
    assert np.abs(np.asarray(unmerged - plain)).max() > 1e-2  # the adapters do change it


@pytest.mark.parametrize("weights_dtype", ["float32", "bfloat16"])
def test_the_rollout_merges_the_adapters_into_its_decode_layout(weights_dtype):
    """A rollout given the base and adapters (what the trainer passes: no merged copy)
    samples what a rollout of the merged model samples: the same tokens, log-probs to
    float rounding (the prefill multiplies unmerged, the decode layout holds W + s A B)."""
    base = Transformer(CONFIG, rngs=nnx.Rngs(0)).params()
    lora = LoraConfig(rank=4, alpha=8.0)
    adapters = random_adapters(CONFIG, lora)
    ids = jnp.asarray(np.random.default_rng(0).integers(3, CONFIG.vocab_size, (2, 6)), jnp.int32)
    sampling = SamplingConfig(max_new_tokens=12, stop_token_ids=(7,), weights_dtype=weights_dtype)

    def sample(params):
        return rollout(
            params,
            ids,
            jnp.ones_like(ids),
            jax.random.key(5),
            model_config=CONFIG,
            num_generations=4,
            sampling=sampling,
        )

    unmerged = sample(with_adapters(base, adapters, lora.scale))
    merged = sample(merge_adapters(base, adapters, lora.scale))
    np.testing.assert_array_equal(unmerged.tokens, merged.tokens)
    np.testing.assert_array_equal(unmerged.lengths, merged.lengths)
    # bf16: the prefill rounds W, A and B to bf16 apart, the layout W + s A B once (measured
    # up to 1.9e-3 on this model); f32: float rounding.
    tolerance = 1e-5 if weights_dtype == "float32" else 4e-3
    np.testing.assert_allclose(unmerged.logprobs, merged.logprobs, atol=tolerance, rtol=0)
    plain = sample(base)
    assert not np.array_equal(np.asarray(plain.tokens), np.asarray(merged.tokens))


def test_adapter_gradients_equal_the_merged_models_chain_rule():
    """d loss / d (A, B) through the unmerged product equals it through W + s A B (which
    differentiates the merge): the update trains the model the merge describes."""
    base = Transformer(CONFIG, rngs=nnx.Rngs(0)).params()
    lora = LoraConfig(rank=4, alpha=8.0)
    adapters = random_adapters(CONFIG, lora)
    batch, _ = rollout_batch(base)

    def loss(adapters, apply):
        logprobs, _ = completion_logprobs(
            apply(base, adapters, lora.scale),
            batch,
            model_config=CONFIG,
            temperature=1.0,
            chunk_size=64,
        )
        return (logprobs * batch.completion_mask).sum()

    unmerged = jax.grad(loss)(adapters, with_adapters)
    merged = jax.grad(loss)(adapters, merge_adapters)
    for got, want in zip(jax.tree.leaves(unmerged), jax.tree.leaves(merged), strict=True):
        scale = float(np.abs(np.asarray(want)).max())
        assert scale > 0
        np.testing.assert_allclose(got, want, atol=1e-4 * scale, rtol=0)


def test_train_step_moves_only_the_adapters_and_the_base_is_the_reference():
    """One LoRA update: the KL to the base is 0 while B = 0 (the policy is the base), the
    adapters move, the base's leaves are untouched, and ref_params are refused (the base is
    the reference)."""
    base = Transformer(CONFIG, rngs=nnx.Rngs(0)).params()
    before = jax.tree.map(np.asarray, base)
    lora = LoraConfig(rank=4, alpha=8.0)
    adapters = init_adapters(CONFIG, lora, jax.random.key(3))
    initial = jax.tree.map(np.asarray, adapters)
    batch, _ = rollout_batch(base)
    optimizer = make_optimizer(1e-2, total_steps=2)
    config = UpdateConfig(beta=0.1, num_iterations=2, lora_scale=lora.scale)
    state = init_state(adapters, optimizer)
    state, metrics = train_step(
        state, batch, None, base, model_config=CONFIG, update_config=config, optimizer=optimizer
    )
    assert float(metrics["kl_mean"][0, 0]) == 0.0  # the first step's policy is the base
    assert float(metrics["kl_mean"][1, 0]) > 0.0  # the second's has moved
    for now, then in zip(jax.tree.leaves(state.params), jax.tree.leaves(initial), strict=True):
        assert not np.array_equal(np.asarray(now), then)
    jax.tree.map(np.testing.assert_array_equal, base, before)
    with pytest.raises(ValueError, match="pass no ref_params"):
        train_step(
            init_state(adapters, optimizer),
            batch,
            base,
            base,
            model_config=CONFIG,
            update_config=config,
            optimizer=optimizer,
        )


TINY = [
    "task.max_operand=4",
    "rollout.max_prompt_length=8",
    "rollout.max_new_tokens=4",
    "rollout.prompts_per_step=8",
    "rollout.num_generations=4",
    "algorithm.beta=0.04",
    "optim.lr=1e-2",
    "train.eval_every=2",
    "train.save_every=2",
    "train.tensorboard=false",
    "train.progress=false",
    "task.reward_workers=0",
    "model.lora_rank=4",
]


def test_a_lora_run_trains_adapters_checkpoints_them_and_resumes_exactly(tmp_path, count_compiles):
    """Through the trainer: the frozen base (the model's own arrays) is bit-identical after
    the steps; the checkpoint holds only the adapters and their optimizer state, and records
    the base; 4 steps equal 2 steps resumed for 2 more, adapters and metrics; nothing compiles
    after the first evaluation and save; a checkpoint refuses a different base."""
    straight = tmp_path / "straight"
    compiles = {}
    config = load_config(
        None, [*TINY, "train.steps=4", "train.export=false", f"train.run_dir={straight}"]
    )

    def on_step(step, _):
        compiles[step] = count_compiles()

    result = train_module.train(config, on_step=on_step)
    assert compiles[4] == compiles[2]  # step 2 ran the first evaluation and save
    lines = read_metrics(straight)
    assert lines[0]["kl"] == 0.0 and lines[-1]["kl"] > 0  # the reference is the base
    assert set(result.state.params) == {"layers"}
    assert set(result.state.params["layers"]) == {
        "q_kernel",
        "k_kernel",
        "v_kernel",
        "o_kernel",
        "gate_kernel",
        "up_kernel",
        "down_kernel",
    }
    with Checkpointer(straight / "checkpoints") as checkpointer:
        meta = checkpointer.restore_meta()
    assert meta["lora_base"]["model"] == "preset tiny" and len(meta["lora_base"]["digest"]) == 16
    # The saved arrays: the adapters, and Adam's moments of them; no base weight.
    stored = json.loads((straight / "checkpoints" / "4" / "checksums" / "metadata").read_text())
    arrays = [name for name in stored["state"] if name.endswith((".a", ".b"))]
    assert len(arrays) == 3 * 14 and all(".layers." in name for name in arrays)
    assert not [name for name in stored["state"] if "embed" in name or "norm" in name]
    trainer = train_module.Trainer(config)
    trainer_base = jax.tree.map(np.asarray, trainer.model.params())

    resumed_dir = tmp_path / "resumed"
    for steps in (2, 4):
        config = load_config(
            None,
            [*TINY, f"train.steps={steps}", "train.export=false", f"train.run_dir={resumed_dir}"],
        )
        resumed = train_module.train(config)
    jax.tree.map(np.testing.assert_array_equal, resumed.state.params, result.state.params)

    def measured(line):  # everything but the clocks
        return {k: v for k, v in line.items() if not k.startswith("time/") and "per_s" not in k}

    assert [measured(line) for line in lines] == [
        measured(line) for line in read_metrics(resumed_dir)
    ]
    # The trainer's own base, bit-identical after steps that moved the adapters.
    state = trainer.initial_state(trainer.initial_params())
    base = trainer.reference_params(state.params)
    assert (
        base is not None and jax.tree.leaves(base)[0] is jax.tree.leaves(trainer.model.params())[0]
    )
    for step in range(2):
        state, metrics, _ = trainer.step(state, base, step, 0)
        assert metrics["sampler/gap"] < 1e-5  # the rollout samples the policy being trained
    jax.tree.map(np.testing.assert_array_equal, trainer.model.params(), trainer_base)
    assert float(np.abs(np.asarray(state.params["layers"]["q_kernel"]["b"])).max()) > 0

    # Any checkpoint exports to HF format, with the adapters beside it.
    exported = train_module.export_checkpoint(straight, tmp_path / "exported", step=2)
    assert (exported / "config.json").exists()
    assert (tmp_path / "exported_adapter" / "adapter_model.safetensors").exists()

    other = load_config(
        None, [*TINY, "train.steps=6", "train.seed=1", f"train.run_dir={resumed_dir}"]
    )
    with pytest.raises(ConfigError, match="trained on preset tiny"):
        train_module.train(other)  # seed 1 initialises another random base


def test_the_plan_counts_adapters_their_optimizer_state_and_the_base_once():
    """jgrpo.plan with LoRA: the trained parameters are the adapters, AdamW's state is two
    copies of them, and the frozen base is counted once, as the reference."""
    from jgrpo.plan import plan_memory
    from jgrpo.setup import Setup

    config = load_config(None, [*TINY, "mesh.devices=1", "train.run_dir=unused"])
    setup = Setup(config)
    plan = plan_memory(setup)
    adapters = sum(x.nbytes for x in jax.tree.leaves(setup.initial_params()))
    base = sum(x.nbytes for x in jax.tree.leaves(setup.model.params()))
    assert plan.parameters == adapters and plan.reference == base
    assert 2 * adapters <= plan.optimizer <= 2 * adapters + 64  # mu, nu; the step counts
    assert "(LoRA adapters, rank 4)" in plan.report() and "frozen base: no copy" in plan.report()


def test_lora_settings_are_checked():
    with pytest.raises(ConfigError, match="model.lora_targets must be some of"):
        load_config(None, ["model.lora_rank=4", "model.lora_targets=q_proj,qkv"])
    with pytest.raises(ConfigError, match="model.lora_rank must be >= 0"):
        load_config(None, ["model.lora_rank=-1"])
    with pytest.raises(ConfigError, match="model.lora_alpha must be > 0"):
        load_config(None, ["model.lora_rank=4", "model.lora_alpha=0"])
    with pytest.raises(ConfigError, match="set algorithm.ref_sync_steps=0"):
        load_config(None, ["model.lora_rank=4", "algorithm.beta=0.1", "algorithm.ref_sync_steps=5"])


def test_the_peft_export_loads_onto_the_base_with_the_merged_exports_logits(
    tmp_path, hf_checkpoint
):
    """A LoRA run from an HF checkpoint exports RUN_DIR/hf (merged) and RUN_DIR/hf_adapter
    (PEFT): peft.PeftModel on the base checkpoint gives the merged checkpoint's logits, and
    ours; the adapter config names the base and the targets."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    directory, _ = hf_checkpoint("llama3")
    run_dir = tmp_path / "run"
    examples = [{"prompt": f"w{10 + i} w{20 + i} w{30 + i}"} for i in range(8)]
    task = Task(  # the tiny checkpoint's word tokenizer: reward the word w5
        name="words",
        train=examples,
        eval=examples[:2],
        reward_fns={"w5": lambda prompts, completions, **_: [c.count("w5") for c in completions]},
        reward_weights={},
        correctness="w5",
    )
    config = load_config(
        None,
        [
            f"model.path={directory}",
            "model.lora_rank=4",
            "model.lora_alpha=8",
            "model.lora_targets=q_proj,k_proj,v_proj,o_proj,gate_proj,down_proj",
            "rollout.prompts_per_step=4",
            "rollout.num_generations=4",
            "rollout.max_new_tokens=4",
            "rollout.max_prompt_length=8",
            "optim.lr=5e-2",
            "train.steps=2",
            "train.eval_every=0",
            "train.tensorboard=false",
            "train.progress=false",
            "task.reward_workers=0",
            "mesh.devices=1",
            f"train.run_dir={run_dir}",
        ],
    )
    result = train_module.train(config, task=task)
    adapter_config = json.loads((run_dir / "hf_adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(directory)
    assert adapter_config["r"] == 4 and adapter_config["lora_alpha"] == 8
    assert "up_proj" not in adapter_config["target_modules"]

    ids = torch.tensor(np.random.default_rng(0).integers(3, 90, (2, 11)))
    base = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    with torch.no_grad():
        plain = base(ids).logits.numpy()
        peft_logits = PeftModel.from_pretrained(base, run_dir / "hf_adapter")(ids).logits.numpy()
        merged_model = AutoModelForCausalLM.from_pretrained(
            run_dir / "hf", torch_dtype=torch.float32
        )
        merged = merged_model(ids).logits.numpy()
    assert np.abs(peft_logits - plain).max() > 1e-3  # the adapters trained
    np.testing.assert_allclose(peft_logits, merged, atol=1e-4, rtol=0)
    trainer = train_module.Trainer(config, task)
    ours = forward(
        with_adapters(trainer.model.params(), result.state.params, 2.0),
        jnp.asarray(ids.numpy()),
        config=trainer.model_config,
    )
    np.testing.assert_allclose(ours, merged, atol=1e-4, rtol=0)


def test_a_lora_run_on_a_mesh_matches_one_device_and_splits_the_adapters(tmp_path):
    """Two LoRA steps on fsdp=4 x tensor=2 and on one device: the same rewards and nearly
    the same adapters; adapters and their Adam moments split by the rules (A's input axes and
    B's output axes as the kernel's, the rank replicated); a bf16 base (model.reference_dtype)
    placed as the parameters it rounds."""
    common = [*TINY, "train.steps=2", "train.eval_every=0", "train.export=false", "optim.eps=1e-6"]
    runs = {}
    for name, mesh in [("one", ["mesh.devices=1"]), ("mesh", ["mesh.fsdp=4", "mesh.tensor=2"])]:
        config = load_config(None, [*common, *mesh, f"train.run_dir={tmp_path / name}"])
        runs[name] = train_module.train(config)
    for a, b in zip(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "mesh"), strict=True):
        assert a["reward/mean"] == b["reward/mean"]
        np.testing.assert_allclose(a["loss"], b["loss"], atol=1e-6)
    one, sharded = runs["one"].state, runs["mesh"].state
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(sharded.params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)

    trainer = train_module.Trainer(
        load_config(
            None, [*common, "mesh.fsdp=4", "mesh.tensor=2", "model.reference_dtype=bfloat16"]
        )
    )
    expected = tree_shardings(
        sharded.params, adapter_axes(trainer.model_config, trainer.lora), trainer.mesh
    )
    jax.tree.map(lambda array, sharding: assert_placed(array, sharding), sharded.params, expected)
    q = sharded.params["layers"]["q_kernel"]
    assert q["a"].sharding.shard_shape(q["a"].shape)[1] == q["a"].shape[1] // 4  # embed / fsdp
    assert q["b"].sharding.shard_shape(q["b"].shape)[2] == q["b"].shape[2] // 2  # heads / tensor
    base = trainer.model.params()
    assert (
        base["layers"]["q_kernel"].dtype == jnp.bfloat16
        and base["layers"]["attn_norm"].dtype == jnp.float32
    )
    jax.tree.map(assert_placed, base, trainer.model_shardings)
    state = trainer.initial_state(trainer.initial_params())
    state, metrics, _ = trainer.step(state, trainer.reference_params(state.params), 0, 0)
    assert metrics["kl"] == 0.0 and np.isfinite(metrics["loss"])


def assert_placed(array, sharding):
    assert array.sharding.is_equivalent_to(sharding, array.ndim), (array.sharding, sharding)
