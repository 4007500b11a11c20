"""group_advantages, group_statistics and zero_signal_groups against worked examples and numpy."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jgrpo


def reference_advantages(rewards, group_ids, valid, scale, ddof, eps):
    """Straightforward numpy, one group at a time."""
    rewards, group_ids, valid = map(np.asarray, (rewards, group_ids, valid))
    out = np.zeros(len(rewards))
    valid_rewards = rewards[valid]
    batch_std = valid_rewards.std(ddof=ddof) if len(valid_rewards) > ddof else 0.0
    for g in np.unique(group_ids):
        members = (group_ids == g) & valid
        r = rewards[members]
        if len(r) < 2 or np.all(r == r[0]):
            continue
        centred = r - r.mean()
        if scale == "group":
            centred = centred / (r.std(ddof=ddof) + eps)
        elif scale == "batch":
            centred = centred / (batch_std + eps)
        out[members] = centred
    return out


def test_worked_example():
    advantages = jgrpo.group_advantages(jnp.array([2.0, 4.0, 6.0, 8.0]), jnp.zeros(4, int), 1)
    np.testing.assert_array_equal(
        np.round(np.asarray(advantages, np.float64), 2), [-1.34, -0.45, 0.45, 1.34]
    )
    # mean 5, population std sqrt(5), eps 1e-4
    expected = (np.array([2.0, 4.0, 6.0, 8.0]) - 5.0) / (np.sqrt(5.0) + 1e-4)
    np.testing.assert_allclose(advantages, expected, rtol=1e-6)


def test_worked_table_in_docs():
    """The rows of the worked-example table in docs/objective.md."""
    rewards = jnp.array([2.0, 4.0, 6.0, 8.0, 1.0, 1.0, 1.0, 1.0])
    group_ids = jnp.array([0, 0, 0, 0, 1, 1, 1, 1])
    one_group = (rewards[:4], group_ids[:4], 1)
    rows = [
        (jgrpo.group_advantages(*one_group, std_ddof=1), [-1.1619, -0.3873, 0.3873, 1.1619]),
        (jgrpo.group_advantages(*one_group, scale="none"), [-3.0, -1.0, 1.0, 3.0]),
        (
            jgrpo.group_advantages(rewards, group_ids, 2, scale="batch"),
            [-1.1767, -0.3922, 0.3922, 1.1767, 0.0, 0.0, 0.0, 0.0],
        ),
        (
            jgrpo.group_advantages(*one_group, valid=jnp.array([1, 1, 1, 0])),
            [-1.2247, 0.0, 1.2247, 0.0],
        ),
    ]
    for got, expected in rows:
        np.testing.assert_allclose(got, expected, atol=1e-4)


def test_sample_std_matches_trl_convention():
    advantages = jgrpo.group_advantages(
        jnp.array([2.0, 4.0, 6.0, 8.0]), jnp.zeros(4, int), 1, std_ddof=1
    )
    expected = (np.array([2.0, 4.0, 6.0, 8.0]) - 5.0) / (np.sqrt(20.0 / 3.0) + 1e-4)
    np.testing.assert_allclose(advantages, expected, rtol=1e-6)


def ragged_batch(seed=0):
    """Groups of sizes 3, 5, 1, 4, 2 in shuffled order."""
    rng = np.random.default_rng(seed)
    sizes = [3, 5, 1, 4, 2]
    group_ids = np.repeat(np.arange(len(sizes)), sizes)
    rewards = rng.normal(size=len(group_ids)).astype(np.float32)
    order = rng.permutation(len(group_ids))
    return rewards[order], group_ids[order], len(sizes)


@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("scale", ["group", "none"])
def test_ragged_shuffled_groups_equal_groups_one_at_a_time(scale, ddof):
    rewards, group_ids, num_groups = ragged_batch()
    together = jgrpo.group_advantages(rewards, group_ids, num_groups, scale=scale, std_ddof=ddof)
    for g in range(num_groups):
        members = group_ids == g
        alone = jgrpo.group_advantages(
            rewards[members], np.zeros(members.sum(), int), 1, scale=scale, std_ddof=ddof
        )
        np.testing.assert_allclose(together[members], alone, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_matches_numpy_reference(scale, ddof):
    rewards, group_ids, num_groups = ragged_batch(seed=1)
    valid = np.ones(len(rewards), bool)
    valid[[0, 5]] = False
    got = jgrpo.group_advantages(
        rewards, group_ids, num_groups, valid=valid, scale=scale, std_ddof=ddof
    )
    expected = reference_advantages(rewards, group_ids, valid, scale, ddof, 1e-4)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_invalid_members_change_nothing(scale):
    rewards, group_ids, num_groups = ragged_batch(seed=2)
    base = jgrpo.group_advantages(rewards, group_ids, num_groups, scale=scale)
    # Append junk rows (one per group, plus a NaN) that are marked invalid.
    junk_ids = np.arange(num_groups)
    junk_rewards = np.full(num_groups, 1e6, np.float32)
    junk_rewards[0] = np.nan
    padded = jgrpo.group_advantages(
        np.concatenate([rewards, junk_rewards]),
        np.concatenate([group_ids, junk_ids]),
        num_groups,
        valid=np.arange(len(rewards) + num_groups) < len(rewards),
        scale=scale,
    )
    np.testing.assert_array_equal(padded[: len(rewards)], base)
    np.testing.assert_array_equal(padded[len(rewards) :], 0.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_a_nan_reward_in_an_invalid_row_leaves_the_gradient_finite(scale):
    """Invalid rewards are zeroed before any statistic, so a NaN there reaches no valid row's
    gradient: the gradient equals the one with a 0 in its place, and that row's is 0."""
    group_ids = jnp.array([0, 0, 0, 1, 1, 1])
    valid = jnp.array([True, True, False, True, True, True])
    upstream = jnp.array([0.3, -1.0, 2.0, 0.7, 0.1, -0.4])  # a loss's weights on A

    def weighted_advantages(rewards):
        advantages = jgrpo.group_advantages(rewards, group_ids, 2, valid=valid, scale=scale)
        return (advantages * upstream).sum()

    clean = jnp.array([1.0, 3.0, 0.0, 2.0, 5.0, 4.0])
    grad = jax.grad(weighted_advantages)(clean.at[2].set(jnp.nan))
    np.testing.assert_array_equal(grad, jax.grad(weighted_advantages)(clean))
    assert np.all(np.isfinite(grad)) and grad[2] == 0.0 and np.any(grad != 0.0)


