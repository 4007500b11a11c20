"""The config tree: Config, one field per section, with the checks across sections."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jgrpo.config.algorithm import AlgorithmSection
from jgrpo.config.distributed import DistributedSection
from jgrpo.config.fields import ConfigError
from jgrpo.config.mesh import MeshSection
from jgrpo.config.model import ModelSection
from jgrpo.config.optim import OptimSection
from jgrpo.config.reward_model import RewardModelSection
from jgrpo.config.rollout import RolloutSection
from jgrpo.config.task import TaskSection
from jgrpo.config.train import TrainSection


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole training config: one section per YAML mapping.

    `check()` validates every section, then that the prompts_per_step x num_generations
    sequences of a step split into num_minibatches x grad_accumulation equal parts.
    """

    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    task: TaskSection = dataclasses.field(default_factory=TaskSection)
    reward_model: RewardModelSection = dataclasses.field(default_factory=RewardModelSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    algorithm: AlgorithmSection = dataclasses.field(default_factory=AlgorithmSection)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    distributed: DistributedSection = dataclasses.field(default_factory=DistributedSection)

    def check(self) -> Config:
        for section in dataclasses.fields(self):
            _check_finite(section.name, getattr(self, section.name))
            getattr(self, section.name).check()
        rows = self.rollout.prompts_per_step * self.rollout.num_generations
        parts = self.algorithm.num_minibatches * self.algorithm.grad_accumulation
        if rows % parts:
            raise ConfigError(
                f"rollout.prompts_per_step x rollout.num_generations = {rows} sequences must "
                f"divide into algorithm.num_minibatches x algorithm.grad_accumulation = {parts} "
                "equal parts; change one of them."
            )
        if self.model.lora_rank and self.algorithm.ref_sync_steps:
            raise ConfigError(
                "algorithm.ref_sync_steps moves the KL reference, and with LoRA "
                f"(model.lora_rank={self.model.lora_rank}) the reference is the frozen base "
                "itself: set algorithm.ref_sync_steps=0, or model.lora_rank=0."
            )
        return self

    @property
    def sampler_correction(self) -> str:
        """algorithm.sampler_correction with `auto` resolved: `token` when the rollout samples
        with bf16 weight matrices (the sampler is then not the policy being trained, as with
        TRL's vLLM sampling, which it corrects by default), `none` when it samples from the
        f32 parameters themselves."""
        chosen = self.algorithm.sampler_correction
        if chosen != "auto":
            return chosen
        return "token" if self.rollout.weights_dtype == "bfloat16" else "none"


def _check_finite(name: str, section: Any) -> None:
    """NaN and inf pass every range check (`nan <= 0` is False) and would reach the
    optimizer or the loss, so no float setting may hold one."""
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(
                f"{name}.{field.name} must be a finite number, got {value}; set a real value "
                "(a large one where you meant no limit)."
            )


_SECTIONS = {
    "model": ModelSection,
    "task": TaskSection,
    "reward_model": RewardModelSection,
    "rollout": RolloutSection,
    "algorithm": AlgorithmSection,
    "optim": OptimSection,
    "train": TrainSection,
    "mesh": MeshSection,
    "distributed": DistributedSection,
}


def field_names() -> list[str]:
    """Every dotted key of the config tree, e.g. 'rollout.num_generations'."""
    return [f"{name}.{f.name}" for name, cls in _SECTIONS.items() for f in dataclasses.fields(cls)]
