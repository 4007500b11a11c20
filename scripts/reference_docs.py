"""Writes the generated reference docs: docs/config.md and docs/api.md.

    python scripts/reference_docs.py           # rewrite both files
    python scripts/reference_docs.py --check   # exit 1, naming the file, if either is stale

docs/config.md comes from the config dataclasses (`jgrpo.config.format_markdown`). docs/api.md
comes from the code itself: `inspect.signature`, the docstrings, and the comments after each
parameter or field in the source (where the shapes are written). Neither can drift from the
code: tests/test_reference_docs.py fails when a committed file differs from what this writes.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import io
import pathlib
import re
import sys
import textwrap
import tokenize
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMMAND = "python scripts/reference_docs.py"

# Everything docs/api.md documents, section by section, in this order: to document a new
# public name, add it here. Each entry is (section title, intro, names).
API = (
    (
        "Objective",
        "Pure array functions: `import jgrpo` gives them without importing Flax. Shapes: B "
        "sequences (rows), T completion positions, V vocabulary. The math and how each setting "
        "maps onto TRL, verl and Tunix are in [objective.md](objective.md).",
        (
            "jgrpo.group_advantages",
            "jgrpo.group_statistics",
            "jgrpo.zero_signal_groups",
            "jgrpo.GroupStats",
            "jgrpo.grpo_loss",
            "jgrpo.sampler_weights",
            "jgrpo.high_entropy_mask",
            "jgrpo.off_policy_mask",
            "jgrpo.token_kl",
            "jgrpo.sequence_kl",
            "jgrpo.token_logprobs",
            "jgrpo.chunked_token_logprobs",
        ),
    ),
    (
        "Sampling and generation",
        "Completions from a `jgrpo.models` decoder. `jgrpo.rollout.rollout` is the compiled "
        "program the trainer runs on token ids; `generate` wraps it with a tokenizer, text in "
        "and text out; `run_episodes` plays multi-turn episodes. All of them run the one "
        "engine of `jgrpo.rollout`: a `DecodeState`, `prepare` and `step`. Shapes: P prompts, "
        "G generations per prompt, L prompt length, N new tokens.",
        (
            "jgrpo.rollout.rollout",
            "jgrpo.Rollout",
            "jgrpo.SamplingConfig",
            "jgrpo.generate",
            "jgrpo.Generations",
            "jgrpo.rollout.turns.run_episodes",
            "jgrpo.rollout.turns.Episodes",
            "jgrpo.rollout.DecodeState",
            "jgrpo.rollout.prepare",
            "jgrpo.rollout.step",
        ),
    ),
    (
        "Update",
        "The GRPO update as one jitted pure function: a state and a rollout batch in, the new "
        "state and metrics out.",
        (
            "jgrpo.train_step",
            "jgrpo.init_state",
            "jgrpo.make_optimizer",
            "jgrpo.TrainState",
            "jgrpo.Batch",
            "jgrpo.UpdateConfig",
        ),
    ),
    (
        "Training loop",
        "What `python -m jgrpo.train` runs, callable from Python with your own data and "
        "rewards. Every config key is listed in [config.md](config.md).",
        (
            "jgrpo.train.train",
            "jgrpo.train.evaluate",
            "jgrpo.train.TrainResult",
            "jgrpo.config.load_config",
            "jgrpo.tasks.Task",
            "jgrpo.plotting.plot_metrics",
        ),
    ),
    (
        "Models",
        "Flax NNX decoders (Llama, Qwen2/2.5, Qwen3), Hugging Face checkpoint import and "
        "export, and sequence-classification reward models. Shapes: E hidden size, K "
        "key/value heads, D head dim, S cache slots.",
        (
            "jgrpo.models.from_pretrained",
            "jgrpo.models.save_pretrained",
            "jgrpo.models.Transformer",
            "jgrpo.models.forward",
            "jgrpo.models.init_cache",
            "jgrpo.models.KVCache",
            "jgrpo.models.ModelConfig",
            "jgrpo.models.Llama3RopeScaling",
            "jgrpo.models.preset",
            "jgrpo.models.PRESETS",
            "jgrpo.models.CheckpointError",
            "jgrpo.models.load_reward_model",
            "jgrpo.models.RewardModel",
        ),
    ),
)

LINE = 92  # a signature longer than this, or with comments, gets one parameter per line


def documented_names() -> list[str]:
    return [name for _, _, names in API for name in names]


def resolve(name: str) -> Any:
    module, _, attribute = name.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


# --- Reading the source: the comment after each parameter or field, and default spellings ---


@dataclasses.dataclass
class SourceNotes:
    comments: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> comment
    annotations: dict[str, str] = dataclasses.field(default_factory=dict)  # as written
    defaults: dict[str, str] = dataclasses.field(default_factory=dict)  # as written
    returns: str | None = None  # the return annotation as written
    returns_comment: str | None = None
    bases: list[str] = dataclasses.field(default_factory=list)  # a class's, as written


def source_notes(obj: Any) -> SourceNotes:
    """What `inspect.signature` loses: comments, and annotations and defaults as written."""
    try:
        source = textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):
        return SourceNotes()
    comments = {
        token.start[0]: token.string.lstrip("#").strip()
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
    node = ast.parse(source).body[0]
    notes = SourceNotes()
    ends: dict[str, int] = {}  # the line each parameter or field ends on

    def note(name: str, annotation: ast.AST | None, default: ast.AST | None, end: int) -> None:
        ends[name] = end
        if annotation is not None:
            notes.annotations[name] = ast.get_source_segment(source, annotation)
        # A module constant (DEFAULT_BUCKETS) reads better as its value; the rest as written.
        if default is not None and not isinstance(default, ast.Name | ast.Call):
            notes.defaults[name] = ast.get_source_segment(source, default)

    if isinstance(node, ast.FunctionDef):
        args = node.args
        positional = args.posonlyargs + args.args
        defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
        pairs = list(zip(positional, defaults, strict=True))
        pairs += list(zip(args.kwonlyargs, args.kw_defaults, strict=True))
        pairs += [(arg, None) for arg in (args.vararg, args.kwarg) if arg is not None]
        for arg, default in pairs:
            end = max(arg.end_lineno, default.end_lineno if default is not None else 0)
            note(arg.arg, arg.annotation, default, end)
        if node.returns is not None:
            notes.returns = ast.get_source_segment(source, node.returns)
            # `) -> X:  # comment` is the return's, also on a one-line def.
            notes.returns_comment = comments.pop(node.returns.end_lineno, None)
    elif isinstance(node, ast.ClassDef):
        notes.bases = [ast.get_source_segment(source, base) for base in node.bases]
        for statement in node.body:
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                note(
                    statement.target.id, statement.annotation, statement.value, statement.end_lineno
                )
    shared = {line for line in ends.values() if list(ends.values()).count(line) > 1}
    for name, line in ends.items():
        if line in comments and line not in shared:
            notes.comments[name] = comments[line]
    return notes


# --- Rendering ------------------------------------------------------------------------------


def annotation_text(annotation: Any) -> str:
    if isinstance(annotation, str):
        return annotation
    if hasattr(annotation, "__forward_arg__"):
        return annotation.__forward_arg__
    if isinstance(annotation, type):
        return annotation.__qualname__
    return str(annotation).replace("typing.", "")


def value_text(value: Any) -> str:
    text = repr(value)
    if text.startswith("<") or " at 0x" in text:  # no memory addresses in generated text
        module = getattr(value, "__module__", "") or ""
        return f"{module}.{getattr(value, '__qualname__', type(value).__qualname__)}".lstrip(".")
    return text


def signature_text(label: str, signature: inspect.Signature, notes: SourceNotes) -> str:
    """`label(params) -> returns` on one line, or one parameter per line with its comment."""
    params = []  # (text, comment)
    kinds = [p.kind for p in signature.parameters.values()]
    for index, p in enumerate(signature.parameters.values()):
        bare_star = p.VAR_POSITIONAL not in kinds and p.KEYWORD_ONLY not in kinds[:index]
        if p.kind is p.KEYWORD_ONLY and bare_star:  # the `*` before keyword-only parameters
            params.append(("*", None))
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        text = prefix + p.name
        if p.annotation is not p.empty:
            text += ": " + notes.annotations.get(p.name, annotation_text(p.annotation))
        if p.default is not p.empty:
            equals = " = " if p.annotation is not p.empty else "="
            text += equals + notes.defaults.get(p.name, value_text(p.default))
        params.append((text, notes.comments.get(p.name)))
        if p.kind is p.POSITIONAL_ONLY and (index + 1 == len(kinds) or kinds[index + 1] > p.kind):
            params.append(("/", None))
    returns = ""
    if signature.return_annotation is not signature.empty:
        returns = " -> " + (notes.returns or annotation_text(signature.return_annotation))
    return_comment = f"  # {notes.returns_comment}" if notes.returns_comment else ""
    one_line = f"{label}({', '.join(text for text, _ in params)}){returns}"
    if len(one_line) <= LINE and not any(comment for _, comment in params):
        return one_line + return_comment
    lines = [f"{label}("]
    for text, comment in params:
        lines.append(f"    {text}," + (f"  # {comment}" if comment else ""))
    lines.append(f"){returns}{return_comment}")
    return "\n".join(lines)


def escape(text: str) -> str:
    """Markdown-escapes prose outside `code`: * would start emphasis, <x> an HTML tag."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("*", r"\*").replace("<", r"\<")
    return "`".join(parts)


