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
`os._exit(0)` before the tests, or an `atexit` handler that forces exit status 0.

Comparisons cannot be faked by what the program returns: the tests are rewritten so that
every `==`, `!=`, `<`, `<=`, `>`, `>=`, `in` and `not in` compares copies made of built-in
values only (int, float, complex, str, bytes, None, bool, range, and lists, tuples, dicts,
sets and dict views of them; subclasses such as namedtuple, Counter or a str Enum by their
built-in value, read through the built-in type's own methods), and every `assert` tests the
truth of such a value. An object whose `__eq__` or `__bool__` always says yes, or an int
subclass holding a wrong number, fails. The tests run in a copy of the program's namespace
with the builtins as they were before the program ran, so the program cannot replace the
comparison functions through its globals or patch `len` or `bool` for the tests.

What remains possible, plainly: a comparison of objects of other classes (Decimal, Fraction,
a class of the tests' own) fails even when right, so tests should compare built-in values; a
test that only calls a function (`check(f)`, `math.isclose(f(x), y)`) uses what that function
does with the object, and a program may patch standard library modules the tests import
(`math.isclose = ...`); tests do not see the program's globals rebound after the program
ended; and a program that walks the interpreter's frames (`sys._getframe`, a traceback) into
the harness can still replace the comparisons or forge the marker. The sandbox limits what a
program can do, not what it can read in its own process.
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
# runs, so a program that shadows `print` or `exec` cannot change what the harness does. The
# tests run in a copy of the program's namespace, with the builtins as they were before the
# program ran and the two functions that `_compared_as_values` puts into every comparison.
# (Braces are doubled: this is a str.format template.)
_HARNESS = """\
def _jgrpo_comparisons(_type=type, _subclass=issubclass, _bool=bool, _int=int, _float=float,
                       _complex=complex, _str=str, _bytes=bytes, _list=list, _tuple=tuple,
                       _dict=dict, _set=set, _frozenset=frozenset, _range=range, _slice=slice,
                       _views=(type({{}}.keys()), type({{}}.values()), type({{}}.items())),
                       _error=TypeError):
    everything = _slice(None)

    def value(x):
        # A copy made of built-in values only, read through the built-in types' own methods:
        # a returned object's __eq__, __iter__ or __bool__ play no part in what is compared.
        kind = _type(x)
        if x is None or x is ... or kind is _bool or kind is _range:
            return x
        if _subclass(kind, _int):
            return _int.__int__(x)
        if _subclass(kind, _float):
            return _float.__float__(x)
        if _subclass(kind, _complex):
            return _complex.__complex__(x)
        if _subclass(kind, _str):
            return _str.__str__(x)
        if _subclass(kind, _bytes):
            return _bytes.__bytes__(x)
        if _subclass(kind, _list):
            return [value(item) for item in _list.__getitem__(x, everything)]
        if _subclass(kind, _tuple):
            return _tuple(value(item) for item in _tuple.__getitem__(x, everything))
        if _subclass(kind, _dict):
            return _dict((value(k), value(v)) for k, v in _dict.items(_dict.copy(x)))
        if _subclass(kind, _frozenset):
            return _frozenset(value(item) for item in _frozenset.copy(x))
        if _subclass(kind, _set):
            return _set(value(item) for item in _set.copy(x))
        if kind is _views[0]:  # keys: a set, as they compare
            return _set(value(item) for item in x)
        if kind is _views[1] or kind is _views[2]:  # values, items (a set where hashable)
            items = [value(item) for item in x]
            try:
                return items if kind is _views[1] else _set(items)
            except _error:
                return items
        raise _error(f"tests compare built-in values only, not {{kind.__name__}} objects")

    def truth(x):
        return _bool(value(x))

    return value, truth


def _jgrpo_harness(program, units, marker, _print=print, _exec=exec, _compile=compile,
                   _str=str, _globals=globals, _dict=dict, _base=BaseException,
                   _builtins=dict(vars(__import__("builtins"))),
                   _comparisons=_jgrpo_comparisons()):
    import linecache
    import traceback

    def run(source, filename, namespace):
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        _exec(_compile(source, filename, "exec"), namespace)

    run(program, "solution.py", _globals())
    tests = _dict(_globals())
    tests["__builtins__"] = _builtins
    tests["_jgrpo_value"], tests["_jgrpo_truth"] = _comparisons
    for index, source in units:
        try:
            run(source, "tests.py", tests)
        except _base:
            traceback.print_exc()
            continue
        if index >= 0:
            _print(marker + _str(index), flush=True)


_jgrpo_harness({program!r}, {units!r}, {marker!r})
"""

# Comparisons whose operands become built-in values (identity tests `is` keep theirs).
_VALUE_COMPARISONS = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In, ast.NotIn)


class _ComparedAsValues(ast.NodeTransformer):
    """Test code whose comparisons see built-in copies of their operands and whose asserts
    see the truth of a built-in value, so `assert add(2, 3) == 5` cannot be passed by
    returning an object whose `__eq__` (or `__bool__`) always says yes."""

    def visit_Compare(self, node: ast.Compare) -> ast.Compare:
        self.generic_visit(node)
        if all(isinstance(op, _VALUE_COMPARISONS) for op in node.ops):
            node.left = _call("_jgrpo_value", node.left)
            node.comparators = [_call("_jgrpo_value", c) for c in node.comparators]
        return node

    def visit_Assert(self, node: ast.Assert) -> ast.Assert:
        self.generic_visit(node)
        node.test = _truth(node.test)
        return node


def _call(function: str, argument: ast.expr) -> ast.Call:
    return ast.Call(func=ast.Name(function, ast.Load()), args=[argument], keywords=[])


def _truth(test: ast.expr) -> ast.expr:
    """`test` with `and`, `or` and `not` kept and every other part made a built-in bool."""
    if isinstance(test, ast.BoolOp):
        return ast.BoolOp(op=test.op, values=[_truth(v) for v in test.values])
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return ast.UnaryOp(op=test.op, operand=_truth(test.operand))
    return _call("_jgrpo_truth", test)


def _compared_as_values(statements: list[ast.stmt]) -> str:
    """The source of `statements` with comparisons and asserts rewritten (see above)."""
    module = ast.fix_missing_locations(_ComparedAsValues().visit(ast.Module(statements, [])))
    return ast.unparse(module)


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
        statements = ast.parse(source).body
    except SyntaxError:
        return None
    return [(0, _compared_as_values(statements))]


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
        units.append((count if is_test else -1, _compared_as_values([statement])))
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
