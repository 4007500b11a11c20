"""Sharding over a (data, fsdp, tensor) mesh of 8 host CPU devices: the same numbers as one
device, and every array placed as the rules table says."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from jgrpo import models
from jgrpo.losses import grpo_loss
from jgrpo.metrics import read_metrics
from jgrpo.rollout import SamplingConfig, rollout
from jgrpo.sharding import (
    MeshError,
    logical_spec,
    make_mesh,
    optimizer_state_shardings,
    resolve_mesh_shape,
    rules_context,
    tree_shardings,
)
from jgrpo.update import (
    Batch,
    UpdateConfig,
    completion_logprobs,
    init_state,
    make_optimizer,
    train_step,
)

# Dimensions that 8 divides where the rules split them (kv heads: 4, so tensor = 8 keeps
# them whole on each device, the case the rules must handle).
CONFIG = models.preset("tiny").replace(
    vocab_size=64, num_heads=8, num_kv_heads=4, head_dim=8, intermediate_size=128
)
MESHES = [(8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 2, 2), (1, 4, 2)]
PROMPTS, GROUP, PROMPT_LENGTH, NEW_TOKENS = 8, 2, 8, 8
SGD = optax.sgd(0.5)  # parameter differences stay proportional to gradient differences
UPDATE = UpdateConfig(beta=0.0)
# f32 sums split over devices add in another order: measured differences are ~1e-7.
TOLERANCE = dict(atol=2e-6, rtol=2e-5)


def test_resolve_mesh_shape():
    assert resolve_mesh_shape((1, -1, 1), 8) == (1, 8, 1)
    assert resolve_mesh_shape((2, -1, 2), 8) == (2, 2, 2)
    assert resolve_mesh_shape((2, 2, 2), 8) == (2, 2, 2)
    with pytest.raises(MeshError, match="at most one mesh size may be -1"):
        resolve_mesh_shape((-1, -1, 1), 8)
    with pytest.raises(MeshError, match="has 4 devices but 8 are available"):
        resolve_mesh_shape((2, 2, 1), 8)
    with pytest.raises(MeshError, match="no whole size for the -1 axis"):
        resolve_mesh_shape((3, -1, 1), 8)
    with pytest.raises(MeshError, match="mesh.tensor must be >= 1 or -1"):
        resolve_mesh_shape((1, -1, 0), 8)


def test_rules_place_each_parameter():
    mesh = make_mesh((2, 2, 2))
    axes = models.transformer.param_axes(CONFIG)
    specs = {
        "q_kernel": PartitionSpec(None, "fsdp", "tensor", None),  # [L, E, H, D]
        "k_kernel": PartitionSpec(None, "fsdp", "tensor", None),  # [L, E, K, D]
        "o_kernel": PartitionSpec(None, "tensor", None, "fsdp"),  # [L, H, D, E]
        "gate_kernel": PartitionSpec(None, "fsdp", "tensor"),  # [L, E, M]
        "down_kernel": PartitionSpec(None, "tensor", "fsdp"),  # [L, M, E]
        "attn_norm": PartitionSpec(None, "fsdp"),  # [L, E]
    }
    params = models.Transformer(CONFIG, rngs=nnx.Rngs(0)).params()
    for name, expected in specs.items():
        shape = params["layers"][name].shape
        assert logical_spec(shape, axes["layers"][name], mesh) == expected, name
    assert logical_spec((64, 64), axes["embed"], mesh) == PartitionSpec("tensor", "fsdp")
    # Activations: the batch takes data and fsdp, so embed cannot take fsdp again.
    batch_axes = ("batch", "length", "embed")
    assert logical_spec((16, 8, 64), batch_axes, mesh) == PartitionSpec(
        ("data", "fsdp"), None, None
    )
    # A dimension the mesh axis does not divide stays whole: 4 kv heads over tensor = 8.
    wide = make_mesh((1, 1, 8))
    assert logical_spec((2, 64, 4, 8), axes["layers"]["k_kernel"], wide) == PartitionSpec(
        None, None, None, None
    )
    assert logical_spec((2, 64, 8, 8), axes["layers"]["q_kernel"], wide) == PartitionSpec(
        None, None, "tensor", None
    )
    # Experts [L, X, E, M]: whole experts over fsdp (expert parallelism), mlp over tensor;
    # experts that fsdp does not divide leave it to embed, as a dense MLP's weights.
    experts = ("layers", "expert", "embed", "mlp")
    assert logical_spec((2, 8, 64, 32), experts, mesh) == PartitionSpec(
        None, "fsdp", None, "tensor"
    )
    assert logical_spec((2, 3, 64, 32), experts, mesh) == PartitionSpec(
        None, None, "fsdp", "tensor"
    )
    assert logical_spec((64, 8), ("embed", "expert"), mesh) == PartitionSpec(None, "fsdp")


@functools.cache
def reference():
    """Parameters, a batch, and their single-device loss, grads, step and greedy rollout."""
    params = models.Transformer(CONFIG, rngs=nnx.Rngs(0)).params()
    rng = np.random.default_rng(0)
    rows = PROMPTS * GROUP
    prompt_ids = rng.integers(3, CONFIG.vocab_size, (PROMPTS, PROMPT_LENGTH)).astype(np.int32)
    prompt_mask = np.ones_like(prompt_ids)
    prompt_mask[1, :3] = 0  # left padding
    completion = rng.integers(3, CONFIG.vocab_size, (rows, NEW_TOKENS)).astype(np.int32)
    completion_mask = np.arange(NEW_TOKENS)[None] < rng.integers(2, NEW_TOKENS + 1, (rows, 1))
    batch = Batch(
        input_ids=np.concatenate([np.repeat(prompt_ids, GROUP, 0), completion], 1),
        attention_mask=np.concatenate(
            [np.repeat(prompt_mask, GROUP, 0), completion_mask.astype(np.int32)], 1
        ),
        completion_mask=completion_mask,
        advantages=rng.normal(size=rows).astype(np.float32),
    )
    result = {"params": params, "batch": batch, "prompts": (prompt_ids, prompt_mask)}
    result["loss"], result["grads"] = loss_and_grads(params, jax.tree.map(jnp.asarray, batch))
    result["stepped"], result["step_loss"] = sgd_step(params, jax.tree.map(jnp.asarray, batch))
    result["greedy"] = greedy(params, *map(jnp.asarray, result["prompts"]))
    return jax.tree.map(np.asarray, result)


def sgd_update(params, batch, update_config=UPDATE):
    """One train_step with SGD from a copy of `params`: (new state, metrics)."""
    return train_step(
        init_state(jax.tree.map(jnp.copy, params), SGD),
        batch,
        model_config=CONFIG,
        update_config=update_config,
        optimizer=SGD,
    )


def sgd_step(params, batch, update_config=UPDATE):
    """`sgd_update`'s (new parameters, loss)."""
    state, metrics = sgd_update(params, batch, update_config)
    return state.params, metrics["loss"]


