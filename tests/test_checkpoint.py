"""Checkpointer: exact round trips, keep-last-K, resuming, sharded restore and clear errors."""

import logging
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jgrpo.checkpoint import CheckpointDamaged, Checkpointer
from jgrpo.update import TrainState

META = {"data_position": 12, "seed": 0, "config": {"optim": {"lr": 1e-6}, "tags": ["a", "b"]}}


@jax.jit
def realistic_state():
    """A TrainState after one AdamW update (mu, nu, count non-trivial) plus raw key data."""
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "embed": jax.random.normal(k1, (8, 4), jnp.float32),
        "layers": {"norm": jax.random.normal(k2, (4,), jnp.float32).astype(jnp.bfloat16)},
    }
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3)
    )
    opt_state = optimizer.init(params)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.25), params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    train_state = TrainState(params=params, opt_state=opt_state, step=jnp.array(1, jnp.int32))
    return {"train_state": train_state, "rng": jax.random.key_data(jax.random.key(3))}


def small_state(value):
    return {"w": jnp.full((8, 4), value, jnp.float32), "count": jnp.array(value, jnp.int32)}


def abstract(state):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )


def host_copy(state):
    return jax.tree.map(np.array, state)


def assert_same(restored, expected):
    """Same tree structure (NamedTuple and optax classes included), dtypes and exact values."""
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(expected), strict=True):
        assert got.dtype == want.dtype
        assert got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_round_trip_realistic_state_after_reopening(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    state = realistic_state()
    adam = state["train_state"].opt_state[1].inner_state[0]
    assert int(adam.count) == 1 and float(jnp.abs(adam.mu["embed"]).sum()) > 0  # non-trivial
    expected, target = host_copy(state), abstract(state)

    with Checkpointer(tmp_path / "checkpoints") as checkpointer:
        checkpointer.save(1, state, META)
        # Async save copied the arrays to host before returning: the caller may donate them.
        for leaf in jax.tree.leaves(state):
            leaf.delete()
    assert (tmp_path / "checkpoints" / "1").is_dir()  # close() waited for the write

    with Checkpointer(tmp_path / "checkpoints") as reopened:  # as after a process restart
        assert reopened.latest_step() == 1
        restored, meta = reopened.restore(target)

    assert_same(restored, expected)
    assert type(restored["train_state"]) is TrainState
    assert isinstance(restored["train_state"].opt_state[1], optax.InjectStatefulHyperparamsState)
    assert restored["train_state"].params["layers"]["norm"].dtype == jnp.bfloat16
    assert restored["rng"].dtype == jnp.uint32
    assert meta == META
    noisy = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not noisy, noisy


def test_keeps_the_last_k_and_restores_any_kept_step(tmp_path):
    directory = tmp_path / "checkpoints"
    with Checkpointer(directory, keep=2) as checkpointer:
        for step in range(1, 5):
            checkpointer.save(step, small_state(step), {"step": step})
        assert checkpointer.all_steps() == [3, 4]
        assert checkpointer.latest_step() == 4
        assert sorted(p.name for p in directory.iterdir()) == ["3", "4"]

        # Concrete arrays work as the target too.
        state, meta = checkpointer.restore(small_state(0), step=3)
        assert_same(state, host_copy(small_state(3)))
        assert meta == {"step": 3}
        state, meta = checkpointer.restore(small_state(0))
        assert_same(state, host_copy(small_state(4)))
        assert meta == {"step": 4}


def test_saving_an_existing_step_is_a_no_op(tmp_path):
    with Checkpointer(tmp_path, async_save=False) as checkpointer:
        checkpointer.save(5, small_state(5), {"first": True})
        assert (tmp_path / "5").is_dir()  # synchronous: on disk when save returns
        checkpointer.save(5, small_state(9), {"first": False})
        state, meta = checkpointer.restore(abstract(small_state(0)))
    assert_same(state, host_copy(small_state(5)))
    assert meta == {"first": True}


def test_empty_directory_has_no_latest_step_and_restore_names_it(tmp_path):
    directory = tmp_path / "empty"
    with Checkpointer(directory) as checkpointer:
        assert checkpointer.latest_step() is None
        assert checkpointer.all_steps() == []
        with pytest.raises(FileNotFoundError, match=f"No checkpoint to restore in {directory}"):
            checkpointer.restore(abstract(small_state(0)))


def test_restoring_a_missing_step_lists_the_saved_ones(tmp_path):
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(2, small_state(2), {})
        with pytest.raises(FileNotFoundError, match=r"step 7 .* holds steps \[2\]"):
            checkpointer.restore(abstract(small_state(0)), step=7)


def test_mismatched_target_names_the_leaf_and_the_shapes(tmp_path):
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, small_state(1), {})
        wider = {"w": jnp.zeros((8, 5), jnp.float32), "count": jnp.array(0, jnp.int32)}
        with pytest.raises(
            ValueError, match=r"w: shape \(8, 4\) in the checkpoint, target \(8, 5\)"
        ):
            checkpointer.restore(wider)
        renamed = {"v": jnp.zeros((8, 4), jnp.float32), "count": jnp.array(0, jnp.int32)}
        with pytest.raises(ValueError, match=str(tmp_path)) as error:
            checkpointer.restore(renamed)
        assert "w: in the checkpoint only" in str(error.value)
        assert "v: in the target only" in str(error.value)


