"""Device meshes and the one rules table that places every array by its logical axis names.

Mesh axes:
- `data`: data parallel replicas; each holds whole parameters and a slice of the batch.
- `fsdp`: data parallel with parameters, optimizer state and reference parameters sharded
  over the `embed` dimension (gathered layer by layer when used).
- `tensor`: tensor parallel; attention heads, MLP units and the vocabulary split.

A mixture of experts puts whole experts on each `fsdp` device (expert parallelism): tokens
travel to their experts (`jgrpo.models.mlp.mixture_of_experts`), the experts' weights
stay where they are.

Batches (prompts, completions, KV caches) are split over data x fsdp. Rows of a group sit on
the device of their prompt: a group is never split across devices.

The models name every dimension (`layers`, `embed`, `heads`, ...; see
`jgrpo.models.transformer.param_axes`); `LOGICAL_RULES` maps those names to mesh axes. A dimension
that a mesh axis does not divide (say 2 kv heads over tensor = 4) stays whole on each device:
`logical_sharding` drops that mesh axis for that array only.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes. The first rule whose mesh axes are still free in an array wins;
# a logical axis with no rule (or only taken mesh axes) is replicated.
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    # mixture of experts: whole experts on each device (expert parallelism), before `embed`
    # takes fsdp; experts that fsdp does not divide are split by `embed` as a dense MLP is
    ("expert", "fsdp"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("layers", None),
    ("length", None),
    ("head_dim", None),
    ("lora_rank", None),  # LoRA adapters' rank: small, replicated
)


class MeshError(ValueError):
    """A mesh shape that does not fit the devices; the message names the field and the fix."""


def resolve_mesh_shape(
    shape: Sequence[int], num_devices: int, *, names: Sequence[str] = MESH_AXES
) -> tuple[int, ...]:
    """Sizes of the mesh axes with one -1 replaced by the devices left over."""
    shape = [int(s) for s in shape]
    if len(shape) != len(names):
        raise MeshError(f"a mesh needs {len(names)} sizes ({', '.join(names)}), got {shape}.")
    if shape.count(-1) > 1:
        raise MeshError(f"at most one mesh size may be -1 (the rest of the devices), got {shape}.")
    for name, size in zip(names, shape, strict=True):
        if size == 0 or size < -1:
            raise MeshError(f"mesh.{name} must be >= 1 or -1, got {size}.")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise MeshError(
                f"the mesh sizes {dict(zip(names, shape, strict=True))} leave no whole size for "
                f"the -1 axis with {num_devices} devices; make the fixed sizes divide "
                f"{num_devices}."
            )
        shape[shape.index(-1)] = num_devices // known
    elif known != num_devices:
        raise MeshError(
            f"the mesh {dict(zip(names, shape, strict=True))} has {known} devices but "
            f"{num_devices} are available; set one size to -1 to use the rest."
        )
    return tuple(shape)


def make_mesh(shape: Sequence[int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all), sizes as in the config."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_mesh_shape(shape, len(devices))
    return jax.make_mesh(
        sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


def logical_spec(
    shape: Sequence[int], axes: Sequence[str | None], mesh: Mesh, rules=LOGICAL_RULES
) -> PartitionSpec:
    """The partition of an array of `shape` whose dimensions are named `axes`.

    Mesh axes that do not divide their dimension are dropped (that dimension is then split
    over the mesh axes that do, or kept whole), and so are axes of size 1. An `expert`
    dimension left whole that way leaves its mesh axis to the array's other dimensions (the
    experts are then split as a dense MLP is).
    """
    if len(shape) != len(axes):
        raise ValueError(f"{len(axes)} axis names {tuple(axes)} for an array of shape {shape}.")
    spec = _fitted_spec(shape, axes, mesh, rules)
    if "expert" in axes and spec[list(axes).index("expert")] is None:
        spec = _fitted_spec(shape, axes, mesh, tuple(r for r in rules if r[0] != "expert"))
    return spec


def _fitted_spec(shape, axes, mesh, rules) -> PartitionSpec:
    """The rules' partition of the array, less the mesh axes that do not divide their
    dimension or have size 1."""
    spec = nn.logical_to_mesh_axes(tuple(axes), rules)
    fitted = []
    for size, assigned in zip(shape, spec, strict=True):
        mesh_axes = _mesh_axes(assigned)
        kept, split = [], 1
        for axis in mesh_axes:
            if mesh.shape[axis] > 1 and size % (split * mesh.shape[axis]) == 0:
                kept.append(axis)
                split *= mesh.shape[axis]
        fitted.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*fitted)


def shard_count(shape: Sequence[int], axes: Sequence[str | None], mesh, rules=LOGICAL_RULES) -> int:
    """Into how many pieces `logical_spec` cuts an array of `shape` with dimensions `axes`
    (`mesh`: a Mesh or the abstract mesh of a trace): its bytes per device are the total
    divided by this."""
    spec = logical_spec(shape, axes, mesh, rules)
    return math.prod(mesh.shape[axis] for entry in spec for axis in _mesh_axes(entry))


def traced_shard_count(shape: Sequence[int], axes: Sequence[str | None]) -> int:
    """`shard_count` under the mesh and logical rules being traced under
    (`rules_context`); 1 outside them."""
    mesh, rules = jax.sharding.get_abstract_mesh(), nn.get_logical_axis_rules()
    if mesh.empty or not rules:
        return 1
    return shard_count(shape, axes, mesh, rules)


def logical_sharding(
    shape: Sequence[int], axes: Sequence[str | None], mesh: Mesh, rules=LOGICAL_RULES
) -> NamedSharding:
    return NamedSharding(mesh, logical_spec(shape, axes, mesh, rules))


def tree_shardings(shapes, axes, mesh: Mesh, rules=LOGICAL_RULES):
    """NamedShardings for a pytree of arrays (or ShapeDtypeStructs) and a matching pytree of
    axis-name tuples."""
    return jax.tree.map(
        lambda names, leaf: logical_sharding(np.shape(leaf), names, mesh, rules),
        axes,
        shapes,
        is_leaf=_is_axis_names,
    )


def _is_axis_names(x) -> bool:
    """A tuple of axis names (a leaf of an axes tree), not a NamedTuple of them."""
    return type(x) is tuple and bool(x) and all(isinstance(a, str) or a is None for a in x)


def abstract_arrays(tree, shardings):
    """ShapeDtypeStructs of a pytree of arrays (or ShapeDtypeStructs) with the given
    shardings: arguments for compiling a program ahead of time (`jit(f).lower(...)`)."""
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=sharding),
        tree,
        shardings,
    )


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def row_shardings(mesh: Mesh, rules=LOGICAL_RULES) -> tuple[NamedSharding, NamedSharding]:
    """Shardings of per-row arrays [B] and [B, T]: rows split over the batch's mesh axes
    (B must be divisible by their product)."""
    split = math.prod(
        mesh.shape[axis] for axis in _mesh_axes(dict(rules).get("batch")) if axis in mesh.shape
    )
    (axes,) = logical_spec((split,), ("batch",), mesh, rules)
    return NamedSharding(mesh, PartitionSpec(axes)), NamedSharding(mesh, PartitionSpec(axes, None))


def _mesh_axes(assigned) -> tuple[str, ...]:
    return () if assigned is None else (assigned,) if isinstance(assigned, str) else tuple(assigned)


def optimizer_state_shardings(
    optimizer: optax.GradientTransformation, abstract_state, param_shardings, mesh: Mesh
):
    """Shardings of an optax state: the parameter-shaped parts (Adam's moments) as the
    parameters, everything else (step counts) replicated."""
    return optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        abstract_state,
        param_shardings,
        transform_non_params=lambda _: replicated(mesh),
    )


def rules_context(mesh: Mesh, rules=LOGICAL_RULES) -> contextlib.ExitStack:
    """The context in which the models' `constrain` calls take effect: tracing a function
    under it places its intermediate activations by the same rules."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(mesh))
    stack.enter_context(nn.logical_axis_rules(rules))
    return stack