@jax.jit
def loss_and_grads(params, batch):
    def loss(params):
        logprobs, _ = completion_logprobs(  # logits recomputed: train_step's tests keep them
            params, batch, model_config=CONFIG, temperature=1.0, chunk_size=32, keep_logits_mib=0
        )
        value, _ = grpo_loss(
            logprobs,
            jax.lax.stop_gradient(logprobs),
            batch.advantages,
            batch.completion_mask,
            beta=0.0,
        )
        return value

    return jax.value_and_grad(loss)(params)


def greedy(params, prompt_ids, prompt_mask):
    return rollout(
        params,
        prompt_ids,
        prompt_mask,
        jax.random.key(0),
        model_config=CONFIG,
        num_generations=GROUP,
        sampling=SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=0.0),
    ).tokens


def batch_shardings(batch, mesh):
    axes = jax.tree.map(lambda x: ("batch",) + (None,) * (np.ndim(x) - 1), batch)
    return tree_shardings(batch, axes, mesh)


def placed(expected, mesh):
    """The reference parameters and batch on the mesh as the rules place them, and the
    parameters' shardings."""
    param_shardings = tree_shardings(
        expected["params"], models.transformer.param_axes(CONFIG), mesh
    )
    params = jax.device_put(expected["params"], param_shardings)
    batch = jax.device_put(expected["batch"], batch_shardings(expected["batch"], mesh))
    return params, batch, param_shardings


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_sharded_loss_grads_step_and_rollout_equal_one_device(shape):
    expected = reference()
    mesh = make_mesh(shape)
    params, batch, param_shardings = placed(expected, mesh)
    prompt_sharding = tree_shardings(expected["prompts"], (("batch", None),) * 2, mesh)
    prompts = jax.device_put(expected["prompts"], prompt_sharding)

    with rules_context(mesh):
        loss, grads = loss_and_grads(params, batch)
        stepped, step_loss = sgd_step(params, batch)
        tokens = greedy(params, *prompts)

    np.testing.assert_allclose(loss, expected["loss"], **TOLERANCE)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, **TOLERANCE), grads, expected["grads"]
    )
    np.testing.assert_allclose(step_loss, expected["step_loss"], **TOLERANCE)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, **TOLERANCE), stepped, expected["stepped"]
    )
    np.testing.assert_array_equal(tokens, expected["greedy"])
    # The stepped parameters keep the rules' placement (nothing gathered onto every device).
    jax.tree.map(lambda array, sharding: _assert_placed(array, sharding), stepped, param_shardings)


