"""Reading a Config: YAML plus `key=value` overrides, the demo and smoke overrides, and
the round trip through plain dicts (checkpoints).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import pathlib
import types
import typing
from collections.abc import Sequence
from typing import Any

import yaml

from jgrpo.config.fields import ConfigError
from jgrpo.config.tree import _SECTIONS, Config, field_names


def _unknown(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, field_names(), n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    return ConfigError(f"unknown config key {key!r}.{hint} See --help for every key.")


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Checks a value against a field's type (ints are accepted for floats)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        (annotation,) = [a for a in options if a is not type(None)]
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-6 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if type(value) is annotation:  # exact: True is not an int here, 1 is not a bool
        return value
    raise ConfigError(
        f"{key} must be {annotation.__name__}, got {value!r} ({type(value).__name__})."
    )


def _build(cls, values: dict[str, Any], prefix: str):
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in values.items():
        key = prefix + name
        if name not in known:
            raise _unknown(key)
        if cls is Config:
            if not isinstance(value, dict):
                raise ConfigError(f"{key} must be a mapping of its fields, got {value!r}.")
            kwargs[name] = _build(_SECTIONS[name], value, key + ".")
        else:
            kwargs[name] = _coerce(key, value, hints[name])
    return cls(**kwargs)


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise _unknown(key)
    node[parts[-1]] = value


# The built-in CPU demo: what `python -m jgrpo.train` runs without a CONFIG.yaml (overrides
# still apply on top). configs/demo.yaml holds the same values, with comments.
DEMO_OVERRIDES = (
    "task.name=addition",
    "task.max_operand=4",  # 25 problems, answers 0-8
    "model.preset=tiny",
    "rollout.prompts_per_step=32",
    "rollout.num_generations=16",
    "rollout.max_new_tokens=4",
    "rollout.max_prompt_length=8",
    "algorithm.beta=0.04",  # KL to the random init keeps the policy exploring
    "optim.lr=1e-3",
    "optim.schedule=cosine",  # the lr decays to 0 by the last step: a stable end
    "train.steps=500",
    "train.eval_every=50",
    "train.save_every=100",
    "train.run_dir=runs/demo",
)


# `smoke` on the command line: a quick CPU check of any recipe with the tiny model initialised
# from scratch (and a character tokenizer), a few rows and two steps.
SMOKE_OVERRIDES = (
    "model.path=null",
    "model.preset=tiny",
    "model.dtype=float32",
    "rollout.prompts_per_step=2",
    "rollout.num_generations=2",
    "rollout.max_new_tokens=8",
    "rollout.max_prompt_length=2048",  # one token per character
    "algorithm.num_minibatches=1",
    "algorithm.grad_accumulation=1",
    "algorithm.max_extra_rollouts=1",
    "mesh.devices=1",
    "task.eval_size=2",
    "task.num_examples=64",
    "task.held_out=0",
    "train.steps=2",
    "train.eval_every=2",
    "train.save_every=2",
    "train.run_dir=runs/smoke",
)


def with_smoke(overrides: Sequence[str]) -> list[str]:
    """The word `smoke` among the overrides becomes SMOKE_OVERRIDES, placed before the others."""
    if "smoke" not in overrides:
        return list(overrides)
    return [*SMOKE_OVERRIDES, *(o for o in overrides if o != "smoke")]


def load_config(path: str | pathlib.Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """The validated Config: defaults, then the YAML file (if any), then each override.

    Each override is a `section.key=value` string whose value is parsed as YAML (`null` is
    None); later ones win. The word `smoke` puts SMOKE_OVERRIDES before the others (a quick
    CPU check of any recipe). The YAML file holds one mapping per section. Raises ConfigError
    naming the key for an unknown key (with the closest valid ones), a wrong type or an
    impossible value.

    Without a path this is the plain defaults, not the demo that `python -m jgrpo.train` runs
    without a YAML file (that one learns sums of 0-4, the defaults' task those of 0-9):
    `demo_config(overrides)` is the CLI's config.
    """
    overrides = with_smoke(overrides)
    tree: dict[str, Any] = {}
    if path is not None:
        tree = _read_yaml(pathlib.Path(path))
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {override!r} must look like section.key=value.")
        if key.strip() not in field_names():
            raise _unknown(key.strip())
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as error:
            raise ConfigError(
                f"override {override!r}: the value is not valid YAML ({_yaml_problem(error)}); "
                f"fix it, or quote a string inside the shell's quotes: \"{key.strip()}='{text}'\"."
            ) from None
        _set_dotted(tree, key.strip(), value)
    return _build(Config, tree, "").check()


def demo_config(overrides: Sequence[str] = ()) -> Config:
    """What `python -m jgrpo.train [overrides]` runs without a YAML file: the defaults, then
    DEMO_OVERRIDES (configs/demo.yaml), then the word `smoke`'s and each of `overrides`.

    Use it from Python to evaluate or resume a run started that way: `load_config(None)` is
    the plain defaults, whose task differs."""
    return load_config(None, [*DEMO_OVERRIDES, *with_smoke(overrides)])


def _read_yaml(path: pathlib.Path) -> dict[str, Any]:
    """The mapping of sections a YAML config file holds; ConfigError naming the file when it
    is a folder, not UTF-8 or not valid YAML (a missing file raises FileNotFoundError)."""
    if path.is_dir():
        raise ConfigError(
            f"{path} is a folder, not a config file; give a YAML file (e.g. configs/demo.yaml)."
        )
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path} is not UTF-8 text (byte {error.start}: {error.reason}); save it as UTF-8."
        ) from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(error)}; fix it.") from None
    if not isinstance(loaded, dict):
        kind = type(loaded).__name__
        raise ConfigError(f"{path} must hold a mapping of sections, got {kind}.")
    return loaded


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's error in one line: the problem and where (line and column, from 1)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    if mark is None:
        return problem
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"


def to_dict(config: Config) -> dict[str, Any]:
    """The config as plain nested dicts (for YAML, JSON logs and checkpoints)."""
    return dataclasses.asdict(config)


def changed_settings(saved: dict[str, Any], config: Config) -> list[str]:
    """`key: old -> new` for each setting of `config` that differs from `saved`, a `to_dict`
    tree read back from JSON (a checkpoint's); keys only one side has are left out."""

    def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    old = flat(saved)
    new = flat(json.loads(json.dumps(to_dict(config))))  # tuples as lists, as saved
    return [
        f"{key}: {old[key]!r} -> {new[key]!r}" for key in new if key in old and old[key] != new[key]
    ]


def from_dict(tree: dict[str, Any]) -> Config:
    """The inverse of `to_dict` (e.g. the config stored in a checkpoint), validated."""
    return _build(Config, tree, "").check()
