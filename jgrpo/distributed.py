"""Several processes, one program: JAX's multi-controller runtime for multi-host runs.

On a multi-host TPU slice (or several GPU hosts) the same `python -m jgrpo.train` runs on every
host. `initialize` starts `jax.distributed` before JAX touches a device; after that
`jax.devices()` lists every device of every host and one mesh spans them all.

Each process then works on its own rows. Batches are split over the mesh's batch axes, so a
process's devices hold a contiguous block of every row-sharded array (`RowBlock`): it encodes
only those prompts, reads back only those completions, scores them with the verifiers on its
own CPUs, and builds its part of the update batch. Groups never straddle devices, so group
statistics are the same as on one host. Per-row values that metrics need are gathered with
`RowBlock.gather`; only process 0 writes metrics, logs and exported files, while every process
takes part in checkpoints (orbax coordinates them).
"""

from __future__ import annotations

import logging
import pathlib
import secrets
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

logger = logging.getLogger("jgrpo.distributed")

INITIALIZE_CHOICES = ("auto", "always", "never")


class DistributedError(RuntimeError):
    """jax.distributed could not start; the message names the config keys to set."""


def initialize(
    mode: str = "auto",
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> bool:
    """Starts `jax.distributed` when this process is one of several; True if it is running.

    mode "auto": start it when any of the three settings is given, or when JAX detects a
    cluster by itself (Cloud TPU VMs, SLURM, Open MPI, Kubernetes, JAX_COORDINATOR_ADDRESS);
    otherwise run as a single process. "always": start it or fail. "never": do not.
    Must run before anything else asks JAX for a device.
    """
    if mode not in INITIALIZE_CHOICES:
        raise DistributedError(
            f"distributed.initialize must be one of {INITIALIZE_CHOICES}, got {mode!r}."
        )
    if jax.distributed.is_initialized():
        return True
    if mode == "never":
        return False
    explicit = {
        name: value
        for name, value in (
            ("coordinator_address", coordinator_address),
            ("num_processes", num_processes),
            ("process_id", process_id),
        )
        if value is not None
    }
    if _backends_started():
        if mode == "auto" and not explicit:
            return False  # in a notebook or a test JAX already runs: one process is the run
        raise DistributedError(
            "jax.distributed must start before JAX uses any device, and this process already "
            "has; call jgrpo.distributed.initialize first thing (python -m jgrpo.train does)."
        )
    try:
        jax.distributed.initialize(**explicit)
    except ValueError as error:  # no cluster detected and not every setting given
        if mode == "auto" and not explicit:
            logger.debug("running as a single process (%s)", error)
            return False
        raise DistributedError(
            f"jax.distributed could not start: {error} Set distributed.coordinator_address "
            "(host:port of process 0), distributed.num_processes and distributed.process_id "
            "on every process, or launch where JAX detects the cluster (Cloud TPU, SLURM, "
            "Open MPI)."
        ) from error
    logger.info(
        "jax.distributed: process %d of %d, %d local devices of %d",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return True


def _backends_started() -> bool:
    """Whether JAX has already created its devices (then jax.distributed can no longer start)."""
    from jax._src import xla_bridge  # no public equivalent

    return xla_bridge.backends_are_initialized()


def is_primary() -> bool:
    """Process 0 writes metrics, logs and exports."""
    return jax.process_index() == 0


class RowBlock:
    """The rows of batch-sharded arrays that this process holds.

    A row sharding splits R rows into `parts` equal chunks over the batch's mesh axes; this
    process's devices hold chunks [first, stop), which must be contiguous. Processes whose
    devices differ only along other mesh axes hold the same chunks (replicas); `gather` keeps
    one copy of each.
    """

    def __init__(self, rows: NamedSharding):
        self.parts = _parts(rows)
        chunks = sorted(
            {index[0].indices(self.parts)[0] for index in _local_indices(rows, self.parts)}
        )
        if chunks != list(range(chunks[0], chunks[-1] + 1)):
            raise ValueError(
                f"process {jax.process_index()} holds row chunks {chunks} of {self.parts}, not a "
                "contiguous block; build the mesh with jax.make_mesh's device order."
            )
        self.first, self.stop = chunks[0], chunks[-1] + 1
        self.single = jax.process_count() == 1
        if not self.single:  # which processes hold distinct blocks, in row order
            blocks = multihost_utils.process_allgather(np.array([self.first, self.stop]))
            firsts = {}
            for process, (first, _) in enumerate(blocks.tolist()):
                firsts.setdefault(first, process)
            self._owners = [firsts[first] for first in sorted(firsts)]

    def bounds(self, num_rows: int) -> tuple[int, int]:
        """[start, stop) of this process's rows among `num_rows` (divisible by `parts`)."""
        if num_rows % self.parts:
            raise ValueError(f"{num_rows} rows do not split into {self.parts} equal parts.")
        size = num_rows // self.parts
        return self.first * size, self.stop * size

    def num_rows(self, local_rows: int) -> int:
        """The global row count of which this process holds `local_rows`."""
        return local_rows * self.parts // (self.stop - self.first)

    def take(self, items: Sequence):
        """This process's part of a sequence of rows."""
        start, stop = self.bounds(len(items))
        return items[start:stop]

    def to_global(self, local, sharding: NamedSharding) -> jax.Array:
        """One global array, split by rows as `sharding` says, from each process's block."""
        local = np.asarray(local)
        shape = (self.num_rows(local.shape[0]), *local.shape[1:])
        if self.single:
            return jax.device_put(local, sharding)
        return jax.make_array_from_process_local_data(sharding, local, shape)

    def local(self, array: jax.Array) -> np.ndarray:
        """This process's block of rows of a global array, on the host."""
        if array.is_fully_addressable:
            return self.take(np.asarray(array))
        shards = {}  # first row -> rows held here (replicas once)
        for shard in array.addressable_shards:
            shards.setdefault(shard.index[0].indices(array.shape[0])[0], np.asarray(shard.data))
        first = min(shards)
        held = np.concatenate([shards[row] for row in sorted(shards)], axis=0)
        start, stop = self.bounds(array.shape[0])
        if not first <= start or stop - first > len(held):
            raise ValueError(
                f"an array of shape {array.shape} does not hold this process's rows "
                f"[{start}, {stop}) on its devices; shard it by rows."
            )
        return held[start - first : stop - first]

    def gather(self, local) -> np.ndarray:
        """Every process's block, concatenated in row order (one copy of replicated blocks).

        Called by every process with arrays of the same shape.
        """
        local = np.asarray(local)
        if self.single:
            return local
        stacked = multihost_utils.process_allgather(local)  # [processes, ...]
        return np.concatenate([stacked[p] for p in self._owners], axis=0)


def agree_any(flag: bool) -> bool:
    """True on every process when `flag` is true on any (a collective: all must call it)."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.any(multihost_utils.process_allgather(np.array(bool(flag)))))


def agree_max(value: int) -> int:
    """The largest of every process's `value`, on every process (a collective)."""
    if jax.process_count() == 1:
        return int(value)
    return int(np.max(multihost_utils.process_allgather(np.array(int(value)))))


def agree_max_each(values: Sequence[int]) -> list[int]:
    """The largest of every process's `values[i]` for each i, on every process (a collective)."""
    if jax.process_count() == 1:
        return [int(value) for value in values]
    gathered = multihost_utils.process_allgather(np.asarray(values, np.int64))  # [processes, n]
    return [int(value) for value in np.max(gathered, axis=0)]


def agree_all(flag: bool) -> bool:
    """True on every process when `flag` is true on all of them (a collective)."""
    return not agree_any(not flag)


def check_shared_directory(directory: pathlib.Path) -> None:
    """Fails on every process unless all of them see the same `directory` (orbax writes each
    process's shards of a checkpoint into it, so it must be shared storage)."""
    if jax.process_count() == 1:
        return
    token = int(multihost_utils.broadcast_one_to_all(np.array(secrets.randbits(31))))
    marker = directory / f".jgrpo-shared-{token}"
    if is_primary():
        marker.write_text("written by process 0\n")
    multihost_utils.sync_global_devices("jgrpo: shared directory written")
    seen = agree_all(marker.exists())
    multihost_utils.sync_global_devices("jgrpo: shared directory checked")
    if is_primary():
        marker.unlink()
    if not seen:
        raise DistributedError(
            f"train.run_dir={directory} is not the same directory on every host (a file "
            "written there by process 0 is missing on another); put it on storage all hosts "
            "mount (NFS, Filestore, a gcsfuse-mounted bucket)."
        )


def _parts(rows: NamedSharding) -> int:
    """Into how many chunks the sharding splits the rows."""
    (batch_axes, *_) = (*rows.spec, None)
    if batch_axes is None:
        return 1
    names = (batch_axes,) if isinstance(batch_axes, str) else batch_axes
    return int(np.prod([rows.mesh.shape[name] for name in names]))


def _local_indices(rows: NamedSharding, parts: int):
    shape = (parts,) + (1,) * (len(rows.spec) - 1)
    return rows.addressable_devices_indices_map(shape).values()


def host_params(params):
    """The parameters whole on this process: as they are when its devices hold every shard,
    else gathered from every process into host memory (a collective: all must call it)."""
    leaves = jax.tree.leaves(params)
    if all(getattr(leaf, "is_fully_addressable", True) for leaf in leaves):
        return params
    return multihost_utils.process_allgather(params, tiled=True)
