"""Built-in reward functions by name, and the `task.rewards` config spec that picks them.

    rewards = "math:1.0, think_answer_format:0.2"   ->   ({name: fn}, {name: weight})
    rewards = "my_rewards:exact_match:2.0, math"    ->   your own function, by import path

Names (a function's own name for an import path) are also the metric keys
(`reward/<name>/mean`, `/std`), so each component is logged apart.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import sys

from jgrpo.rewards.scoring import RewardFn


class RewardSpecError(ValueError):
    """A `task.rewards` spec names an unknown reward, a function that does not import, or gives
    a weight that is not a number."""


def builtin_rewards() -> dict[str, RewardFn]:
    """Every built-in reward function by its config name."""
    from jgrpo.rewards import format as layout
    from jgrpo.rewards import math, structured

    rewards: dict[str, RewardFn] = {
        "math": math.math_answer_reward,
        "math_strict": functools.partial(math.math_answer_reward, mode="strict"),
        "think_answer_format": layout.layout_reward,
        "tag_count": layout.tag_count_reward,
        **structured.STRUCTURED_REWARDS,
    }
    try:
        from jgrpo.rewards import code
    except ImportError:  # the code sandbox is optional (POSIX only)
        return rewards
    rewards["code_tests"] = code.code_test_reward
    rewards["code_pass_fraction"] = code.code_pass_fraction
    return rewards


def parse_reward_spec(spec: str) -> tuple[dict[str, RewardFn], dict[str, float]]:
    """'reward[:weight], ...' (weight 1.0 when left out) -> (functions, weights), where a
    reward is a built-in name or the import path `module:function` of your own function."""
    known = builtin_rewards()
    functions: dict[str, RewardFn] = {}
    weights: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        fields = [field.strip() for field in part.split(":")]
        weight = ""  # the last field, after a built-in name or when it is a number
        if len(fields) == 3 or (len(fields) == 2 and (fields[0] in known or _is_number(fields[1]))):
            weight = fields.pop()
        if len(fields) > 2:
            raise RewardSpecError(
                f"{part!r} in {spec!r} has too many ':'; write name:weight or "
                "module:function:weight."
            )
        path = ":".join(fields)
        name, function = _import_reward(path) if ":" in path else (path, known.get(path))
        if function is None:
            raise RewardSpecError(
                f"unknown reward {name!r} in {spec!r}; built-in rewards: {', '.join(known)}; "
                "or your own function as module:function (e.g. my_rewards:exact_match)."
            )
        if name in functions:
            raise RewardSpecError(
                f"two rewards named {name!r} in {spec!r} (their metric names would collide); "
                "rename one of the functions."
            )
        if not _is_number(weight or "1"):
            raise RewardSpecError(
                f"reward weight {weight!r} for {name!r} in {spec!r} is not a number; give a "
                "finite weight such as 0.5."
            )
        weights[name] = float(weight or 1.0)
        functions[name] = function
    if not functions:
        raise RewardSpecError(
            f"reward spec {spec!r} names no reward; e.g. 'math:1.0,tag_count:0.2'."
        )
    return functions, weights


def _is_number(text: str) -> bool:
    """Whether `text` is a finite number (a weight of nan or inf would make the loss NaN)."""
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _import_reward(path: str, what: str = "reward") -> tuple[str, RewardFn]:
    """'module:function' -> (function's name, function), the module imported as `python -m`
    would: with the current directory on sys.path (the reward workers get the same path).
    `what` names it in the errors (a reward, a tool)."""
    module_name, _, attribute = path.partition(":")
    if not ({"", os.getcwd()} & set(sys.path)):
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 (a user's module may raise anything as it loads)
        raise RewardSpecError(
            f"{what} {path!r}: cannot import {module_name!r} ({type(error).__name__}: {error}); "
            f"put {module_name.replace('.', '/')}.py in the current directory or on PYTHONPATH."
        ) from None
    function = getattr(module, attribute, None)
    if function is None:
        raise RewardSpecError(
            f"{what} {path!r}: module {module_name!r} ({module.__file__}) has no {attribute!r}; "
            "name a function defined there."
        )
    if not callable(function):
        raise RewardSpecError(
            f"{what} {path!r} is a {type(function).__name__}, not a function; name a function"
            + (
                " fn(prompts, completions, **fields) -> list[float | None]."
                if what == "reward"
                else "."
            )
        )
    return attribute, function
