"""Prompt datasets from local JSON/JSONL files and from TensorFlow Datasets, checked row by row.

Every loader returns plain examples, `{"prompt": ..., **other_fields}`, the shape a `Task`
trains on. A prompt is plain text or a list of chat messages (`{"role", "content"}` dicts,
formatted later by the tokenizer's chat template).

Why the strictness: a row that is quietly dropped, cut short or turned into an empty prompt
changes what a run trains on without anyone noticing. So every unusable row is named by its
source and its 1-based row number, and `on_error` decides what happens:

- "reject" (the default) raises `DatasetError` listing the first 10 problems and the count;
- "skip" logs each problem on the "jgrpo.tasks" logger, drops those rows and keeps the rest
  in order.

Either way nothing is truncated: an over-long prompt is an error, not a shorter prompt.

TFDS datasets are read through `tfds.data_source` (ArrayRecord files, random access), which
needs neither TensorFlow nor a network once the dataset is prepared in `data_dir`. Before a
download, the host it comes from is tried for a few seconds (`unreachable`): offline, TFDS would
retry for minutes and end in a network library's traceback.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import logging
import os
import pathlib
import socket
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from jgrpo._checks import check_choice
from jgrpo.tasks.base import Task

logger = logging.getLogger("jgrpo.tasks")

Fields = Sequence[str] | Mapping[str, str] | None
Check = Callable[[dict], str | None]  # a row's problem, or None when it is usable

ON_ERROR = ("reject", "skip")
PROBE_TIMEOUT_S = 5.0  # how long `unreachable` waits for a connection
_SHOWN = 10  # problems quoted in a DatasetError; the count covers the rest


class DatasetError(ValueError):
    """Rows of a dataset that cannot be used, each named by its source and 1-based row."""


class _Invalid:
    """A row that could not even be parsed (e.g. a line that is not JSON)."""

    def __init__(self, reason: str):
        self.reason = reason


def load_jsonl(
    path: str | os.PathLike,
    *,
    prompt_field: str = "prompt",
    fields: Fields = None,
    on_error: str = "reject",
    check: Check | None = None,
) -> list[dict]:
    """Examples from a .jsonl file (one JSON object a line) or a .json file (a list of objects).

    `prompt_field` becomes "prompt". The other fields are all kept when `fields` is None;
    otherwise only `fields` are kept: a list keeps their names, a dict {source: target}
    renames them. Rows are numbered from 1: by line in .jsonl files (blank lines hold no row
    but are counted, so the number is the line an editor shows), by position in .json lists.
    `check(example)` may name a further problem of a converted row (None when it is fine);
    such rows are reported like any other malformed row.
    """
    check_choice("on_error", on_error, ON_ERROR)
    path = pathlib.Path(path)
    if path.suffix not in (".jsonl", ".json"):
        raise ValueError(f"{path}: expected a .jsonl or .json file, got suffix {path.suffix!r}.")
    data = path.read_bytes()
    if path.suffix == ".json":
        try:
            rows = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise DatasetError(f"{path}: not valid JSON ({error}).") from error
        if not isinstance(rows, list):
            raise DatasetError(
                f"{path}: a .json dataset must be a list of objects, got {type(rows).__name__}."
            )
        records = enumerate(rows, start=1)
    else:
        records = _jsonl_records(data)
    return _convert(records, str(path), prompt_field, fields, on_error, check)


def _jsonl_records(data: bytes) -> Iterable[tuple[int, Any]]:
    """(line number, parsed object or _Invalid) for each non-blank line.

    Lines are split on b"\\n" only: U+2028 and friends may appear raw inside JSON strings.
    """
    for number, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except UnicodeDecodeError:
            yield number, _Invalid("is not UTF-8 text")
        except json.JSONDecodeError as error:
            yield number, _Invalid(f"is not valid JSON ({error.msg} at column {error.colno})")


def load_tfds(
    name: str,
    split: str,
    *,
    data_dir: str | os.PathLike | None = None,
    prompt_field: str = "prompt",
    fields: Fields = None,
    on_error: str = "reject",
    check: Check | None = None,
    download: bool = True,
    download_url: str | None = None,
) -> list[dict]:
    """Examples from a TFDS text dataset, by name and split (TFDS slicing like "train[:100]").

    Fields and checks are as in `load_jsonl`; rows are numbered by 1-based position in the
    split as stored (TFDS shuffles most datasets when preparing them, so this is not the
    order of the original files). Text arrives as bytes and is decoded to str; numpy scalars
    and arrays become Python values and lists. The dataset is read with `tfds.data_source`
    from ArrayRecord files in `data_dir` (TFDS's default directory when None), without
    TensorFlow. When it is not prepared there and `download` is True it is downloaded and
    prepared as ArrayRecord first, which needs a network. `download_url`, where the dataset
    downloads from, is tried first when given: without a connection to it within
    PROBE_TIMEOUT_S seconds, ConnectionError at once instead of minutes of retries.
    """
    check_choice("on_error", on_error, ON_ERROR)
    import tensorflow_datasets as tfds

    _import_text_builders()
    try:
        if download and download_url is not None:
            builder = tfds.builder(name, data_dir=data_dir, file_format="array_record")
            problem = None if builder.is_prepared() else unreachable(download_url)
            if problem is not None:
                raise ConnectionError(
                    f"TFDS {name} is not prepared in {builder.data_dir} and cannot be "
                    f"downloaded: no connection to {problem}."
                )
        source = tfds.data_source(
            name,
            split=split,
            data_dir=data_dir,
            download=download,
            builder_kwargs={"file_format": "array_record"},
        )
    except ModuleNotFoundError as error:
        if error.name == "tensorflow":
            raise ImportError(
                f"reading TFDS dataset {name!r} needed TensorFlow, which is not installed. "
                "jgrpo reads TFDS datasets without it from ArrayRecord files: prepare the "
                "dataset with file_format='array_record' (TFRecord files need TensorFlow), "
                "or pip install tensorflow."
            ) from error
        raise ImportError(
            f"reading TFDS dataset {name!r} needs the Python package {error.name!r}, which is "
            f"not installed: pip install {error.name}"
        ) from error
    records = ((row, _plain(record)) for row, record in enumerate(source, start=1))
    where = f"TFDS {name} ({split}" + (f", {data_dir})" if data_dir else ")")
    return _convert(records, where, prompt_field, fields, on_error, check)


def unreachable(url: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why no connection to `url`'s host (or to the proxy set for its scheme) opens within
    `timeout` seconds, as "host:port (reason)"; None when one does."""
    parts = urllib.parse.urlsplit(url)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(parts.hostname):
        parts = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout).close()
    except OSError as error:
        return f"{parts.hostname}:{port} ({error.strerror or error})"
    return None