@pytest.mark.parametrize("shape", [(1, 8, 1), (2, 2, 2), (1, 4, 2)], ids=str)
def test_bf16_matmul_update_on_a_mesh_equals_one_device(shape):
    """Mixed precision (matmul_dtype="bfloat16") partitions like f32: the rounded operands
    are the same on any mesh, so only the f32 sums' order differs."""
    expected = reference()
    update = UpdateConfig(beta=0.0, matmul_dtype="bfloat16")
    one_device = sgd_step(expected["params"], jax.tree.map(jnp.asarray, expected["batch"]), update)
    mesh = make_mesh(shape)
    params, batch, _ = placed(expected, mesh)
    with rules_context(mesh):
        sharded = sgd_step(params, batch, update)
    np.testing.assert_allclose(sharded[1], one_device[1], **TOLERANCE)  # the loss
    # Another order of f32 sums can flip the bf16 rounding of a cotangent or a gradient:
    # each tensor's update stays within one bf16 step (2^-8) of the one-device update's
    # norm (measured <= 0.0013), closer than the f32 update is (about 0.005).
    for name in ("embed", "lm_head"):
        check_update_close(sharded[0][name], one_device[0][name], expected["params"][name])
    for name, initial in expected["params"]["layers"].items():
        check_update_close(sharded[0]["layers"][name], one_device[0]["layers"][name], initial)
    f32_update = expected["stepped"]["layers"]["up_kernel"]
    assert np.abs(one_device[0]["layers"]["up_kernel"] - f32_update).max() > 1e-6  # bf16 ran


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 8, 1)], ids=str)
def test_token_and_row_masks_on_a_mesh_equal_one_device(shape):
    """top_entropy_quantile's quantile and off_policy_mask_threshold's row means span the
    whole micro-batch, which the mesh splits over devices: the same update as one device."""
    expected = reference()
    one_device_batch = jax.tree.map(jnp.asarray, expected["batch"])
    logprobs, _ = completion_logprobs(
        expected["params"], one_device_batch, model_config=CONFIG, temperature=1.0, chunk_size=32
    )
    drifted = jnp.arange(PROMPTS * GROUP)[:, None] % 3 == 0  # [B, 1]: a third of the rows
    batch = one_device_batch._replace(sampler_logprobs=logprobs + 1.0 * drifted)
    update = UpdateConfig(
        beta=0.0, dual_clip=3.0, top_entropy_quantile=0.5, off_policy_mask_threshold=0.5
    )
    state, metrics = sgd_update(expected["params"], batch, update)
    negative = np.asarray(batch.advantages) < 0
    masked = (negative & np.asarray(drifted[:, 0])).mean()  # every row has completion tokens
    assert masked > 0
    np.testing.assert_allclose(metrics["off_policy_masked_frac"], masked, rtol=1e-6)
    mesh = make_mesh(shape)
    params, _, _ = placed(expected, mesh)
    sharded_batch = jax.device_put(batch, batch_shardings(batch, mesh))
    with rules_context(mesh):
        sharded_state, sharded_metrics = sgd_update(params, sharded_batch, update)
    for name in ("loss", "off_policy_masked_frac", "entropy"):
        np.testing.assert_allclose(sharded_metrics[name], metrics[name], **TOLERANCE)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, **TOLERANCE),
        sharded_state.params,
        state.params,
    )
    # The masks took effect: not the plain update's parameters.
    assert np.abs(state.params["lm_head"] - expected["stepped"]["lm_head"]).max() > 1e-4