def docstring_markdown(doc: str) -> list[str]:
    """Prose paragraphs stay prose; indented blocks (formulas, tables) become code blocks;
    `Args:` entries become a bulleted list."""
    out: list[str] = []
    for block in re.split(r"\n\s*\n", doc.strip()):
        lines = block.splitlines()
        prose = []
        while lines and not lines[0].startswith(" "):
            prose.append(lines.pop(0))
        if prose and prose[-1].strip() in ("Args:", "Returns:", "Raises:"):
            out += [*map(escape, prose[:-1]), f"**{prose[-1].strip()[:-1]}**", ""]
            for line in textwrap.dedent("\n".join(lines)).splitlines():
                entry = re.match(r"(\w+): (.*)", line)
                if entry:
                    out.append(f"- `{entry[1]}`: {escape(entry[2])}")
                else:
                    out.append(f"  {escape(line.strip())}")
        else:
            out += [escape(line) for line in prose]
            if lines:
                out += [""] if prose else []
                out += ["```text", *textwrap.dedent("\n".join(lines)).splitlines(), "```"]
        out.append("")
    return out


def own_docstring(obj: Any) -> str | None:
    """The object's own docstring: not one inherited from a base class or a constant's type,
    nor the one Python writes for a NamedTuple or dataclass."""
    if isinstance(obj, property):
        obj = obj.fget
    elif not (inspect.isclass(obj) or callable(obj)):
        return None
    doc = vars(obj).get("__doc__") if inspect.isclass(obj) else obj.__doc__
    if not doc or (inspect.isclass(obj) and doc.startswith(obj.__name__ + "(")):
        return None
    return inspect.cleandoc(doc)


