"""The shared-prompt training forward: each prompt once per group, equal to the plain forward."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiny_hf import FAMILIES, VOCAB

from jgrpo.models.group_forward import group_completion_hidden, packed_head_inputs
from jgrpo.models.hf import from_pretrained
from jgrpo.models.transformer import forward
from jgrpo.packing import completion_lengths, pack_completions, rows_needed
from jgrpo.update import Batch, UpdateConfig, completion_logprobs, init_state, train_step

PROMPTS, GROUP, PROMPT_LENGTH, NEW_TOKENS = 3, 4, 7, 5


def group_batch(seed=0, vocab=VOCAB, lengths=None):
    """Prompt-major rows: 3 prompts (left-padded to 7, one of a single token) x 4 completions,
    each stopping after 1-5 tokens (later slots masked, as a rollout leaves them); `lengths`
    [12] sets the completions' lengths instead."""
    rng = np.random.default_rng(seed)
    rows = PROMPTS * GROUP
    prompt_ids = rng.integers(3, vocab, (PROMPTS, PROMPT_LENGTH))
    prompt_lengths = np.array([7, 4, 1])
    prompt_mask = np.arange(PROMPT_LENGTH)[None] >= PROMPT_LENGTH - prompt_lengths[:, None]
    prompt_ids = np.where(prompt_mask, prompt_ids, 0)
    completion_ids = rng.integers(3, vocab, (rows, NEW_TOKENS))
    completion_mask = np.arange(NEW_TOKENS)[None] < rng.integers(1, NEW_TOKENS + 1, (rows, 1))
    completion_mask[0] = True  # one row uses every slot
    if lengths is not None:
        completion_mask = np.arange(NEW_TOKENS)[None] < np.asarray(lengths)[:, None]
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


def packed_hidden(params, batch, config, rows_per_group=None):
    lengths = completion_lengths(np.asarray(batch.completion_mask))
    packed = pack_completions(
        lengths,
        group_size=GROUP,
        width=NEW_TOKENS,
        rows_per_group=rows_per_group or rows_needed(lengths, GROUP, NEW_TOKENS),
        prompt_length=PROMPT_LENGTH,
    )
    return group_completion_hidden(
        params,
        batch.input_ids,
        batch.attention_mask,
        config=config,
        group_size=GROUP,
        completion_length=NEW_TOKENS,
        packed=jax.tree.map(jnp.asarray, packed),
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


def assert_same_gradients(got, expected):
    """Each leaf to 1e-5 of its largest entry."""
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(expected), strict=True
    ):
        scale = float(jnp.abs(b).max())
        np.testing.assert_allclose(a, b, atol=1e-5 * scale, rtol=0, err_msg=str(path))


def assert_same_update(got, expected, params):
    """train_step results (state, metrics): each parameter's change to 1e-5 of its largest
    entry, and the same metrics."""
    (state, metrics), (expected_state, expected_metrics) = got, expected
    leaves = zip(
        jax.tree.leaves(state.params),
        jax.tree.leaves(expected_state.params),
        jax.tree.leaves(params),
        strict=True,
    )
    for a, b, before in leaves:
        change = np.asarray(b - before)
        bound = 1e-5 * np.abs(change).max()
        np.testing.assert_allclose(np.asarray(a - before), change, atol=bound, rtol=0)
    assert metrics.keys() == expected_metrics.keys()
    for name, value in expected_metrics.items():
        np.testing.assert_allclose(metrics[name], value, atol=1e-5, rtol=1e-5, err_msg=name)


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
    assert_same_gradients(got, expected)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_packed_group_forward_equals_the_plain_forward(family, hf_checkpoint):
    """A group's completions packed into fewer rows: the same hidden states at the real
    positions, and the same parameter gradients (qk-norm included; gemma3: sliding windows
    measured by position, which packed slots keep from their padded rows)."""
    model = from_pretrained(hf_checkpoint(family)[0])
    params, config = model.params(), model.config
    # groups of lengths: 5 2 3 1 (3 packed rows: 5 | 3 2 | 1), 1 1 4 2 (2 rows: 4 1 | 2 1),
    # 0 5 2 2 (2 rows: 5 | 2 2; an empty completion)
    batch = group_batch(seed=3, lengths=[5, 2, 3, 1, 1, 1, 4, 2, 0, 5, 2, 2])
    lengths = completion_lengths(np.asarray(batch.completion_mask))
    assert rows_needed(lengths, GROUP, NEW_TOKENS) == 3
    real = predicting_mask(batch)
    expected = np.asarray(plain_hidden(params, batch, config))[real]
    for rows in (rows_needed(lengths, GROUP, NEW_TOKENS), GROUP):  # empty packed rows too
        got = np.asarray(packed_hidden(params, batch, config, rows))[real]
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)

    weights = jax.random.normal(jax.random.key(1), (NEW_TOKENS, config.hidden_size))

    def loss(hidden_of):
        return lambda p: jnp.sum(hidden_of(p, batch, config) * weights * real[..., None])

    got = jax.grad(loss(packed_hidden))(params)
    expected = jax.grad(loss(plain_hidden))(params)
    assert_same_gradients(got, expected)


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

    assert_same_update(run(GROUP), run(1), params)