def test_kept_logits_are_budgeted_per_device():
    """keep_logits_mib budgets one device's share of the log-prob logits: on a mesh their rows
    split over data x fsdp, so a budget below the whole micro-batch's logits but above one
    device's share keeps them there and recomputes them on one device. The kept logits take
    their share of each device's temporary memory (compiled memory analysis)."""
    config = models.preset("tiny").replace(vocab_size=4096)
    params = models.Transformer(config, rngs=nnx.Rngs(0)).params()
    rows, prompt_length, new_tokens = 16, 8, 64
    ids = np.random.default_rng(0).integers(3, 4096, (rows, prompt_length + new_tokens))
    batch = Batch(
        input_ids=jnp.asarray(ids, jnp.int32),
        attention_mask=jnp.ones(ids.shape, jnp.int32),
        completion_mask=jnp.ones((rows, new_tokens), jnp.float32),
        advantages=jnp.zeros((rows,), jnp.float32),
    )
    logits_mib = rows * new_tokens * 4096 * 4 / 2**20  # 16 MiB for the micro-batch

    def temp_mib(budget_mib, mesh=None):
        def loss(params, batch):
            logprobs, _ = completion_logprobs(
                params,
                batch,
                model_config=config,
                temperature=1.0,
                chunk_size=1024,
                keep_logits_mib=budget_mib,
            )
            return logprobs.sum()

        program = jax.jit(jax.grad(loss))
        if mesh is None:
            compiled = program.lower(params, batch).compile()
        else:
            with rules_context(mesh):
                row_split = tree_shardings(batch, Batch(*[("batch", None)] * 3, ("batch",)), mesh)
                compiled = program.lower(params, jax.device_put(batch, row_split)).compile()
        return compiled.memory_analysis().temp_size_in_bytes / 2**20

    mesh = make_mesh((2, 2, 2))  # the rows split over data x fsdp = 4 devices: 4 MiB each
    between = logits_mib / 2
    on_mesh = {budget: temp_mib(budget, mesh) for budget in (0, between, 2 * logits_mib)}
    assert on_mesh[between] == on_mesh[2 * logits_mib]  # kept
    assert on_mesh[between] - on_mesh[0] == pytest.approx(logits_mib / 4, rel=0.05)
    one_device = {budget: temp_mib(budget) for budget in (0, between, 2 * logits_mib)}
    assert one_device[between] == one_device[0]  # recomputed
    assert one_device[2 * logits_mib] - one_device[0] == pytest.approx(logits_mib, rel=0.05)


def check_update_close(got, expected, initial):
    update_norm = np.linalg.norm(np.asarray(expected) - initial)
    assert np.linalg.norm(np.asarray(got) - np.asarray(expected)) <= 2**-8 * update_norm


def _assert_placed(array, sharding):
    assert array.sharding.is_equivalent_to(sharding, array.ndim), (array.sharding, sharding)


@pytest.mark.parametrize("shape", [(1, 8, 1), (2, 2, 2), (1, 4, 2)])
def test_parameters_and_optimizer_state_are_sharded_not_replicated(shape):
    """With fsdp or tensor > 1, every matrix is split: no large array silently replicated."""
    mesh = make_mesh(shape)
    params = reference()["params"]
    param_shardings = tree_shardings(params, models.transformer.param_axes(CONFIG), mesh)
    optimizer = make_optimizer(1e-3, total_steps=10)
    abstract = jax.eval_shape(optimizer.init, params)
    opt_shardings = optimizer_state_shardings(optimizer, abstract, param_shardings, mesh)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(
        jax.device_put(params, param_shardings)
    )
    matrices = 0
    for array in jax.tree.leaves(opt_state) + jax.tree.leaves(
        jax.device_put(params, param_shardings)
    ):
        if array.ndim >= 2:
            matrices += 1
            shard = array.sharding.shard_shape(array.shape)
            assert np.prod(shard) < np.prod(array.shape), (array.shape, array.sharding)
        else:
            assert array.size <= CONFIG.num_layers * CONFIG.hidden_size
    assert matrices >= 3 * 10  # params, Adam's mu and nu


