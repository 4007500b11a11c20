"""Checkpoints of the training state: Orbax, the last K kept, saved in the background.

    with Checkpointer(run_dir / "checkpoints", keep=3) as checkpointer:
        if checkpointer.latest_step() is not None:
            state, meta = checkpointer.restore(abstract_state)  # straight into the shardings
        ...
        checkpointer.save(step, state, {"data_position": i, "seed": 0, "config": config_dict})

Each step is a directory <step>/ holding `state` (the array pytree, written by tensorstore),
`meta` (a JSON dict) and, for a run whose KL reference moves (`algorithm.ref_sync_steps`), that
`reference`. Orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it once
everything is on disk, so a process killed mid-save leaves no step that `latest_step` returns;
the leftover temporary directory is deleted when the next Checkpointer opens the directory.
Old steps are deleted only after a newer one is complete, so at least one complete step remains.

Why a wrapper over `orbax.checkpoint.CheckpointManager`: it pins the choices the trainer relies
on (absolute paths, the handlers for reopening a directory, saving exactly when asked) and turns
"no checkpoint" and "a different model" into errors that name the directory and the leaf.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

_MAX_LISTED = 8  # mismatching leaves named in one error


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
            reference=ocp.StandardCheckpointHandler(),
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, handler_registry=registry
        )
        self._closed = False

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
        being written) is left as it is. Once it is complete, the oldest steps beyond `keep`
        are deleted.
        """
        self._check_open()
        if not isinstance(meta, dict):
            raise TypeError(f"meta must be a dict, got {type(meta).__name__}.")
        try:
            json.dumps(meta)  # fail here, not later in the background thread
        except (TypeError, ValueError) as error:
            raise TypeError(f"meta must be JSON-serialisable: {error}") from error
        step = int(step)
        if step in self._manager.all_steps():
            return
        items = dict(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        if reference is not None:
            items["reference"] = ocp.args.StandardSave(reference)
        self._manager.save(
            step,
            args=ocp.args.Composite(**items),
            force=True,  # bypass Orbax's save-interval policy: the trainer decides
        )

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
        """(state, meta) of `step` (default: the latest), restored into `abstract_state`.

        `abstract_state` has the structure of the saved state, with leaves that are
        `jax.ShapeDtypeStruct`s carrying a sharding, or arrays: each restored leaf takes its
        dtype and sharding, and NamedTuples and optax states come back as themselves.
        """
        self._check_open()
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"No checkpoint to restore in {self.directory}.")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise FileNotFoundError(
                f"No checkpoint for step {step} in {self.directory}; it holds steps {steps}."
            )
        self._check_target(step, abstract_state)
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
                ),
            )
        except ValueError as error:
            raise ValueError(
                f"Cannot restore step {step} from {self.directory}: {error}"
            ) from error
        return restored.state, restored.meta

    def restore_reference(self, abstract_reference: Any, step: int) -> Any | None:
        """The `reference` saved with `step`, restored into `abstract_reference` (as
        `restore` does the state); None when that step was saved without one."""
        self._check_open()
        self.wait()
        if self._manager.item_metadata(step).get("reference") is None:
            return None
        self._check_target(step, abstract_reference, item="reference")
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(reference=ocp.args.StandardRestore(abstract_reference)),
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
            raise ValueError(
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
            raise ValueError(
                "Every jax.ShapeDtypeStruct in the target needs a sharding (Orbax would put the "
                f"leaf on one device); these have none: {', '.join(sorted(unsharded))}."
            )