# The groups of TFDS's own builders that hold text datasets. TFDS imports all its builder
# groups in one go and stops at the first that fails (without h5py, at "nearest_neighbors",
# before "text"), so built-in text datasets such as gsm8k could not be found by name and
# could only be read from already prepared files. Importing these groups one by one
# registers them; any that cannot be imported is left out.
_TFDS_TEXT_GROUPS = (
    "text",
    "question_answering",
    "summarization",
    "translate",
    "text_simplification",
)


def _import_text_builders() -> None:
    for group in _TFDS_TEXT_GROUPS:
        with contextlib.suppress(ImportError):
            importlib.import_module(f"tensorflow_datasets.{group}")


def _plain(value: Any) -> Any:
    """A TFDS record as Python values: bytes -> str, numpy scalars/arrays -> Python/lists."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return _Invalid("holds bytes that are not UTF-8 text")
    if isinstance(value, np.ndarray):
        return [_plain(item) for item in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def check_prompt_lengths(
    examples: Sequence[Mapping[str, Any]],
    tokenizer,
    max_tokens: int,
    *,
    on_error: str = "reject",
    source: str = "examples",
    lengths: Sequence[int] | None = None,
) -> list[Mapping[str, Any]]:
    """The examples whose prompt is at most max_tokens tokens; longer ones are reported.

    Prompts are encoded as the trainer encodes them (`jgrpo.generation.encode_prompts`: chat
    messages through the tokenizer's chat template with the generation prompt), unless
    `lengths` gives their token counts (a caller that needs them too encodes once). Rows are
    the 1-based positions in `examples`, named with `source`. "reject" raises DatasetError,
    "skip" logs and drops the long prompts; nothing is ever truncated.
    """
    check_choice("on_error", on_error, ON_ERROR)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}.")
    if lengths is None:
        from jgrpo.generation import encode_prompts

        prompts = [example["prompt"] for example in examples]
        lengths = [len(tokens) for tokens in encode_prompts(tokenizer, prompts)]
    kept, problems = [], []
    for row, (example, length) in enumerate(zip(examples, lengths, strict=True), start=1):
        if length > max_tokens:
            problems.append(
                f"{source} row {row}: prompt is {length} tokens, more than {max_tokens}"
            )
        else:
            kept.append(example)
    _report(problems, source, len(examples), on_error, kept)
    return kept


def _convert(
    records: Iterable[tuple[int, Any]],
    source: str,
    prompt_field: str,
    fields: Fields,
    on_error: str,
    check: Check | None,
) -> list[dict]:
    """Examples from (row number, record) pairs; unusable rows reported per `on_error`."""
    renames = _renames(fields, prompt_field)
    examples, problems, total = [], [], 0
    for row, record in records:
        total += 1
        example, problem = _example(record, prompt_field, renames)
        if problem is None and check is not None:
            problem = check(example)
        if problem is None:
            examples.append(example)
        else:
            problems.append(f"{source} row {row}: {problem}")
    _report(problems, source, total, on_error, examples)
    return examples


def _renames(fields: Fields, prompt_field: str) -> dict[str, str] | None:
    """{source field: example field} for the fields kept besides the prompt (None: all)."""
    if fields is None:
        return None
    if isinstance(fields, str):
        raise TypeError(f"fields must be a list of names or a dict, got the string {fields!r}.")
    renames = dict(fields) if isinstance(fields, Mapping) else {name: name for name in fields}
    targets = list(renames.values())
    if "prompt" in targets:
        raise ValueError(
            f"fields {fields!r} would overwrite 'prompt', which comes from prompt_field "
            f"{prompt_field!r}."
        )
    if len(set(targets)) != len(targets):
        raise ValueError(f"fields {fields!r} give two fields the same name.")
    return renames


def _example(
    record: Any, prompt_field: str, renames: dict[str, str] | None
) -> tuple[dict | None, str | None]:
    """(example, None) for a usable record, else (None, what is wrong with it)."""
    if isinstance(record, _Invalid):
        return None, record.reason
    if not isinstance(record, dict):
        return None, f"is not an object (got {type(record).__name__})"
    if prompt_field not in record:
        return None, f"has no prompt field {prompt_field!r}"
    prompt = record[prompt_field]
    problem = _prompt_problem(prompt)
    if problem is not None:
        return None, problem
    if renames is None:
        if prompt_field != "prompt" and "prompt" in record:
            return None, (
                f"has both 'prompt' and the prompt field {prompt_field!r}; pass fields= to "
                "choose the fields to keep"
            )
        example = {key: value for key, value in record.items() if key != prompt_field}
    else:
        missing = [name for name in renames if name not in record]
        if missing:
            return None, f"has no field {', '.join(repr(name) for name in missing)}"
        example = {target: record[name] for name, target in renames.items()}
    bad = [key for key, value in example.items() if isinstance(value, _Invalid)]
    if bad:
        return None, f"field {bad[0]!r} {example[bad[0]].reason}"
    return {"prompt": prompt, **example}, None


def _prompt_problem(prompt: Any) -> str | None:
    """Why `prompt` is neither non-blank text nor a list of chat messages (None if it is)."""
    if isinstance(prompt, _Invalid):
        return f"prompt {prompt.reason}"
    if isinstance(prompt, str):
        return None if prompt.strip() else "prompt is empty"
    if not isinstance(prompt, list):
        return f"prompt must be text or a list of chat messages, got {type(prompt).__name__}"
    if not prompt:
        return "prompt is an empty list of messages"
    for index, message in enumerate(prompt):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and message["role"].strip()
            and isinstance(message.get("content"), str)
        ):
            return (
                f"prompt message {index} is not a {{'role': str, 'content': str}} dict: "
                f"{message!r:.80}"
            )
    if not any(message["content"].strip() for message in prompt):
        return "prompt messages are all empty"
    return None


def _report(problems: list[str], source: str, total: int, on_error: str, kept: list) -> None:
    """Raises DatasetError ("reject") or logs each problem ("skip"); no usable row raises."""
    if problems and on_error == "reject":
        shown = "\n  ".join(problems[:_SHOWN])
        more = f"\n  ... and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
        raise DatasetError(
            f"{source}: {len(problems)} of {total} rows cannot be used "
            f"(on_error='skip' drops them instead):\n  {shown}{more}"
        )
    for problem in problems:
        logger.warning("skipped %s", problem)
    if problems:
        logger.warning("%s: skipped %d of %d rows.", source, len(problems), total)
    if not kept:
        raise DatasetError(f"{source}: no usable rows (of {total}).")


__all__ = ["DatasetError", "check_prompt_lengths", "load_jsonl", "load_tfds", "unreachable"]


def as_chat(examples: list[dict], system_prompt: str | None) -> list[dict]:
    """Text prompts as chat messages: the system prompt (if any), then the text as the user's."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [
        {**e, "prompt": [*system, {"role": "user", "content": e["prompt"]}]}
        if isinstance(e["prompt"], str)
        else e
        for e in examples
    ]


