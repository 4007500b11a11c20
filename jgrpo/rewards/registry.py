"""Built-in reward functions by name, and the `task.rewards` config spec that picks them.

    rewards = "math:1.0, think_answer_format:0.2"   ->   ({name: fn}, {name: weight})

Names are also the metric keys (`reward/<name>/mean`, `/std`), so each component is logged apart.
"""

from __future__ import annotations

import functools

from jgrpo.rewards.scoring import RewardFn


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
    """'name[:weight], ...' (weight 1.0 when left out) -> (functions, weights)."""
    known = builtin_rewards()
    functions: dict[str, RewardFn] = {}
    weights: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, _, weight = part.partition(":")
        name = name.strip()
        if name not in known:
            raise ValueError(
                f"unknown reward {name!r} in {spec!r}; built-in rewards: {', '.join(known)}."
            )
        try:
            weights[name] = float(weight) if weight.strip() else 1.0
        except ValueError:
            raise ValueError(
                f"reward weight {weight!r} for {name!r} in {spec!r} is not a number."
            ) from None
        functions[name] = known[name]
    if not functions:
        raise ValueError(f"reward spec {spec!r} names no reward; e.g. 'math:1.0,tag_count:0.2'.")
    return functions, weights
