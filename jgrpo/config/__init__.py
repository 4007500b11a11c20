"""The training config: a tree of frozen dataclasses, read from YAML plus `key=value` overrides.

    config = load_config("configs/demo.yaml", ["rollout.num_generations=16", "optim.lr=1e-6"])

Everything is validated before anything runs: an unknown key names the closest valid ones, a
wrong type or an impossible value names the field and what would be accepted. Each field
carries a one-line description, which `format_help()` lists with the defaults.

Which file holds what (to change an option, edit its section's file: its field, default,
description and `check()` are there, except the rules `algorithm` shares with the update, which
`jgrpo.update.check_update_settings` holds; docs/config.md is generated from them):

- `fields.py`: ConfigError, check_dtype, option (the helpers every section uses)
- one file per section, named after it: `model.py`, `task.py` (with TASKS), `reward_model.py`,
  `rollout.py`, `algorithm.py`, `optim.py`, `train.py`, `mesh.py`, `distributed.py`
- `tree.py`: Config (the sections together, and the checks across them), field_names
- `loading.py`: load_config, demo_config, DEMO_OVERRIDES, SMOKE_OVERRIDES, with_smoke,
  to_dict, from_dict, changed_settings
- `reference.py`: format_help (`--help`) and format_markdown (docs/config.md)
"""

from jgrpo.config.algorithm import AlgorithmSection
from jgrpo.config.distributed import DistributedSection
from jgrpo.config.fields import ConfigError, check_dtype, option
from jgrpo.config.loading import (
    DEMO_OVERRIDES,
    SMOKE_OVERRIDES,
    changed_settings,
    demo_config,
    from_dict,
    load_config,
    to_dict,
    with_smoke,
)
from jgrpo.config.mesh import MeshSection
from jgrpo.config.model import ModelSection
from jgrpo.config.optim import OptimSection
from jgrpo.config.reference import format_help, format_markdown
from jgrpo.config.reward_model import RewardModelSection
from jgrpo.config.rollout import RolloutSection
from jgrpo.config.task import TASKS, TaskSection
from jgrpo.config.train import TrainSection
from jgrpo.config.tree import Config, field_names

__all__ = [
    "DEMO_OVERRIDES",
    "SMOKE_OVERRIDES",
    "TASKS",
    "AlgorithmSection",
    "Config",
    "ConfigError",
    "DistributedSection",
    "MeshSection",
    "ModelSection",
    "OptimSection",
    "RewardModelSection",
    "RolloutSection",
    "TaskSection",
    "TrainSection",
    "changed_settings",
    "check_dtype",
    "demo_config",
    "field_names",
    "format_help",
    "format_markdown",
    "from_dict",
    "load_config",
    "option",
    "to_dict",
    "with_smoke",
]