def task_from_examples(
    name: str,
    examples: list[dict],
    eval_examples: list[dict] | None,
    *,
    rewards: str,
    correctness: str | None = None,
    held_out: int = 0,
    seed: int = 0,
    chat: bool = False,
    system_prompt: str | None = None,
) -> Task:
    """A Task from loaded examples, scored by built-in rewards.

    `rewards` is a spec like "math:1.0,think_answer_format:0.2" (see
    `jgrpo.rewards.registry`); `correctness` names the one whose 1.0 means right (default:
    the first). The eval split is `eval_examples`, else `held_out` examples drawn by the seed
    (kept out of training), else the training examples. With `chat`, text prompts become chat
    messages (after `system_prompt`, when given).
    """
    from jgrpo.rewards.registry import parse_reward_spec

    functions, weights = parse_reward_spec(rewards)
    if eval_examples is not None:
        train, evaluation = examples, eval_examples
    elif held_out:
        if not 0 < held_out < len(examples):
            raise ValueError(f"held_out must be in [0, {len(examples)}), got {held_out}.")
        order = np.random.default_rng(seed).permutation(len(examples))
        held = set(order[:held_out].tolist())
        train = [e for i, e in enumerate(examples) if i not in held]
        evaluation = [examples[i] for i in sorted(held)]
    else:
        train = evaluation = examples
    if chat:
        train, evaluation = as_chat(train, system_prompt), as_chat(evaluation, system_prompt)
    return Task(
        name=name,
        train=train,
        eval=evaluation,
        reward_fns=functions,
        reward_weights=weights,
        correctness=correctness or next(iter(functions)),
    )


