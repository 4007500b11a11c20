"""The helpers every config section uses: ConfigError, check_dtype, option."""

from __future__ import annotations

import dataclasses
from typing import Any


class ConfigError(ValueError):
    """A config that cannot run; the message names the field and the fix."""


def check_dtype(field: str, value: str) -> None:
    """A dtype option: float32 or bfloat16."""
    if value not in ("float32", "bfloat16"):
        raise ConfigError(f"{field} must be 'float32' or 'bfloat16', got {value!r}.")


def option(default: Any, help: str) -> Any:  # noqa: A002 (the natural name for a CLI)
    """A dataclass field with its one-line description."""
    return dataclasses.field(default=default, metadata={"help": help})
