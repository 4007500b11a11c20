"""The shared-prompt training forward: each prompt once per group, equal to the plain forward."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiny_hf import FAMILIES, VOCAB

from jgrpo.update import Batch, UpdateConfig, init_state, train_step
from models.group_forward import group_completion_hidden
from models.hf import from_pretrained
from models.transformer import forward

PROMPTS, GROUP, PROMPT_LENGTH, NEW_TOKENS = 3, 4, 7, 5


def group_batch(seed=0, vocab=VOCAB):
    """Prompt-major rows: 3 prompts (left-padded to 7, one of a single token) x 4 completions,
    each stopping after 1-5 tokens (later slots masked, as a rollout leaves them)."""
    rng = np.random.default_rng(seed)
    rows = PROMPTS * GROUP
    prompt_ids = rng.integers(3, vocab, (PROMPTS, PROMPT_LENGTH))
    prompt_lengths = np.array([7, 4, 1])
    prompt_mask = np.arange(PROMPT_LENGTH)[None] >= PROMPT_LENGTH - prompt_lengths[:, None]
    prompt_ids = np.where(prompt_mask, prompt_ids, 0)
    completion_ids = rng.integers(3, vocab, (rows, NEW_TOKENS))
    completion_mask = np.arange(NEW_TOKENS)[None] < rng.integers(1, NEW_TOKENS + 1, (rows, 1))
    completion_mask[0] = True  # one row uses every slot
    input_ids = np.concatenate([np.repeat(prompt_ids, GROUP, 0), completion_ids], axis=1)
    attention_mask = np.concatenate([np.repeat(prompt_mask, GROUP, 0), completion_mask], axis=1)
    return Batch(
        input_ids=jnp.asarray(input_ids, jnp.int32),
        attention_mask=jnp.asarray(attention_mask, jnp.int32),
        completion_mask=jnp.asarray(completion_mask),
        advantages=jnp.asarray(rng.normal(size=rows), jnp.float32),
    )


def plain_hidden(params, batch, config):
    hidden = forward(
        params,
        batch.input_ids,
        attention_mask=batch.attention_mask,
        config=config,
        return_hidden=True,
    )
    return hidden[:, -NEW_TOKENS - 1 : -1]


def shared_hidden(params, batch, config):
    return group_completion_hidden(
        params,
        batch.input_ids,
        batch.attention_mask,
        config=config,
        group_size=GROUP,
        completion_length=NEW_TOKENS,
    )


def predicting_mask(batch):
    """[B, N] positions whose hidden state predicts a real completion token."""
    return np.asarray(batch.completion_mask)


def assert_same_hidden(params, batch, config):
    real = predicting_mask(batch)
    np.testing.assert_allclose(
        np.asarray(shared_hidden(params, batch, config))[real],
        np.asarray(plain_hidden(params, batch, config))[real],
        atol=1e-5,
        rtol=0,
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_group_forward_equals_the_plain_forward(family, hf_checkpoint):
    """Hidden states and their parameter gradients (biases, qk-norm, tied heads included)."""
    model = from_pretrained(hf_checkpoint(family)[0])
    params, config = model.params(), model.config
    batch = group_batch()
    assert_same_hidden(params, batch, config)
    real = predicting_mask(batch)

    def loss(hidden_of):  # a weighted sum of the real positions' hidden states
        weights = jax.random.normal(jax.random.key(1), (NEW_TOKENS, config.hidden_size))
        return lambda p: jnp.sum(hidden_of(p, batch, config) * weights * real[..., None])

    got = jax.grad(loss(shared_hidden))(params)
    expected = jax.grad(loss(plain_hidden))(params)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(expected), strict=True
    ):
        scale = float(jnp.abs(b).max())
        np.testing.assert_allclose(a, b, atol=1e-5 * scale, rtol=0, err_msg=str(path))


def test_group_forward_with_remat(hf_checkpoint):
    model = from_pretrained(hf_checkpoint("llama3")[0])
    params, config = model.params(), dataclasses.replace(model.config, remat=True)
    assert_same_hidden(params, group_batch(seed=1), config)


@pytest.mark.parametrize(
    "update",
    [{"beta": 0.1, "grad_accumulation": 3}, {"num_minibatches": 3}],
)
def test_train_step_with_shared_prompt_rows_equals_the_plain_update(update, hf_checkpoint):
    """Whole groups in each minibatch or micro-batch: the same parameters and metrics."""
    model = from_pretrained(hf_checkpoint("qwen2")[0])
    params, config = model.params(), model.config
    batch = group_batch(seed=2)
    sgd = optax.sgd(1.0)  # params move by exactly the gradient

    def run(shared_prompt_rows):
        state = init_state(jax.tree.map(jnp.copy, params), sgd)
        return train_step(
            state,
            batch,
            params if "beta" in update else None,
            model_config=config,
            update_config=UpdateConfig(**update, shared_prompt_rows=shared_prompt_rows),
            optimizer=sgd,
        )

    (plain, plain_metrics), (shared, shared_metrics) = run(1), run(GROUP)
    leaves = zip(
        jax.tree.leaves(shared.params),
        jax.tree.leaves(plain.params),
        jax.tree.leaves(params),
        strict=True,
    )
    for a, b, before in leaves:  # each leaf's change, to 1e-5 of its largest entry
        change = np.asarray(b - before)
        bound = 1e-5 * np.abs(change).max()
        np.testing.assert_allclose(np.asarray(a - before), change, atol=bound, rtol=0)
    assert shared_metrics.keys() == plain_metrics.keys()
    for name, value in plain_metrics.items():
        np.testing.assert_allclose(shared_metrics[name], value, atol=1e-5, rtol=1e-5, err_msg=name)


def test_shared_prompt_rows_must_split_micro_batches_into_whole_groups(hf_checkpoint):
    model = from_pretrained(hf_checkpoint("llama3")[0])
    sgd = optax.sgd(1.0)
    state = init_state(model.params(), sgd)
    with pytest.raises(ValueError, match=r"shared_prompt_rows=4 must divide the 6 rows"):
        train_step(
            state,
            group_batch(),
            model_config=model.config,
            update_config=UpdateConfig(num_minibatches=2, shared_prompt_rows=GROUP),
            optimizer=sgd,
        )
    with pytest.raises(ValueError, match="shared_prompt_rows must be an int >= 1"):
        UpdateConfig(shared_prompt_rows=0)
    with pytest.raises(ValueError, match=r"12 rows do not split into groups of group_size=5"):
        group_completion_hidden(
            model.params(),
            group_batch().input_ids,
            group_batch().attention_mask,
            config=model.config,
            group_size=5,
            completion_length=NEW_TOKENS,
        )
