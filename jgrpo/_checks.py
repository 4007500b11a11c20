"""Argument checks shared by the pure functions: errors that name the argument and the fix.

They look only at static facts (shapes, dtypes, Python values), so they cost nothing under
`jax.jit` and never force a device sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def check_choice(
    name: str, value: Any, accepted: Sequence[Any], error: type[ValueError] = ValueError
) -> None:
    """Raises `error` naming `name` and the accepted values if `value` is not one of them."""
    if value not in accepted:
        options = ", ".join(repr(a) for a in accepted)
        raise error(f"{name} must be one of {options}; got {value!r}.")


def check_shape(
    name: str,
    array: Any,
    *,
    ndim: int | None = None,
    like: tuple[str, Any] | None = None,
    shape: tuple[int, ...] | None = None,
) -> None:
    """Raises ValueError naming `name` when its rank or shape is not the expected one.

    `like=(other_name, other_array)` requires the same shape as the other argument;
    `shape` requires an exact shape.
    """
    actual = tuple(array.shape)
    if ndim is not None and len(actual) != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {actual}.")
    if like is not None:
        other_name, other = like
        if actual != tuple(other.shape):
            raise ValueError(
                f"{name} must have the same shape as {other_name} {tuple(other.shape)}, "
                f"got {actual}."
            )
    if shape is not None and actual != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {actual}.")