def test_training_on_a_mesh_matches_one_device_and_keeps_the_placement(tmp_path):
    """Two GRPO steps (with a reference model, beta > 0) on a fsdp=4 x tensor=2 mesh: the
    same rewards and nearly the same parameters as on one device; parameters, Adam's moments
    and the reference (a bf16 one too) placed by the rules."""
    from jgrpo.config import load_config
    from jgrpo.train import Trainer, train

    common = [
        "task.max_operand=4",
        "rollout.prompts_per_step=8",
        "rollout.num_generations=4",
        "rollout.max_new_tokens=4",
        "rollout.max_prompt_length=8",
        "algorithm.beta=0.04",
        "optim.lr=1e-3",
        "optim.eps=1e-6",  # see below
        "train.steps=2",
        "train.eval_every=0",
        "train.export=false",
        "train.tensorboard=false",
        "train.progress=false",
        "task.reward_workers=0",
    ]
    runs = {}
    for name, mesh in [("one", ["mesh.devices=1"]), ("mesh", ["mesh.fsdp=4", "mesh.tensor=2"])]:
        config = load_config(None, [*common, *mesh, f"train.run_dir={tmp_path / name}"])
        runs[name] = train(config)
    one, sharded = runs["one"].state, runs["mesh"].state

    lines = {name: read_metrics(tmp_path / name) for name in runs}
    for a, b in zip(lines["one"], lines["mesh"], strict=True):
        assert a["reward/mean"] == b["reward/mean"]  # the same completions were sampled
        np.testing.assert_allclose(a["loss"], b["loss"], atol=1e-6)
    # Two AdamW steps move each parameter by up to 2e-3. Sums split over devices differ in
    # their last bits, and Adam's g / (|g| + eps) turns that into a difference of up to lr
    # where |g| is near eps: with the default eps 1e-8 one v_kernel entry differed by 5.8e-5
    # after one step. eps = 1e-6 bounds that to lr * |dg| / eps: measured 2.4e-6 at most
    # (on 2 CPUs; the bound leaves 4x). Gradients themselves are compared tightly above.
    difference = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(sharded.params), strict=True)
    )
    assert difference < 1e-5

    trainer = Trainer(load_config(None, [*common, "mesh.fsdp=4", "mesh.tensor=2"]))
    mesh = trainer.mesh
    expected = tree_shardings(
        sharded.params, models.transformer.param_axes(trainer.model_config), mesh
    )
    jax.tree.map(_assert_placed, sharded.params, expected)
    adam = [s for s in jax.tree.leaves(sharded.opt_state) if getattr(s, "ndim", 0) >= 2]
    assert adam and all(np.prod(a.sharding.shard_shape(a.shape)) < np.prod(a.shape) for a in adam)
    jax.tree.map(_assert_placed, trainer.reference_params(trainer.initial_params()), expected)
    # A bf16 reference (model.reference_dtype) is split as the parameters it rounds, and the
    # update on the mesh takes it: one step, the KL above 0 by the rounding alone.
    bf16_trainer = Trainer(
        load_config(
            None, [*common, "mesh.fsdp=4", "mesh.tensor=2", "model.reference_dtype=bfloat16"]
        )
    )
    params = bf16_trainer.initial_params()
    rounded = bf16_trainer.reference_params(params)
    assert rounded["embed"].dtype == jnp.bfloat16
    jax.tree.map(_assert_placed, rounded, expected)
    _, metrics, _ = bf16_trainer.step(bf16_trainer.initial_state(params), rounded, 0, 0)
    assert 0 < metrics["kl"] < 1e-4

    # The one-device run resumes on the 4 x 2 mesh: its checkpoint restores into the shards.
    resumed = train(
        load_config(
            None,
            [
                *common,
                "train.steps=3",
                "mesh.fsdp=4",
                "mesh.tensor=2",
                f"train.run_dir={tmp_path / 'one'}",
            ],
        )
    )
    assert resumed.steps_done == 3 and len(read_metrics(tmp_path / "one")) == 3
    jax.tree.map(_assert_placed, resumed.state.params, expected)


def test_a_checkpoint_loads_straight_into_its_shards(hf_checkpoint):
    """from_pretrained with shardings: every parameter arrives split as the rules say, with
    the values of an ordinary load."""
    from jgrpo.models.hf import from_pretrained, read_config

    directory = hf_checkpoint("qwen3")[0]
    mesh = make_mesh((2, 2, 2))
    config = read_config(directory)
    plain = from_pretrained(directory).params()
    shardings = tree_shardings(plain, models.transformer.param_axes(config), mesh)
    sharded = from_pretrained(directory, shardings=shardings).params()
    jax.tree.map(_assert_placed, sharded, shardings)
    jax.tree.map(np.testing.assert_array_equal, sharded, plain)
    q = sharded["layers"]["q_kernel"]  # [L, E, H, D] split over fsdp (E) and tensor (H)
    assert q.sharding.shard_shape(q.shape) == (
        q.shape[0],
        q.shape[1] // 2,
        q.shape[2] // 2,
        q.shape[3],
    )
