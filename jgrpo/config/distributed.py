"""The `distributed` section: how `jax.distributed` is started."""

from __future__ import annotations

import dataclasses

from jgrpo._checks import check_choice
from jgrpo.config.fields import ConfigError, option
from jgrpo.distributed import INITIALIZE_CHOICES


@dataclasses.dataclass(frozen=True)
class DistributedSection:
    """Multi-host runs (the same command on every host): how `jax.distributed` is started."""

    initialize: str = option(
        "auto",
        "start jax.distributed: auto (when set below or a cluster is detected), always, never",
    )
    coordinator_address: str | None = option(
        None, "host:port of process 0 (None: from the cluster, or JAX_COORDINATOR_ADDRESS)"
    )
    num_processes: int | None = option(None, "processes in the run (None: from the cluster)")
    process_id: int | None = option(None, "this process's index, 0-based (None: from the cluster)")

    def check(self):
        check_choice("distributed.initialize", self.initialize, INITIALIZE_CHOICES, ConfigError)
        if self.num_processes is not None and self.num_processes < 1:
            raise ConfigError(
                f"distributed.num_processes must be >= 1 or null, got {self.num_processes}."
            )
        if self.process_id is not None:
            limit = self.num_processes
            if self.process_id < 0 or (limit is not None and self.process_id >= limit):
                raise ConfigError(
                    f"distributed.process_id must be in [0, distributed.num_processes) = "
                    f"[0, {limit}), got {self.process_id}."
                )