def packed_batch(batch, rows_per_group):
    lengths = completion_lengths(np.asarray(batch.completion_mask))
    packed = pack_completions(
        lengths,
        group_size=GROUP,
        width=NEW_TOKENS,
        rows_per_group=rows_per_group,
        prompt_length=PROMPT_LENGTH,
    )
    return batch._replace(packed=jax.tree.map(jnp.asarray, packed))


@pytest.mark.parametrize(
    "update",
    [
        {"beta": 0.1, "grad_accumulation": 3, "loss_type": "dapo"},
        {"num_iterations": 2, "num_minibatches": 3, "loss_type": "grpo"},
    ],
)
def test_train_step_on_packed_completions_equals_the_padded_update(update, hf_checkpoint):
    """Each group's completions packed into 3 rows instead of 4: the same parameters and
    metrics, with token sums (dapo) and sequence means (grpo), the reference pass, old
    log-probs (several minibatches, a second pass) and micro-batches."""
    model = from_pretrained(hf_checkpoint("llama3")[0])
    params, config = model.params(), model.config
    batch = group_batch(seed=4, lengths=[5, 2, 3, 1, 1, 1, 4, 2, 0, 5, 2, 2])
    sgd = optax.sgd(1.0)

    def run(run_batch):
        state = init_state(jax.tree.map(jnp.copy, params), sgd)
        return train_step(
            state,
            run_batch,
            params if "beta" in update else None,
            model_config=config,
            update_config=UpdateConfig(**update, shared_prompt_rows=GROUP),
            optimizer=sgd,
        )

    assert_same_update(run(packed_batch(batch, 3)), run(batch), params)


def test_packed_log_probs_read_only_the_packed_tokens(hf_checkpoint):
    """The log-prob head of a packed batch runs on P * (G + Gb * N) positions (per prompt,
    its rows' first predictions, then its packed slots), with the padded batch's log-probs
    and entropies at every real completion position."""
    model = from_pretrained(hf_checkpoint("qwen2")[0])
    params, config = model.params(), model.config
    batch = group_batch(seed=5, lengths=[5, 2, 3, 1, 1, 1, 4, 2, 0, 5, 2, 2])
    packed = packed_batch(batch, 3)
    hidden, targets, index = packed_head_inputs(
        params,
        packed.input_ids,
        packed.attention_mask,
        packed.packed,
        config=config,
        group_size=GROUP,
        completion_length=NEW_TOKENS,
    )
    rows = PROMPTS * GROUP
    per_prompt = GROUP + 3 * NEW_TOKENS
    assert hidden.shape == (PROMPTS * per_prompt, config.hidden_size)
    assert targets.shape == hidden.shape[:1] and index.shape == (rows, NEW_TOKENS)
    # token 0 of row p * G + g: its prompt's last token, at p * (G + Gb * N) + g
    first = np.arange(PROMPTS)[:, None] * per_prompt + np.arange(GROUP)
    np.testing.assert_array_equal(index[:, 0], first.reshape(-1))

    def logprobs(run_batch):
        return completion_logprobs(
            params,
            run_batch,
            model_config=config,
            temperature=0.7,
            chunk_size=64,
            shared_prompt_rows=GROUP,
        )

    real = predicting_mask(batch)
    for got, expected in zip(logprobs(packed), logprobs(batch), strict=True):
        np.testing.assert_allclose(np.asarray(got)[real], np.asarray(expected)[real], atol=1e-5)


def test_a_packed_batch_needs_whole_groups(hf_checkpoint):
    model = from_pretrained(hf_checkpoint("llama3")[0])
    sgd = optax.sgd(1.0)
    batch = packed_batch(group_batch(lengths=[5, 2, 3, 1, 1, 1, 4, 2, 0, 5, 2, 2]), 3)
    with pytest.raises(ValueError, match="a packed batch needs shared_prompt_rows = G > 1"):
        train_step(
            init_state(model.params(), sgd),
            batch,
            model_config=model.config,
            update_config=UpdateConfig(),
            optimizer=sgd,
        )


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
