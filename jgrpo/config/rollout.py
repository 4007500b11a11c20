"""The `rollout` section: sampling."""

from __future__ import annotations

import dataclasses

from jgrpo.config.fields import ConfigError, check_dtype, option


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """Sampling: P = prompts_per_step prompts per step, G completions each, up to N tokens."""

    prompts_per_step: int = option(8, "prompts sampled per training step")
    num_generations: int = option(8, "G: completions per prompt (the group), >= 2")
    max_new_tokens: int = option(128, "N: completion length limit in tokens")
    temperature: float = option(1.0, "sampling temperature, also used to score log-probs")
    top_p: float = option(1.0, "nucleus sampling mass (1 = off)")
    top_k: int = option(0, "sample among the k most likely tokens (0 = off)")
    min_p: float = option(0.0, "drop tokens below min_p x the top probability (0 = off)")
    max_prompt_length: int = option(
        256,
        "the longest prompt allowed (longer is an error); prompts are left-padded to the "
        "task's longest, rounded up to a multiple of 8, at most this",
    )
    weights_dtype: str = option(
        "float32",
        "weight matrices while sampling: float32 (the parameters), or bfloat16 (a copy, f32 "
        "sums: faster decoding, from the policy with its matrices rounded to bf16)",
    )
    max_concurrent: int = option(
        0,
        "sequences decoding at once: when one stops (multi-turn: when its episode ends), the "
        "step's next waiting sequence takes its slot; 0 = every sequence of the step at once",
    )
    max_turns: int = option(
        1,
        "model turns per episode when the task gives tools or an environment (each answered "
        "by them as context); 1 = single-turn",
    )
    max_total_tokens: int = option(
        0,
        "multi-turn: an episode's tokens after the prompt, the model's turns (each at most "
        "max_new_tokens) and the answers between them; 0 = max_turns x max_new_tokens",
    )
    kv_cache_mib: float | None = option(
        None,
        "KV cache per device (prompts + completion slots of completion_tokens each): chooses "
        "max_concurrent, the most slots that fit; None = no budget",
    )

    @property
    def completion_tokens(self) -> int:
        """The tokens after the prompt that a row can hold: max_new_tokens, or for multi-turn
        episodes max_total_tokens (turns and answers)."""
        if self.max_turns == 1:
            return self.max_new_tokens
        return self.max_total_tokens or self.max_turns * self.max_new_tokens

    def check(self):
        check_dtype("rollout.weights_dtype", self.weights_dtype)
        if self.num_generations < 2:
            raise ConfigError(
                f"rollout.num_generations must be >= 2 (a group needs two completions to "
                f"compare), got {self.num_generations}."
            )
        if self.temperature <= 0:
            raise ConfigError(
                f"rollout.temperature must be > 0 for training (greedy sampling gives no "
                f"exploration and no log-probs), got {self.temperature}."
            )
        for name in ("prompts_per_step", "max_new_tokens", "max_prompt_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rollout.{name} must be >= 1, got {getattr(self, name)}.")
        if self.max_turns < 1 or self.max_total_tokens < 0:
            raise ConfigError(
                f"rollout.max_turns must be >= 1 and rollout.max_total_tokens >= 0 (0: "
                f"max_turns x max_new_tokens); got {self.max_turns}, {self.max_total_tokens}."
            )
        if self.max_concurrent < 0:
            raise ConfigError(
                f"rollout.max_concurrent must be >= 0 (0 = every sequence at once), got "
                f"{self.max_concurrent}."
            )
        if self.kv_cache_mib is not None and self.kv_cache_mib <= 0:
            raise ConfigError(f"rollout.kv_cache_mib must be > 0 or null, got {self.kv_cache_mib}.")
        if self.kv_cache_mib is not None and self.max_concurrent:
            raise ConfigError(
                "rollout.kv_cache_mib chooses rollout.max_concurrent, so set one of them: "
                f"got max_concurrent={self.max_concurrent} and kv_cache_mib={self.kv_cache_mib}."
            )
        if not 0 < self.top_p <= 1 or self.top_k < 0 or not 0 <= self.min_p < 1:
            raise ConfigError(
                "rollout.top_p must be in (0, 1], rollout.top_k >= 0, rollout.min_p in [0, 1); "
                f"got top_p={self.top_p}, top_k={self.top_k}, min_p={self.min_p}."
            )
