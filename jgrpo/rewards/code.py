"""Code rewards: run the completion's program against the example's tests, in the sandbox.

Both functions take the TRL reward signature (see `jgrpo.rewards.scoring`) with a `tests`
field: Python source made of `assert` statements (or a list of them, joined by newlines), for
instance `assert add(2, 3) == 5`. The program is the completion's last ```python fenced block
(or last unlabelled fence), else the whole completion; chat completions use the last
message's content.

- `code_test_reward`: 1.0 when the program and then all the tests run to the end without an
  error, within the timeout; else 0.0.
- `code_pass_fraction`: the share of test statements (`assert ...` and bare calls such as
  HumanEval's `check(candidate)`) that pass, each run in its own guarded block, all in one
  process. Other statements (imports, definitions, assignments) run too but are not counted.

Both score None ("cannot score") when an example has no tests.

A test counts as passed only when the harness prints a random per-run marker after it, not by
the exit status alone, so the common reward hacks of an RL policy score 0: `sys.exit(0)` or
`os._exit(0)` before the tests, or an `atexit` handler that forces exit status 0. A program
that goes looking for the marker (reading its own source or the interpreter's frames) could
still forge it; the sandbox limits what a program can do, not what it can read in its own
process.
"""

from __future__ import annotations

import ast
import re
import secrets
from collections.abc import Sequence
from typing import Any

from jgrpo.rewards.sandbox import run_many
from jgrpo.rewards.scoring import completion_text

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

# Runs as __main__ in the sandbox. The names it needs are bound as defaults before the program
# runs, so a program that shadows `print` or `exec` cannot change what the harness does.
_HARNESS = """\
def _jgrpo_harness(program, units, marker, _print=print, _exec=exec, _compile=compile,
                   _str=str, _globals=globals, _base=BaseException):
    import linecache
    import traceback

    namespace = _globals()

    def run(source, filename):
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        _exec(_compile(source, filename, "exec"), namespace)

    run(program, "solution.py")
    for index, source in units:
        try:
            run(source, "tests.py")
        except _base:
            traceback.print_exc()
            continue
        if index >= 0:
            _print(marker + _str(index), flush=True)


_jgrpo_harness({program!r}, {units!r}, {marker!r})
"""


def extract_program(completion: Any) -> str:
    """The program in a completion: its last python (or unlabelled) fenced block, else all."""
    text = completion_text(completion)
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def code_test_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    tests: Sequence[str | Sequence[str] | None],
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_workers: int = 2,
    **_: Any,
) -> list[float | None]:
    """1.0 if the program followed by its example's tests runs without error, else 0.0.

    None for an example without tests. One sandboxed process per completion, `max_workers`
    at a time, each killed after `timeout_s` seconds.
    """
    units = [_whole_tests(_source(t)) for t in tests]
    passed, counted, ok = _run(completions, units, timeout_s, memory_mb, max_workers)
    return [
        None if n is None else float(p == n and clean)
        for p, n, clean in zip(passed, counted, ok, strict=True)
    ]


def code_pass_fraction(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    tests: Sequence[str | Sequence[str] | None],
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_workers: int = 2,
    **_: Any,
) -> list[float | None]:
    """passed tests / tests: the share of the example's test statements the program passes.

    Tests are the top-level `assert` statements and bare expressions (calls such as
    `check(f)`) of `tests`; they run one by one after the program, in one process, so a test
    that crashes or hangs costs only itself and those after it. None when `tests` has no
    test statement or does not parse.
    """
    units = [_split_tests(_source(t)) for t in tests]
    passed, counted, _ = _run(completions, units, timeout_s, memory_mb, max_workers)
    return [None if n is None else p / n for p, n in zip(passed, counted, strict=True)]


def _source(tests: str | Sequence[str] | None) -> str | None:
    if tests is None:
        return None
    source = tests if isinstance(tests, str) else "\n".join(tests)
    return source if source.strip() else None


def _whole_tests(source: str | None) -> list[tuple[int, str]] | None:
    """All of `source` as one test; None if there is none or it does not parse."""
    if source is None:
        return None
    try:
        ast.parse(source)
    except SyntaxError:
        return None
    return [(0, source)]


def _split_tests(source: str | None) -> list[tuple[int, str]] | None:
    """(test index or -1 for setup, source) per top-level statement; None if no tests."""
    if source is None:
        return None
    try:
        statements = ast.parse(source).body
    except SyntaxError:
        return None
    units, count = [], 0
    for statement in statements:
        is_test = isinstance(statement, ast.Assert) or (
            isinstance(statement, ast.Expr) and not isinstance(statement.value, ast.Constant)
        )
        units.append((count if is_test else -1, ast.unparse(statement)))
        count += is_test
    return units if count else None


def _run(completions, units, timeout_s, memory_mb, max_workers):
    """Runs each program and its test units: passed and counted tests, and whether the run
    exited cleanly, per completion (counted is None where there is nothing to run)."""
    if len(units) != len(completions):
        raise ValueError(f"{len(completions)} completions but {len(units)} tests")
    rows = [row for row, u in enumerate(units) if u is not None]
    markers = {row: f"jgrpo-{secrets.token_hex(8)}-passed:" for row in rows}
    scripts = [
        _HARNESS.format(
            program=extract_program(completions[row]), units=units[row], marker=markers[row]
        )
        for row in rows
    ]
    results = run_many(scripts, max_workers=max_workers, timeout_s=timeout_s, memory_mb=memory_mb)
    passed: list[int] = [0] * len(units)
    counted: list[int | None] = [None] * len(units)
    ok = [False] * len(units)
    for row, result in zip(rows, results, strict=True):
        total = sum(index >= 0 for index, _ in units[row])
        seen = {int(i) for i in re.findall(re.escape(markers[row]) + r"(\d+)", result.stdout)}
        passed[row] = len(seen & set(range(total)))
        counted[row] = total
        ok[row] = result.ok
    return passed, counted, ok