def test_target_without_sharding_is_rejected(tmp_path):
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, small_state(1), {})
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), small_state(0))
        with pytest.raises(ValueError, match="needs a sharding.*count, w"):
            checkpointer.restore(target)


def test_unfinished_save_is_ignored_and_cleaned_up(tmp_path):
    directory = tmp_path / "checkpoints"
    with Checkpointer(directory) as checkpointer:
        checkpointer.save(1, small_state(1), {"step": 1})
        checkpointer.save(2, small_state(2), {"step": 2})
    # A process killed before Orbax's final rename leaves <step>.orbax-checkpoint-tmp behind,
    # here even with every file written.
    shutil.copytree(directory / "2", directory / "3.orbax-checkpoint-tmp")

    with Checkpointer(directory) as checkpointer:
        assert checkpointer.latest_step() == 2
        assert checkpointer.all_steps() == [1, 2]
        state, meta = checkpointer.restore(abstract(small_state(0)))
        assert meta == {"step": 2}
        # The resumed run saves step 3 afresh: the stale temporary directory does not leak in.
        checkpointer.save(3, small_state(30), {"step": 3})
        assert checkpointer.latest_step() == 3
        state, meta = checkpointer.restore(abstract(small_state(0)))
    assert_same(state, host_copy(small_state(30)))
    assert meta == {"step": 3}
    assert not [p.name for p in directory.iterdir() if "tmp" in p.name]


def test_restores_into_the_target_sharding_and_dtype(tmp_path):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = {"w": jnp.arange(32, dtype=jnp.float32).reshape(8, 4), "count": jnp.array(1)}
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, state, {})  # saved from one device
        target = {
            "w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=rows),
            "count": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
        }
        restored, _ = checkpointer.restore(target)
        as_bf16 = {**target, "w": jax.ShapeDtypeStruct((8, 4), jnp.bfloat16, sharding=rows)}
        cast, _ = checkpointer.restore(as_bf16)
    assert cast["w"].dtype == jnp.bfloat16 and cast["w"].sharding == rows
    np.testing.assert_array_equal(np.asarray(cast["w"], np.float32), np.asarray(state["w"]))
    assert restored["w"].sharding == rows
    assert restored["count"].sharding == replicated
    assert len(restored["w"].addressable_shards) == 8
    assert restored["w"].addressable_shards[0].data.shape == (1, 4)
    assert_same(restored, host_copy(state))