def class_kind(cls: type) -> str:
    if issubclass(cls, BaseException):
        return "exception"
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return "NamedTuple (a pytree)"
    if dataclasses.is_dataclass(cls):
        return "frozen dataclass" if cls.__dataclass_params__.frozen else "dataclass"
    # Bases as the source writes them, not wherever the installed library defines them.
    return f"class ({', '.join(source_notes(cls).bases)})"


def members(cls: type) -> list[tuple[str, Any]]:
    """Public methods and properties defined on the class itself, and `__call__`."""
    found = []
    for name, value in vars(cls).items():
        if name.startswith("_") and name != "__call__":
            continue
        if isinstance(value, classmethod | staticmethod):
            found.append((name, value.__func__))
        elif isinstance(value, property) or inspect.isfunction(value):
            found.append((name, value))
    return found


def entry(name: str) -> list[str]:
    obj = resolve(name)
    out = [f"### `{name}`", ""]
    if inspect.isclass(obj):
        out += [f"*{class_kind(obj)}*, defined in `{obj.__module__}`", ""]
        if issubclass(obj, BaseException):
            block = f"class {name}({', '.join(source_notes(obj).bases)})"
        elif dataclasses.is_dataclass(obj) or issubclass(obj, tuple):
            signature = inspect.signature(obj).replace(return_annotation=inspect.Signature.empty)
            block = signature_text(name, signature, source_notes(obj))
        else:  # e.g. an NNX module, whose metaclass hides the signature
            signature = inspect.signature(obj.__init__)
            parameters = list(signature.parameters.values())[1:]  # without self
            signature = signature.replace(
                parameters=parameters, return_annotation=inspect.Signature.empty
            )
            block = signature_text(name, signature, source_notes(obj.__init__))
    elif callable(obj):
        out += [f"*function*, defined in `{inspect.unwrap(obj).__module__}`", ""]
        block = signature_text(name, inspect.signature(obj), source_notes(obj))
    else:
        kind = annotation_text(_module_annotation(name))
        block = f"{name}: {kind}"
        if isinstance(obj, dict):
            block += "\n# keys: " + ", ".join(map(repr, obj))
    out += ["```python", block, "```", ""]
    doc = own_docstring(obj)
    if doc:
        out += docstring_markdown(doc)
    if inspect.isclass(obj):
        for member, value in members(obj):
            out += member_entry(obj, member, value)
    return out


