"""GSM8K grade-school math word problems, scored by their final number.

Each GSM8K row has a `question` and an `answer`: a worked solution whose last line is
"#### N", N the final result. An example here is

    {"prompt": chat messages or text asking the question,
     "answer": N as written after "####", commas and spaces removed ("1,234" -> "1234"),
     "solution": the full worked solution, for reference}

The reference is kept as text, not converted to a number, so the reward decides how
answers compare (GSM8K's answers are integers, some written with commas). The
prompt asks for reasoning in <think></think> and the bare number in <answer></answer>;
`correct` scores the number and `format` the layout, weighted lower so that form never
outweighs a right answer.

The data comes from TFDS (`gsm8k`, read without TensorFlow) or from local files in the layout
of the original release: a directory with one `<split>.jsonl` file a split. Without a network
and without a prepared TFDS copy, loading fails at once and names the local route.
"""

from __future__ import annotations

import os
import pathlib
import re

from jgrpo.tasks.base import Task
from jgrpo.tasks.datasets import load_jsonl, load_tfds

DEFAULT_SYSTEM = (
    "Solve the user's math problem. First reason through it step by step inside "
    "<think></think> tags, then give only the final number inside <answer></answer> tags, "
    "for example: <think>...</think><answer>42</answer>"
)

# Where TFDS's gsm8k builder downloads the original release from (tried before a download).
DOWNLOAD_URL = "https://raw.githubusercontent.com/openai/grade-school-math/"
OFFLINE_HINT = (
    "Offline, read local files instead: task.path=DIR (source='jsonl', path=DIR from Python), "
    "a folder holding train.jsonl and test.jsonl like tests/data/gsm8k."
)

_MARK = "####"
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")


def parse_answer(solution: str) -> str:
    """The number after the last "####" of a GSM8K solution, without commas or spaces.

    "... so she has 18.\\n#### 1,234" -> "1234". Raises ValueError when there is no "####"
    or what follows it is not a number.
    """
    if _MARK not in solution:
        raise ValueError(f"no {_MARK!r} before the final answer")
    written = solution.rsplit(_MARK, 1)[1].strip()
    number = written.replace(",", "").replace(" ", "")
    if not _NUMBER.fullmatch(number):
        raise ValueError(f"the final answer after {_MARK!r} is not a number: {written!r}")
    return number


def _row_problem(example: dict) -> str | None:
    """Why a loaded row is not a GSM8K problem: question not text, no final answer."""
    if not isinstance(example["prompt"], str):
        return f"question must be text, got {type(example['prompt']).__name__}"
    solution = example["solution"]
    if not isinstance(solution, str):
        return f"answer must be text, got {type(solution).__name__}"
    try:
        parse_answer(solution)
    except ValueError as error:
        return f"answer has {error}"
    return None


def gsm8k_examples(
    split: str,
    *,
    source: str = "tfds",
    data_dir: str | os.PathLike | None = None,
    path: str | os.PathLike | None = None,
    chat: bool = True,
    system_prompt: str | None = DEFAULT_SYSTEM,
    on_error: str = "reject",
) -> list[dict]:
    """The examples of one split (TFDS split syntax, e.g. "test[:200]", with source="tfds").

    source="tfds" reads TFDS `gsm8k` from `data_dir`; source="jsonl" reads
    `<path>/<split>.jsonl` (or `.json`). chat=True makes the prompt chat messages (the
    system prompt, when given, then the question as the user's turn); chat=False makes it
    text: the system prompt, a blank line, the question. Rows whose question is not text or
    whose answer has no "#### N" are reported with their row number, like any malformed row
    (see `jgrpo.tasks.datasets`).
    """
    options = dict(
        prompt_field="question",
        fields={"answer": "solution"},
        on_error=on_error,
        check=_row_problem,
    )
    if source == "tfds":
        try:
            rows = load_tfds(
                "gsm8k", split, data_dir=data_dir, download_url=DOWNLOAD_URL, **options
            )
        except ConnectionError as error:
            raise ConnectionError(f"{error} {OFFLINE_HINT}") from None
    elif source == "jsonl":
        if path is None:
            raise ValueError("source='jsonl' needs path=, a directory of <split>.jsonl files.")
        directory = pathlib.Path(path).expanduser()
        if not directory.is_dir():
            what = "is a file" if directory.exists() else "does not exist"
            raise FileNotFoundError(
                f"the GSM8K path {path} {what}: give task.path (path=) a folder holding "
                "train.jsonl and test.jsonl, like tests/data/gsm8k."
            )
        candidates = [directory / f"{split}{suffix}" for suffix in (".jsonl", ".json")]
        found = [file for file in candidates if file.is_file()]
        if not found:
            raise FileNotFoundError(f"no {split}.jsonl or {split}.json in {directory}.")
        rows = load_jsonl(found[0], **options)
    else:
        raise ValueError(f"source must be 'tfds' or 'jsonl', got {source!r}.")
    return [
        {
            "prompt": _prompt(row["prompt"], chat, system_prompt),
            "answer": parse_answer(row["solution"]),
            "solution": row["solution"],
        }
        for row in rows
    ]


def _prompt(question: str, chat: bool, system_prompt: str | None) -> str | list[dict]:
    if chat:
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        return [*system, {"role": "user", "content": question}]
    return f"{system_prompt}\n\n{question}" if system_prompt else question


def gsm8k_task(
    *,
    data_dir: str | os.PathLike | None = None,
    split: str = "train",
    eval_split: str | None = "test",
    eval_size: int | None = None,
    chat: bool = True,
    system_prompt: str | None = DEFAULT_SYSTEM,
    source: str = "tfds",
    path: str | os.PathLike | None = None,
    on_error: str = "reject",
) -> Task:
    """GSM8K: train on `split`, evaluate greedily on the first eval_size of `eval_split`.

    eval_split=None evaluates on the training examples; eval_size=None uses the whole eval
    split. Rewards: `correct` (jgrpo.rewards.math.math_answer_reward, weight 1.0, the
    accuracy) and `format` (jgrpo.rewards.format.layout_reward, weight 0.2). The model's
    own tokenizer is used.
    """
    from jgrpo.rewards.format import layout_reward
    from jgrpo.rewards.math import math_answer_reward

    if eval_size is not None and eval_size < 1:
        raise ValueError(f"eval_size must be >= 1 or None, got {eval_size}.")
    options = dict(
        source=source,
        data_dir=data_dir,
        path=path,
        chat=chat,
        system_prompt=system_prompt,
        on_error=on_error,
    )
    train = gsm8k_examples(split, **options)
    evaluation = gsm8k_examples(eval_split, **options) if eval_split is not None else train
    if eval_size is not None:
        if eval_size > len(evaluation):
            raise ValueError(
                f"eval_size={eval_size} but the eval split {eval_split or split!r} has only "
                f"{len(evaluation)} examples."
            )
        evaluation = evaluation[:eval_size]
    return Task(
        name="gsm8k",
        train=train,
        eval=evaluation,
        reward_fns={"correct": math_answer_reward, "format": layout_reward},
        reward_weights={"correct": 1.0, "format": 0.2},
        correctness="correct",
        tokenizer=None,
    )


__all__ = ["DEFAULT_SYSTEM", "DOWNLOAD_URL", "gsm8k_examples", "gsm8k_task", "parse_answer"]
