"""Checkpoints of the training state: Orbax, the last K kept, saved in the background.

    with Checkpointer(run_dir / "checkpoints", keep=3) as checkpointer:
        if checkpointer.latest_step() is not None:
            state, meta = checkpointer.restore(abstract_state)  # straight into the shardings
        ...
        checkpointer.save(step, state, {"data_position": i, "seed": 0, "config": config_dict})

Each step is a directory <step>/ holding `state` (the array pytree, written by tensorstore),
`meta` (a JSON dict), `checksums` (JSON: one per array) and, for a run whose KL reference moves
(`algorithm.ref_sync_steps`), that `reference`. Orbax writes a step into
`<step>.orbax-checkpoint-tmp` and renames it once everything is on disk, so a process killed
mid-save leaves no step that `latest_step` returns; the leftover temporary directory is deleted
when the next Checkpointer opens the directory. Old steps are deleted only after a newer one is
complete, so at least one complete step remains.

Integrity: Orbax checks no data on read (a flipped bit in a weight file restores silently as a
different weight). So each save also stores a checksum of every array, computed on its devices
(`array_checksum`: one pass over the array, no copy to the host), and each restore recomputes
them and compares. `restore()` of the latest step falls back to the newest intact one, with a
warning naming each step it skipped and why (damaged data, or files that cannot be read); the
skipped steps are deleted at the next save, which would otherwise keep them as the newest.

Why a wrapper over `orbax.checkpoint.CheckpointManager`: it pins the choices the trainer relies
on (absolute paths, the handlers for reopening a directory, saving exactly when asked) and turns
"no checkpoint" and "a different model" into errors that name the directory and the leaf.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath

from jgrpo import distributed

logger = logging.getLogger("jgrpo.checkpoint")

_MAX_LISTED = 8  # mismatching leaves named in one error


class CheckpointDamaged(RuntimeError):
    """A checkpoint step whose files cannot be read, or whose arrays differ from their saved
    checksums."""


class _TargetMismatch(ValueError):
    """The target does not fit the stored tree (a different model): an error, not damage."""


def array_checksum(x: jax.Array) -> jax.Array:  # uint32[]
    """sum_i bits_i * (2 i + 1) mod 2^32 over the elements in row-major order i, bits_i being
    the element's bytes read as an unsigned integer (8-byte elements as two 4-byte words).

    Any one flipped bit changes it (an odd weight times 2^k is not 0 mod 2^32), and so does
    moving a value to another index. Integer sums wrap exactly in any order, so it does not
    depend on how the array is sharded: a checkpoint saved on one mesh verifies on another.
    """
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if x.dtype.itemsize >= 4:
        words = jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2] for 8-byte elements
    else:
        unsigned = jnp.uint8 if x.dtype.itemsize == 1 else jnp.uint16
        words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    index = jnp.zeros(words.shape, jnp.uint32)  # row-major, from iotas: no reshape of shards
    stride = 1
    for axis in reversed(range(words.ndim)):
        iota = jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= words.shape[axis]
    return jnp.sum(words * (2 * index + 1), dtype=jnp.uint32)


_tree_checksums = jax.jit(lambda tree: jax.tree.map(array_checksum, tree))


def _flat_names(tree: Any) -> dict[str, Any]:
    """{'params.embed': leaf, ...}: the leaves by their dotted path."""
    return {".".join(key): leaf for key, leaf in ocp.tree.to_flat_dict(tree).items()}


def checksums(tree: Any) -> dict[str, int]:
    """`array_checksum` of each array of `tree`, by dotted path (one compiled program per tree
    structure, shapes and shardings; every process gets the same values)."""
    replicas = jax.tree.map(lambda value: value.addressable_data(0), _tree_checksums(tree))
    return {name: int(value) for name, value in _flat_names(jax.device_get(replicas)).items()}


class Checkpointer:
    """Orbax checkpoints of the training state in <run_dir>/checkpoints: last K kept, async saves.

    With `async_save`, `save` returns once the arrays are copied to host memory (so the caller
    may donate or delete them) and writes to disk in a background thread; the next `save`,
    `wait`, `latest_step`, `all_steps`, `restore` and `close` wait for it first. A failed
    background write raises from whichever of those runs next.
    """

    def __init__(self, directory, *, keep: int = 3, async_save: bool = True):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1 (checkpoints to keep), got {keep!r}.")
        # Orbax's tensorstore writes need an absolute path; epath keeps gs:// paths as they are.
        self.directory = epath.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            # Deletes <step>.orbax-checkpoint-tmp left by a killed save (before the next save).
            cleanup_tmp_directories=True,
        )
        # Naming the handlers lets a new process read the metadata of existing steps.
        registry = ocp.handlers.create_default_handler_registry(
            state=ocp.StandardCheckpointHandler(),
            meta=ocp.JsonCheckpointHandler(),
            checksums=ocp.JsonCheckpointHandler(),
            reference=ocp.StandardCheckpointHandler(),
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, handler_registry=registry
        )
        self._closed = False
        self._damaged: list[int] = []  # steps `restore` skipped: deleted at the next save

    def latest_step(self) -> int | None:
        """The newest complete step on disk, None if there is none (waits for a pending save)."""
        self.wait()
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """All complete steps on disk, ascending (waits for a pending save)."""
        self.wait()
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict, *, reference: Any = None) -> None:
        """Writes `state` (a pytree of arrays) and `meta` (a JSON dict) as checkpoint `step`,
        and `reference` (another pytree of arrays) when given.

        Saves on every call (the caller decides when); a step that already exists (on disk or
        being written) is left as it is, unless `restore` skipped it as damaged. Once it is
        complete, the oldest steps beyond `keep` are deleted. The arrays' checksums are
        computed on their devices first (`checksums`) and saved with them.
        """
        self._check_open()
        if not isinstance(meta, dict):
            raise TypeError(f"meta must be a dict, got {type(meta).__name__}.")
        try:
            json.dumps(meta)  # fail here, not later in the background thread
        except (TypeError, ValueError) as error:
            raise TypeError(f"meta must be JSON-serialisable: {error}") from error
        step = int(step)
        self._delete_damaged()
        if step in self._manager.all_steps():
            return
        sums = {"state": checksums(state)}
        items = dict(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        if reference is not None:
            items["reference"] = ocp.args.StandardSave(reference)
            sums["reference"] = checksums(reference)
        items["checksums"] = ocp.args.JsonSave(sums)
        self._manager.save(
            step,
            args=ocp.args.Composite(**items),
            force=True,  # bypass Orbax's save-interval policy: the trainer decides
        )

    def compile_checksums(self, *trees: Any) -> None:
        """Compiles the checksum program `save` runs for trees like these (same structure,
        shapes, dtypes and shardings; None is skipped) now, so the first save compiles
        nothing."""
        for tree in trees:
            if tree is not None:
                _tree_checksums.lower(tree).compile()

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
        """(state, meta) of `step`, restored into `abstract_state` and checked against its
        saved checksums; by default the newest intact step.

        `abstract_state` has the structure of the saved state, with leaves that are
        `jax.ShapeDtypeStruct`s carrying a sharding, or arrays: each restored leaf takes its
        dtype and sharding, and NamedTuples and optax states come back as themselves. A leaf
        restored in another dtype than it was saved in cannot be checked.

        Without `step`, a damaged step (files that cannot be read, or arrays that differ from
        their checksums) is skipped with a warning that names it and why, and the step before
        it is tried; CheckpointDamaged when none is intact. With `step`, a damaged step is
        CheckpointDamaged. A target that does not fit the saved tree is a ValueError naming
        the leaves.
        """
        self._check_open()
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"No checkpoint to restore in {self.directory}.")
        if step is not None and step not in steps:
            raise FileNotFoundError(
                f"No checkpoint for step {step} in {self.directory}; it holds steps {steps}."
            )
        problems = {}  # step -> why it is damaged
        for candidate in [step] if step is not None else reversed(steps):
            restored, problem = self._restore_checked(candidate, "state", abstract_state)
            if problem is None:
                self._damaged += list(problems)
                return restored.state, restored.meta
            problems[candidate] = problem
            if step is None:
                logger.warning(
                    "checkpoint step %d in %s is damaged (%s); skipping it, it is deleted at "
                    "the next save.",
                    candidate,
                    self.directory,
                    problem,
                )
        if step is not None:
            raise CheckpointDamaged(
                f"Checkpoint step {step} in {self.directory} is damaged: {problem}; restore "
                "another step, or delete this one."
            )
        listed = "; ".join(f"step {bad}: {why}" for bad, why in problems.items())
        raise CheckpointDamaged(
            f"No intact checkpoint in {self.directory}: {listed}. Move the folder away to "
            "start afresh."
        )

    def restore_reference(self, abstract_reference: Any, step: int) -> Any | None:
        """The `reference` saved with `step`, restored into `abstract_reference` and checked
        as `restore` does the state; None when that step was saved without one.
        CheckpointDamaged when it is damaged."""
        self._check_open()
        self.wait()
        if self._manager.item_metadata(step).get("reference") is None:
            return None
        restored, problem = self._restore_checked(step, "reference", abstract_reference)
        if problem is not None:
            raise CheckpointDamaged(
                f"The KL reference saved with checkpoint step {step} in {self.directory} is "
                f"damaged: {problem}; delete {self.directory / str(step)} to resume from the "
                "step before."
            )
        return restored.reference

    def restore_meta(self, step: int | None = None) -> dict:
        """The meta dict of `step` (default: the latest), without reading any array."""
        steps = self.all_steps()
        if not steps or (step is not None and step not in steps):
            raise FileNotFoundError(f"No checkpoint for step {step} in {self.directory}.")
        chosen = steps[-1] if step is None else step
        restored = self._manager.restore(
            chosen, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
        )
        return restored.meta

    def wait(self) -> None:
        """Blocks until a pending background save is on disk; raises if it failed."""
        if not self._closed:
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for a pending save, then releases Orbax's threads. Closing twice is harmless."""
        if not self._closed:
            self._manager.close()  # waits for the pending save first
            self._closed = True

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"The Checkpointer of {self.directory} is closed.")

    def _restore_checked(self, step: int, item: str, target: Any) -> tuple[Any, str | None]:
        """(what Orbax restored, None), or (None, why the step is damaged): `item` (with the
        meta, for the state) of `step` read into `target`, then its checksums compared.

        Every process learns whether every other read its shards, before the checksums
        (a collective) run, so all of them agree on the outcome."""
        stored_sums = None
        items = {item: ocp.args.StandardRestore(target)}
        if item == "state":
            items["meta"] = ocp.args.JsonRestore()
        try:
            self._check_target(step, target, item)
            if "checksums" in self._manager.item_metadata(step):  # saved with them
                items["checksums"] = ocp.args.JsonRestore()
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
            if "checksums" in items:
                stored_sums = restored.checksums[item]
            problem = None
        except _TargetMismatch:
            raise
        except Exception as error:  # noqa: BLE001 (tensorstore raises plain Exceptions)
            restored, problem = None, f"its files cannot be read: {_first_line(error)}"
        if not distributed.agree_all(problem is None):
            return None, problem or "its files cannot be read on another process"
        if stored_sums is None:  # saved before checksums existed
            return restored, None
        stored_dtypes = {
            name: leaf.dtype
            for name, leaf in _flat_names(self._manager.item_metadata(step)[item]).items()
        }
        restored_leaves = _flat_names(getattr(restored, item))
        comparable = {  # a leaf restored in another dtype has other bits
            name: leaf
            for name, leaf in restored_leaves.items()
            if jnp.dtype(leaf.dtype) == jnp.dtype(stored_dtypes[name])
        }
        found = checksums(comparable)
        differ = sorted(name for name, value in found.items() if stored_sums.get(name) != value)
        if not differ:
            return restored, None
        listed = ", ".join(differ[:_MAX_LISTED]) + (" ..." if len(differ) > _MAX_LISTED else "")
        return None, f"{len(differ)} array(s) differ from their saved checksums ({listed})"

    def _delete_damaged(self) -> None:
        """Deletes the steps `restore` skipped as damaged: they would stay the newest steps."""
        for step in self._damaged:
            if step in self._manager.all_steps():
                logger.warning(
                    "deleting the damaged checkpoint step %d in %s", step, self.directory
                )
                self._manager.delete(step)
        self._damaged = []

    def _check_target(self, step: int, abstract_state: Any, item: str = "state") -> None:
        """Raises ValueError naming every leaf whose path or shape differs from the stored
        `item` (the state, or the reference).

        Orbax names neither the leaf nor the directory on a shape mismatch, and it would put
        leaves without a sharding on one device (a full model on device 0).
        """
        stored = ocp.tree.to_flat_dict(self._manager.item_metadata(step)[item])
        target = ocp.tree.to_flat_dict(abstract_state)
        name = ".".join
        shape = lambda leaf: tuple(getattr(leaf, "shape", ()))  # () for Python scalars
        problems = [f"{name(k)}: in the checkpoint only" for k in stored.keys() - target.keys()]
        problems += [f"{name(k)}: in the target only" for k in target.keys() - stored.keys()]
        problems += [
            f"{name(k)}: shape {shape(stored[k])} in the checkpoint, target {shape(target[k])}"
            for k in stored.keys() & target.keys()
            if shape(stored[k]) != shape(target[k])
        ]
        if problems:
            problems.sort()
            listed = "\n  ".join(problems[:_MAX_LISTED])
            more = len(problems) - _MAX_LISTED
            raise _TargetMismatch(
                f"Checkpoint step {step} in {self.directory} does not match the target {item} "
                f"(a different model or optimizer?):\n  {listed}"
                + (f"\n  ... and {more} more" if more > 0 else "")
            )
        unsharded = [
            name(key)
            for key, leaf in target.items()
            if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is None
        ]
        if unsharded:
            raise _TargetMismatch(
                "Every jax.ShapeDtypeStruct in the target needs a sharding (Orbax would put the "
                f"leaf on one device); these have none: {', '.join(sorted(unsharded))}."
            )


def _first_line(error: BaseException) -> str:
    """The root cause of an exception, its type and the first line of its message (Orbax
    wraps TensorStore's precise error in one that prints pages of its spec)."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"