def _module_annotation(name: str) -> Any:
    """A constant's annotation, from the module that defines it (not the one re-exporting it)."""
    package, _, attribute = name.rpartition(".")
    obj = resolve(name)
    for module_name in sorted(sys.modules):
        module = sys.modules[module_name]
        if module_name.startswith(package) and getattr(module, attribute, None) is obj:
            annotation = getattr(module, "__annotations__", {}).get(attribute)
            if annotation is not None:
                return annotation
    return type(obj)


def member_entry(cls: type, name: str, value: Any) -> list[str]:
    """A method or property: its signature and its docstring's first paragraph."""
    if isinstance(value, property):
        notes = source_notes(value.fget)
        returns = notes.returns or annotation_text(inspect.signature(value.fget).return_annotation)
        comment = f": {notes.returns_comment}" if notes.returns_comment else ""
        block = f"{cls.__name__}.{name}: {returns}  # property{comment}"
    else:
        signature = inspect.signature(value)
        parameters = list(signature.parameters.values())
        if parameters and parameters[0].name in ("self", "cls"):
            parameters = parameters[1:]
        signature = signature.replace(parameters=parameters)
        block = signature_text(f"{cls.__name__}.{name}", signature, source_notes(value))
    out = ["```python", block, "```", ""]
    doc = own_docstring(value)
    if doc:
        out += docstring_markdown(doc)
    return out


def anchors(headings: list[str]) -> dict[str, str]:
    """The ids GitHub gives headings, in document order: a repeated id gets -1, -2, ..."""
    ids, seen = {}, {}
    for heading in headings:
        base = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        ids[heading] = base if base not in seen else f"{base}-{seen[base]}"
        seen[base] = seen.get(base, 0) + 1
    return ids


def api_markdown() -> str:
    headings = ["API reference"] + [h for title, _, names in API for h in (title, *names)]
    ids = anchors(headings)
    out = [
        "# API reference",
        "",
        f"<!-- Generated by `{COMMAND}` from the signatures, docstrings and source comments: "
        "edit the code, not this file. -->",
        "",
        "The public functions and classes of `jgrpo` (everything in `jgrpo.__all__`), the "
        "training loop, and the `jgrpo.models` package (the `models/` folder). Comments in a "
        "signature are the ones in the source, mostly shapes: `f32[B, T]` is a float32 array "
        "of B rows and T positions.",
        "",
    ]
    for title, _, names in API:
        links = ", ".join(f"[`{name}`](#{ids[name]})" for name in names)
        out.append(f"- [{title}](#{ids[title]}): {links}")
    for title, intro, names in API:
        out += ["", f"## {title}", "", intro, ""]
        for name in names:
            out += entry(name)
    while out[-1] == "":
        out.pop()
    return "\n".join(out) + "\n"


def generated() -> dict[pathlib.Path, str]:
    """Each generated file (relative to the repository root) and its text."""
    from jgrpo.config import format_markdown

    return {
        pathlib.Path("docs/config.md"): format_markdown(),
        pathlib.Path("docs/api.md"): api_markdown(),
    }


def stale(root: pathlib.Path | None = None) -> list[pathlib.Path]:
    """The generated files that are missing or differ from what this script writes now."""
    root = ROOT if root is None else root
    return [
        path
        for path, text in generated().items()
        if not (root / path).exists() or (root / path).read_text() != text
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is stale")
    args = parser.parse_args(argv)
    if args.check:
        outdated = stale(ROOT)
        for path in outdated:
            print(f"{path} is stale: run `{COMMAND}` and commit the result.", file=sys.stderr)
        return 1 if outdated else 0
    for path, text in generated().items():
        (ROOT / path).write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
