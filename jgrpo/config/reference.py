"""The config's reference text: `--help` (format_help) and docs/config.md (format_markdown)."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any

from jgrpo.config.loading import DEMO_OVERRIDES, SMOKE_OVERRIDES
from jgrpo.config.tree import _SECTIONS, Config


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint).replace("typing.", ""))


def format_help() -> str:
    """Every key with its type, default and description, section by section."""
    lines = []
    for section, cls in _SECTIONS.items():
        lines.append(f"{section}:")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = _type_name(hints[f.name])
            lines.append(
                f"  {section}.{f.name} ({kind}, default {f.default!r}): {f.metadata['help']}"
            )
    return "\n".join(lines)


def _yaml_value(value: Any) -> str:
    """A default as it is written in YAML and overrides: null, true, 1e-06, runs/demo."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def format_markdown() -> str:
    """docs/config.md: every key as a table row per section, and how values are set.

    Written by `python scripts/reference_docs.py`; a test fails when the file is stale.
    """

    def cell(text: str) -> str:  # a table cell: | splits cells, <x> would be an HTML tag
        return text.replace("|", "\\|").replace("<", "\\<")

    out = [
        "# Configuration reference",
        "",
        "<!-- Generated from the section files of jgrpo/config/ by "
        "`python scripts/reference_docs.py`: edit the dataclasses there, not this file. -->",
        "",
        "Every key of `python -m jgrpo.train`, with its type, default and description. "
        "The same list, one line per key, is printed by `python -m jgrpo.train --help`.",
        "",
        inspect.cleandoc(Config.__doc__ or ""),
        "",
        "## Setting values",
        "",
        "```bash",
        "python -m jgrpo.train [CONFIG.yaml] [section.key=value ...] [smoke]",
        "python -m jgrpo.train configs/gsm8k-qwen2.5-0.5b.yaml optim.lr=1e-6 train.steps=300",
        "```",
        "",
        "- The YAML file holds one mapping per section (`rollout:` then an indented "
        "`num_generations: 16`); keys left out keep their defaults. configs/ has examples.",
        "- Each `section.key=value` override is parsed as YAML (`null` is None, `true` is a "
        "bool, `1e-6` a float) and applied after the file, in order; the last one wins.",
        "- Without a YAML file the [demo](#the-demo-and-smoke) is the base; your overrides "
        "apply on top of it.",
        "- The word `smoke` inserts the [smoke overrides](#the-demo-and-smoke) before yours: a "
        "quick CPU check of any recipe.",
        "- From Python: `jgrpo.config.load_config(path, overrides)` returns the validated "
        "`Config`. Without a path it starts from the defaults below, not from the demo: "
        "`jgrpo.config.demo_config(overrides)` is what the command line runs without a YAML "
        "file.",
        "- Unknown keys (with the closest valid ones), wrong types and impossible values are "
        "errors that name the key, raised before anything runs.",
        "",
        "Sections: " + ", ".join(f"[`{name}`](#{name})" for name in _SECTIONS) + ".",
    ]
    for section, cls in _SECTIONS.items():
        hints = typing.get_type_hints(cls)
        out += ["", f"## {section}", "", inspect.cleandoc(cls.__doc__ or ""), ""]
        out += ["| key | type | default | description |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            kind, default = _type_name(hints[f.name]), _yaml_value(f.default)
            out.append(
                f"| `{section}.{f.name}` | `{cell(kind)}` | `{cell(default)}` "
                f"| {cell(f.metadata['help'])} |"
            )
    out += [
        "",
        "## The demo and smoke",
        "",
        "Without a YAML file, `python -m jgrpo.train` runs the CPU demo (a tiny model learns "
        "addition from scratch): the defaults above with these overrides "
        "(configs/demo.yaml holds the same values):",
        "",
        "```text",
        *DEMO_OVERRIDES,
        "```",
        "",
        "`smoke` swaps in the tiny model from scratch (with a character tokenizer), a few rows "
        "and two steps:",
        "",
        "```text",
        *SMOKE_OVERRIDES,
        "```",
        "",
    ]
    return "\n".join(out)
