"""Mixture-of-experts models (Qwen3-MoE) through the trainer: on a mesh as on one device,
exported to transformers, planned, and LoRA's targets on them. (Logit, decode and gradient
parity with transformers: the family tests of test_transformer, test_group_decode and
test_group_forward, which include a tiny Qwen3-MoE.)"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from tiny_hf import save_char_checkpoint
from transformers import AutoModelForCausalLM

from jgrpo.config import ConfigError, load_config
from jgrpo.metrics import read_metrics
from jgrpo.models.config import ModelConfig
from jgrpo.models.group_forward import group_completion_hidden
from jgrpo.models.hf import from_pretrained
from jgrpo.models.mlp import load_balancing_loss, mixture_of_experts
from jgrpo.models.transformer import forward, layer_param_specs
from jgrpo.packing import completion_lengths, pack_completions, rows_needed
from jgrpo.setup import Setup
from jgrpo.sharding import (
    abstract_arrays,
    logical_sharding,
    make_mesh,
    rules_context,
    tree_shardings,
)
from jgrpo.train import train
from jgrpo.update import UpdateConfig, init_state, train_step

COMMON = [
    "task.max_operand=4",
    "rollout.prompts_per_step=8",
    "rollout.num_generations=4",
    "rollout.max_new_tokens=4",
    "rollout.max_prompt_length=64",
    "algorithm.beta=0.04",
    "algorithm.router_aux_loss_coef=0.001",
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
    """Two GRPO steps of a tiny Qwen3-MoE (with the load-balancing loss) on fsdp=4 x
    tensor=2 (its 4 experts one per fsdp device, each expert's MLP split over tensor): the
    same rewards, losses, routing metrics and nearly the same parameters as on one device;
    the export loads in transformers with our logits."""
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
        for name in ("moe/aux_loss", "moe/expert_load_max", "moe/expert_load_min"):
            np.testing.assert_allclose(a[name], b[name], rtol=1e-5, err_msg=name)
    one, sharded = runs["one"].state.params, runs["mesh"].state.params
    assert one["layers"]["expert_gate_kernel"].shape == (2, 4, 64, 32)  # [L, X, E, M]
    placement = sharded["layers"]["expert_gate_kernel"].sharding.spec
    assert tuple(placement) == (None, "fsdp", None, "tensor")  # whole experts per device
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


def test_the_load_balancing_loss_equals_transformers(hf_checkpoint):
    """transformers' aux_loss (output_router_logits) of a left-padded batch: the padding
    weighs nothing, every layer's tokens count."""
    directory, torch_model = hf_checkpoint("qwen3_moe")
    model = from_pretrained(directory)
    ids = np.random.default_rng(0).integers(3, 97, size=(2, 11))
    mask = np.ones((2, 11), np.int64)
    mask[1, :4] = 0
    with torch.no_grad():
        expected = torch_model(
            torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(np.maximum(mask.cumsum(-1) - 1, 0)),
            output_router_logits=True,
        ).aux_loss
    _, stats = forward(
        model.params(),
        jnp.asarray(ids),
        attention_mask=jnp.asarray(mask),
        config=model.config,
        return_hidden=True,
        return_router_stats=True,
    )
    assert float(stats.tokens) == mask.sum() * model.config.num_layers
    assert float(stats.counts.sum()) == mask.sum() * model.config.num_layers * 2  # k = 2
    np.testing.assert_allclose(load_balancing_loss(stats), float(expected), rtol=1e-5)
    assert float(expected) > 2.0  # not the balanced minimum (k): the test can tell them apart


def test_the_group_forward_routes_as_the_plain_forward(hf_checkpoint):
    """The shared-prompt and packed forwards count a prompt token G times, as the plain
    forward does, and no padding: the same router stats."""
    from test_group_forward import GROUP, NEW_TOKENS, PROMPT_LENGTH, group_batch

    model = from_pretrained(hf_checkpoint("qwen3_moe")[0])
    params, config = model.params(), model.config
    batch = group_batch(seed=3)
    _, expected = forward(
        params,
        batch.input_ids,
        attention_mask=batch.attention_mask,
        config=config,
        return_hidden=True,
        return_router_stats=True,
    )
    lengths = completion_lengths(np.asarray(batch.completion_mask))
    packed = pack_completions(
        lengths,
        group_size=GROUP,
        width=NEW_TOKENS,
        rows_per_group=rows_needed(lengths, GROUP, NEW_TOKENS),
        prompt_length=PROMPT_LENGTH,
    )
    for packing in (None, jax.tree.map(jnp.asarray, packed)):
        _, got = group_completion_hidden(
            params,
            batch.input_ids,
            batch.attention_mask,
            config=config,
            group_size=GROUP,
            completion_length=NEW_TOKENS,
            packed=packing,
            router_stats=True,
        )
        for name in ("counts", "probabilities", "tokens"):
            np.testing.assert_allclose(
                getattr(got, name), getattr(expected, name), rtol=1e-5, err_msg=name
            )


def test_the_update_adds_the_weighted_load_balancing_loss(hf_checkpoint):
    """With router_aux_loss_coef c and plain SGD, the parameters move by c times the
    auxiliary loss's gradient more than without it (the routers, and what their inputs depend
    on); the routing metrics are logged either way."""
    from test_group_forward import group_batch

    model = from_pretrained(hf_checkpoint("qwen3_moe")[0])
    params, config = model.params(), model.config
    batch = group_batch(seed=4)
    sgd = optax.sgd(1.0)

    def step(coef):
        state = init_state(jax.tree.map(jnp.copy, params), sgd)
        update = UpdateConfig(router_aux_loss_coef=coef, shared_prompt_rows=4)
        return train_step(
            state, batch, None, model_config=config, update_config=update, optimizer=sgd
        )

    (with_aux, metrics), (without, plain_metrics) = step(0.5), step(0.0)

    def aux(p):
        _, stats = forward(
            p,
            batch.input_ids,
            attention_mask=batch.attention_mask,
            config=config,
            return_hidden=True,
            return_router_stats=True,
        )
        return load_balancing_loss(stats)

    gradient = jax.grad(aux)(params)
    moved = jax.tree.map(lambda a, b: a - b, with_aux.params, without.params)
    assert np.abs(np.asarray(gradient["layers"]["router"])).max() > 1e-4
    # every parameter the routers' inputs depend on moves too (earlier layers, embeddings)
    for (path, got), expected in zip(
        jax.tree_util.tree_leaves_with_path(moved), jax.tree.leaves(gradient), strict=True
    ):
        scale = float(np.abs(np.asarray(expected)).max())
        np.testing.assert_allclose(
            got, -0.5 * np.asarray(expected), atol=1e-5 * scale + 1e-7, rtol=0, err_msg=str(path)
        )
    np.testing.assert_allclose(metrics["moe_aux_loss"], aux(params), rtol=1e-5)
    assert metrics["moe_expert_load_max"] >= 1.0 >= metrics["moe_expert_load_min"]
    assert {"moe_aux_loss", "moe_expert_load_max"} <= plain_metrics.keys()


def test_the_plan_counts_every_experts_weights(moe_checkpoint):
    """`jgrpo.plan` holds all X experts' weights (and Adam's moments of them), not the k a
    token uses: the parameter count transformers gives the model."""
    from jgrpo.plan import plan_memory
    from jgrpo.train import Trainer

    trainer = Trainer(
        load_config(None, [*COMMON, "mesh.devices=1", f"model.path={moe_checkpoint}"])
    )
    config = trainer.model_config
    plan = plan_memory(trainer)
    assert config.num_experts == 4
    assert plan.parameters == config.num_params * 4  # f32
    assert 2 * plan.parameters <= plan.optimizer <= 2 * plan.parameters + 64


def moe_layer(experts: int) -> tuple[ModelConfig, dict]:
    """A Qwen3-MoE layer's config and random router and expert weights (E 32, M 24, k 2)."""
    config = ModelConfig(
        model_type="qwen3_moe",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        num_experts=experts,
        experts_per_token=2,
        moe_intermediate_size=24,
        norm_topk_prob=True,
    )
    specs = layer_param_specs(config)
    keys = iter(jax.random.split(jax.random.key(experts), 4))
    params = {
        name: 0.3 * jax.random.normal(next(keys), specs[name][0])
        for name in ("router", "expert_gate_kernel", "expert_up_kernel", "expert_down_kernel")
    }
    return config, params


def layer_shardings(config, params, mesh):
    """The rules' shardings of `moe_layer`'s weights on `mesh`."""
    axes = {name: layer_param_specs(config)[name][1] for name in params}
    return tree_shardings(params, axes, mesh)


@pytest.mark.parametrize(
    ("shape", "experts", "rows"),
    [
        ((1, 4, 2), 8, 8),  # whole experts over fsdp, tokens gathered to them; mlp over tensor
        ((2, 2, 2), 8, 8),  # the same within each data replica
        ((1, 8, 1), 8, 3),  # 18 tokens that fsdp does not divide: copies summed
        ((1, 1, 8), 8, 3),  # tensor alone
        ((1, 4, 2), 3, 8),  # 3 experts: split by embed as a dense MLP, gathered
        ((1, 8, 1), 3, 3),
    ],
)
def test_experts_on_a_mesh_compute_what_one_device_computes(shape, experts, rows):
    """One MoE layer's outputs, router stats and gradients (weights and activations) on a
    (data, fsdp, tensor) mesh equal one device's: 8 experts (whole experts over fsdp:
    tokens gathered to them and their outputs scattered back, or, when fsdp does not divide
    the rows x 6 tokens, each device's experts take their share of every token) and 3 (no
    mesh axis divides them: split as a dense MLP is)."""
    config, params = moe_layer(experts)

    def objective(params, h, weights):
        out, stats = mixture_of_experts(config, params, h, weights)
        probed = jnp.sum(out * jnp.cos(h)) + stats.probabilities @ jnp.arange(experts)
        return probed, (out, stats)

    derivative = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))
    rng = np.random.default_rng(experts)
    h = jnp.asarray(rng.normal(size=(rows, 6, 32)), jnp.float32)
    weights = jnp.asarray(rng.random((rows, 6)) > 0.3, jnp.float32)  # padding weighs 0
    (_, (out, stats)), grads = derivative(params, h, weights)
    mesh = make_mesh(shape)
    with rules_context(mesh):
        placed = jax.device_put(params, layer_shardings(config, params, mesh))
        (_, (mesh_out, mesh_stats)), mesh_grads = derivative(placed, h, weights)
    # the experts' outputs summed in another order: f32 rounding of values up to ~10
    np.testing.assert_allclose(mesh_out, out, atol=2e-6, rtol=2e-6)
    for got, want in zip(mesh_stats, stats, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(mesh_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    assert float(jnp.abs(out).max()) > 0.1 and float(stats.tokens) == weights.sum()


def test_expert_parallelism_moves_tokens_not_the_experts_weights():
    """On fsdp=4 x tensor=2, the compiled forward and backward of a layer of 8 experts
    all-gather only activations and the router (2-D arrays), never an expert's weights;
    with 3 experts (split by embed over fsdp) it gathers the expert weights as FSDP does."""
    mesh = make_mesh((1, 4, 2))
    gathered = {}
    for experts in (8, 3):
        config, params = moe_layer(experts)

        def squared(params, h, config=config):
            return jnp.sum(mixture_of_experts(config, params, h)[0] ** 2)

        with rules_context(mesh):
            placed = abstract_arrays(params, layer_shardings(config, params, mesh))
            h = jax.ShapeDtypeStruct(
                (8, 6, 32),
                jnp.float32,
                sharding=logical_sharding((8, 6, 32), ("batch", "length", "embed"), mesh),
            )
            program = jax.jit(jax.grad(squared)).lower(placed, h).compile().as_text()
        results = re.findall(r"= (\w+\[[\d,]*\])\S* all-gather(?:-start)?\(", program)
        gathered[experts] = [shape for shape in results if shape.count(",") == 2]  # 3-D
        assert results, "the tokens are gathered to their experts"
    assert gathered[8] == []
    assert sorted(gathered[3]) == ["f32[3,12,32]", "f32[3,32,12]", "f32[3,32,12]"]