def test_bad_meta_fails_at_save_and_closed_checkpointer_refuses_work(tmp_path):
    checkpointer = Checkpointer(tmp_path)
    with pytest.raises(TypeError, match="JSON"):
        checkpointer.save(1, small_state(1), {"path": tmp_path})
    with pytest.raises(TypeError, match="dict"):
        checkpointer.save(1, small_state(1), ["not", "a", "dict"])
    assert checkpointer.all_steps() == []
    checkpointer.close()
    checkpointer.close()  # harmless
    with pytest.raises(RuntimeError, match="closed"):
        checkpointer.save(1, small_state(1), {})
    with pytest.raises(ValueError, match="keep"):
        Checkpointer(tmp_path, keep=0)


def test_restore_meta_reads_only_the_json(tmp_path):
    with Checkpointer(tmp_path, async_save=False) as checkpointer:
        checkpointer.save(1, {"w": jnp.ones((2,))}, {"data_position": 3})
        checkpointer.save(2, {"w": jnp.ones((2,))}, {"data_position": 7})
        assert checkpointer.restore_meta() == {"data_position": 7}
        assert checkpointer.restore_meta(1) == {"data_position": 3}
        with pytest.raises(FileNotFoundError, match="step 5"):
            checkpointer.restore_meta(5)


def test_a_reference_saved_with_a_step_restores_after_reopening(tmp_path):
    with Checkpointer(tmp_path) as checkpointer:  # async saves, as the trainer's
        checkpointer.save(1, small_state(1), {"step": 1})
        checkpointer.save(2, small_state(2), {"step": 2}, reference=small_state(5))
    with Checkpointer(tmp_path) as checkpointer:
        target = abstract(small_state(0))
        assert_same(checkpointer.restore_reference(target, 2), small_state(5))
        assert checkpointer.restore_reference(target, 1) is None  # saved without one
        wrong = abstract({"w": jnp.zeros((4, 4)), "count": jnp.array(0, jnp.int32)})
        with pytest.raises(ValueError, match=r"target reference .*\n  w: shape \(8, 4\) in the"):
            checkpointer.restore_reference(wrong, 2)
        state, meta = checkpointer.restore(target)  # the state alone, as before
        assert_same(state, small_state(2))
        assert meta == {"step": 2}


# --- Integrity: checksums and the fallback to an intact step ----------------------------------


def test_array_checksum_weights_each_elements_bits_by_an_odd_number():
    from jgrpo.checkpoint import array_checksum

    def checksum(x):
        return int(array_checksum(x))

    # sum_i bits_i * (2 i + 1), row-major
    assert checksum(jnp.array([1, 2, 3], jnp.uint32)) == 1 * 1 + 2 * 3 + 3 * 5
    assert checksum(jnp.array([[1, 2], [3, 4]], jnp.int32)) == 1 + 2 * 3 + 3 * 5 + 4 * 7
    assert checksum(jnp.array([True, False, True])) == 1 + 5
    assert checksum(jnp.array(1.0, jnp.float32)) == 0x3F800000  # a scalar: its bits
    assert checksum(jnp.array([0.0, 1.0], jnp.bfloat16)) == 0x3F80 * 3
    assert checksum(jnp.array([2**31, 2**31], jnp.uint32)) == 0  # (1 + 3) * 2^31 wraps
    assert checksum(jax.random.key(3)) == checksum(jax.random.key_data(jax.random.key(3)))
    # Every single flipped bit of an element changes it.
    x = jax.random.normal(jax.random.key(0), (4, 8), jnp.float32)
    bits = np.asarray(x).view(np.uint32).copy()
    for bit in range(32):
        flipped = bits.copy()
        flipped[2, 5] ^= np.uint32(1 << bit)
        assert checksum(jnp.asarray(flipped.view(np.float32))) != checksum(x), bit
    # The same on any sharding (integer sums wrap exactly in any order).
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = jax.device_put(
        jnp.tile(x, (2, 1)), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    )
    assert checksum(sharded) == checksum(jnp.tile(x, (2, 1)))


def random_state(seed):
    """Incompressible values, so that a flipped bit in a data file changes a weight silently."""
    return {"w": jax.random.normal(jax.random.key(seed), (64, 64)), "count": jnp.array(seed)}