def jsonl_task(
    path: str | os.PathLike,
    *,
    rewards: str,
    eval_path: str | os.PathLike | None = None,
    prompt_field: str = "prompt",
    on_error: str = "reject",
    **options: Any,
) -> Task:
    """Your own data from a JSONL/JSON file (and an optional eval file); see task_from_examples."""
    examples = load_jsonl(path, prompt_field=prompt_field, on_error=on_error)
    evaluation = None
    if eval_path is not None:
        evaluation = load_jsonl(eval_path, prompt_field=prompt_field, on_error=on_error)
    return task_from_examples(
        pathlib.Path(path).stem, examples, evaluation, rewards=rewards, **options
    )


def tfds_task(
    dataset: str,
    *,
    rewards: str,
    split: str = "train",
    eval_split: str | None = "test",
    data_dir: str | os.PathLike | None = None,
    prompt_field: str = "prompt",
    on_error: str = "reject",
    **options: Any,
) -> Task:
    """Any TFDS text dataset by name and split; see task_from_examples for the rest."""
    load = functools.partial(
        load_tfds, dataset, data_dir=data_dir, prompt_field=prompt_field, on_error=on_error
    )
    evaluation = load(eval_split) if eval_split else None
    return task_from_examples(dataset, load(split), evaluation, rewards=rewards, **options)
