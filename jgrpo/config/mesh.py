"""The `mesh` section: the (data, fsdp, tensor) device mesh."""

from __future__ import annotations

import dataclasses

from jgrpo.config.fields import ConfigError, option


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """How the devices form the (data, fsdp, tensor) mesh; see docs/scaling.md."""

    data: int = option(1, "data-parallel replicas, each with whole parameters (-1: the rest)")
    fsdp: int = option(
        -1, "data parallel with parameters and optimizer state sharded (-1: the rest)"
    )
    tensor: int = option(1, "tensor parallel: heads, MLP and vocabulary split (-1: the rest)")
    devices: int = option(-1, "build the mesh from the first N devices (-1: all of them)")
    memory_budget_gib: float | None = option(
        None, "device memory for the start-up check (None: the device's own limit; CPU: none)"
    )

    def check(self):
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for name, size in sizes.items():
            if size == 0 or size < -1:
                raise ConfigError(f"mesh.{name} must be >= 1 or -1 (the rest), got {size}.")
        if list(sizes.values()).count(-1) > 1:
            raise ConfigError(
                f"at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1, got {sizes}."
            )
        if self.devices == 0 or self.devices < -1:
            raise ConfigError(f"mesh.devices must be >= 1 or -1 (all), got {self.devices}.")
        if self.memory_budget_gib is not None and self.memory_budget_gib <= 0:
            raise ConfigError(
                f"mesh.memory_budget_gib must be > 0 or null, got {self.memory_budget_gib}."
            )

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data, self.fsdp, self.tensor)