@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_singleton_and_all_equal_groups_are_exactly_zero(scale, ddof):
    # 0.1 three times: the float32 mean is not exactly 0.1, so a variance test would leak.
    rewards = jnp.array([0.1, 0.1, 0.1, 3.0, 1.0, 2.0, 7.0, 7.0])
    group_ids = jnp.array([0, 0, 0, 1, 2, 2, 3, 3])
    valid = jnp.array([True, True, True, True, True, True, True, False])
    advantages = jgrpo.group_advantages(
        rewards, group_ids, 4, valid=valid, scale=scale, std_ddof=ddof
    )
    assert np.all(np.isfinite(advantages))
    np.testing.assert_array_equal(np.asarray(advantages)[[0, 1, 2, 3, 6, 7]], 0.0)
    assert advantages[4] < 0 < advantages[5]
    # The gradient through degenerate groups is finite too.
    grad = jax.grad(
        lambda r: (jgrpo.group_advantages(r, group_ids, 4, valid=valid, std_ddof=ddof) ** 2).sum()
    )(rewards)
    assert np.all(np.isfinite(grad))


def test_group_statistics_values():
    stats = jgrpo.group_statistics(
        jnp.array([1.0, 3.0, 5.0, 5.0, 2.0]),
        jnp.array([0, 0, 1, 1, 2]),
        4,
        std_ddof=1,
    )
    np.testing.assert_array_equal(stats.count, [2, 2, 1, 0])
    np.testing.assert_allclose(stats.mean, [2.0, 5.0, 2.0, 0.0])
    np.testing.assert_allclose(stats.std, [np.sqrt(2.0), 0.0, 0.0, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(stats.degenerate, [False, True, True, True])


def test_zero_signal_groups_by_hand():
    """Ragged groups in shuffled order; group 5 has no rows at all."""
    rewards = jnp.array([2.0, 1.0, 0.0, 1.0, 3.0, 1.0, 9.0, 1.0, 5.0, 0.0, 4.0, 2.0])
    group_ids = jnp.array([4, 0, 1, 0, 2, 4, 1, 0, 3, 1, 2, 4])
    valid = jnp.array([1, 1, 1, 1, 0, 1, 0, 1, 1, 1, 0, 1], bool)
    # 0: rewards 1, 1, 1 -> equal. 1: 0, (9 invalid), 0 -> equal once the 9 is left out.
    # 2: (3, 4) both invalid -> no valid row. 3: a single row. 4: 2, 1, 2 -> signal.
    expected = [True, True, True, True, False, True]
    flags = jgrpo.zero_signal_groups(rewards, group_ids, 6, valid=valid)
    np.testing.assert_array_equal(flags, expected)
    np.testing.assert_array_equal(
        jgrpo.group_statistics(rewards, group_ids, 6, valid=valid).degenerate, expected
    )
    # Without the mask group 1 (0, 9, 0) and group 2 (3, 4) have signal.
    np.testing.assert_array_equal(
        jgrpo.zero_signal_groups(rewards, group_ids, 6), [True, False, False, True, False, True]
    )
    # No signal means advantage 0 for every member, whatever the scale; signal, a nonzero one.
    for scale in ("group", "batch", "none"):
        advantages = np.asarray(
            jgrpo.group_advantages(rewards, group_ids, 6, valid=valid, scale=scale)
        )
        for group, flat in enumerate(expected):
            assert np.all(advantages[np.asarray(group_ids) == group] == 0) == flat, scale
    # A valid NaN reward is not "all equal": the group keeps its signal (and NaN advantages).
    nan = jgrpo.zero_signal_groups(jnp.array([jnp.nan, 1.0]), jnp.array([0, 0]), 1)
    np.testing.assert_array_equal(nan, [False])


def test_zero_signal_groups_under_jit_match_fixed_size_groups():
    """Prompt-major rows, G per group, as the trainer holds them: the numpy reshape to [-1, G]
    the trainer used before gives the same flags (a group with no valid row: no signal)."""
    rng = np.random.default_rng(0)
    g, groups = 4, 64
    rewards = rng.integers(0, 2, groups * g).astype(np.float32)  # equal rewards are common
    valid = rng.random(groups * g) < 0.7
    valid[:g] = False  # group 0 has no valid row
    high = np.where(valid, rewards, -np.inf).reshape(-1, g).max(axis=1)
    low = np.where(valid, rewards, np.inf).reshape(-1, g).min(axis=1)
    group_ids = jnp.asarray(np.arange(groups * g) // g, jnp.int32)
    flags = jax.jit(jgrpo.zero_signal_groups, static_argnums=2)(
        rewards, group_ids, groups, valid=valid
    )
    np.testing.assert_array_equal(flags, ~(high > low))
    assert flags[0] and 0 < flags.sum() < groups


def test_clip():
    rewards = jnp.array([0.0, 0.0, 0.0, 10.0])  # the outlier gets advantage ~1.73
    advantages = jgrpo.group_advantages(rewards, jnp.zeros(4, int), 1, clip=1.0)
    np.testing.assert_allclose(advantages, [-0.57735, -0.57735, -0.57735, 1.0], rtol=1e-4)


def test_eps_is_added_to_std():
    advantages = jgrpo.group_advantages(jnp.array([0.0, 2.0]), jnp.zeros(2, int), 1, eps=1.0)
    np.testing.assert_allclose(advantages, [-0.5, 0.5])  # std 1 -> divide by 2


def test_jit_vmap_grad():
    rewards, group_ids, num_groups = ragged_batch(seed=3)
    fn = lambda r: jgrpo.group_advantages(r, group_ids, num_groups)
    np.testing.assert_allclose(jax.jit(fn)(rewards), fn(rewards), rtol=1e-6)
    stacked = np.stack([rewards, rewards * 2 + 1, -rewards])
    np.testing.assert_allclose(
        jax.vmap(fn)(stacked), np.stack([fn(r) for r in stacked]), rtol=1e-6, atol=1e-7
    )
    jax.test_util.check_grads(
        lambda r: jgrpo.group_advantages(r, group_ids, num_groups, std_ddof=1),
        (jnp.asarray(rewards, jnp.float32),),
        order=1,
        modes=["rev"],
        atol=1e-2,
        rtol=1e-2,
    )


def test_new_group_layout_does_not_recompile():
    @jax.jit
    @chex.assert_max_traces(n=1)
    def advantages(rewards, group_ids, valid):
        return jgrpo.group_advantages(rewards, group_ids, 5, valid=valid)

    for seed in range(3):
        rewards, group_ids, _ = ragged_batch(seed)
        valid = np.random.default_rng(seed).random(len(rewards)) > 0.2
        advantages(rewards, group_ids, valid)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(scale="std"), "scale must be one of 'group', 'batch', 'none'"),
        (dict(std_ddof=2), "std_ddof must be one of 0, 1"),
        (dict(num_groups=2.0), "num_groups must be a static Python int"),
        (dict(num_groups=1), r"group_ids must lie in \[0, num_groups=1\)"),
        (dict(group_ids=np.array([0, 1, 1])), r"group_ids must have the same shape as rewards"),
        (dict(group_ids=np.zeros(4)), "group_ids must be integers"),
        (dict(valid=np.ones(3, bool)), "valid must have the same shape as rewards"),
        (dict(rewards=np.ones((2, 2))), "rewards must have 1 dimensions"),
        (dict(clip=0.0), "clip must be None or > 0"),
        (dict(eps=-1.0), "eps must be >= 0"),
    ],
)
def test_bad_input_names_the_argument(kwargs, message):
    args = dict(rewards=np.ones(4), group_ids=np.array([0, 0, 1, 1]), num_groups=2)
    args.update(kwargs)
    rewards, group_ids, num_groups = (
        args.pop("rewards"),
        args.pop("group_ids"),
        args.pop("num_groups"),
    )
    with pytest.raises(ValueError, match=message):
        jgrpo.group_advantages(rewards, group_ids, num_groups, **args)