def data_files(step_dir, item="state"):
    """The files Orbax writes the arrays of a saved step's `item` into."""
    return [p for p in (step_dir / item).rglob("*") if p.is_file() and p.parent.name == "d"]


def flip_a_bit(step_dir, item="state"):
    """Flips one bit in the middle of the largest data file of a saved step's `item`."""
    files = data_files(step_dir, item)
    largest = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0x10
    largest.write_bytes(bytes(data))


def test_a_flipped_bit_in_the_newest_step_falls_back_to_the_step_before(tmp_path, caplog):
    directory = tmp_path / "checkpoints"
    with Checkpointer(directory) as checkpointer:
        checkpointer.save(1, random_state(1), {"step": 1})
        checkpointer.save(2, random_state(2), {"step": 2})
    flip_a_bit(directory / "2")

    with Checkpointer(directory) as checkpointer:
        with caplog.at_level(logging.WARNING, logger="jgrpo.checkpoint"):
            state, meta = checkpointer.restore(abstract(random_state(0)))
        assert meta == {"step": 1}
        assert_same(state, host_copy(random_state(1)))
        assert (
            f"checkpoint step 2 in {directory} is damaged (1 array(s) differ from their saved "
            "checksums (w)); skipping it, it is deleted at the next save."
        ) in caplog.text
        with pytest.raises(CheckpointDamaged, match=r"step 2 .* is damaged: 1 array\(s\) differ"):
            checkpointer.restore(abstract(random_state(0)), step=2)  # asked for: an error
        # The resumed run saves step 2 afresh: the damaged one goes first.
        checkpointer.save(2, random_state(20), {"step": 2})
        state, meta = checkpointer.restore(abstract(random_state(0)))
    assert meta == {"step": 2}
    assert_same(state, host_copy(random_state(20)))


def test_unreadable_steps_are_skipped_and_none_intact_is_an_error(tmp_path, caplog):
    directory = tmp_path / "checkpoints"
    with Checkpointer(directory) as checkpointer:
        for step in (1, 2, 3):
            checkpointer.save(step, random_state(step), {"step": step})
    for step_dir in (directory / "3", directory / "2"):
        for path in data_files(step_dir):
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # truncated
    with (
        Checkpointer(directory) as checkpointer,
        caplog.at_level(logging.WARNING, logger="jgrpo.checkpoint"),
    ):
        state, meta = checkpointer.restore(abstract(random_state(0)))
    assert meta == {"step": 1}
    assert_same(state, host_copy(random_state(1)))
    for step in (3, 2):
        assert f"checkpoint step {step} in {directory} is damaged (its files cannot be read: " in (
            caplog.text
        )
    flip_a_bit(directory / "1")
    with Checkpointer(directory) as checkpointer, pytest.raises(CheckpointDamaged) as error:
        checkpointer.restore(abstract(random_state(0)))
    message = str(error.value)
    assert message.startswith(f"No intact checkpoint in {directory}: step 3: its files cannot")
    assert "step 1: 1 array(s) differ from their saved checksums (w). Move the folder" in message


def test_a_damaged_reference_is_an_error_naming_the_step(tmp_path):
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, small_state(1), {}, reference=random_state(5))
    flip_a_bit(tmp_path / "1", item="reference")
    with Checkpointer(tmp_path) as checkpointer:
        with pytest.raises(CheckpointDamaged, match=r"reference saved with checkpoint step 1 .* "):
            checkpointer.restore_reference(abstract(random_state(0)), 1)
        state, _ = checkpointer.restore(abstract(small_state(0)))  # the state is intact
    assert_same(state, host_copy(small_state(1)))


def test_a_step_saved_without_checksums_restores_unchecked(tmp_path):
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, random_state(1), {"step": 1})
    shutil.rmtree(tmp_path / "1" / "checksums")  # as checkpoints from before they existed
    with Checkpointer(tmp_path) as checkpointer:
        state, meta = checkpointer.restore(abstract(random_state(0)))
    assert meta == {"step": 1}
    assert_same(state, host_copy(random_state(1)))
