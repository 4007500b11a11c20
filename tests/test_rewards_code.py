"""Code rewards: extraction, pass/fail, partial credit, None, and the usual reward hacks."""

import time

import numpy as np
import pytest

from jgrpo.rewards import score_completions
from jgrpo.rewards.code import code_pass_fraction, code_test_reward, extract_program

LIMITS = {"timeout_s": 2.0, "memory_mb": 256}
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(0, 0) == 0"


def fenced(code, language="python"):
    return f"Here is my solution.\n```{language}\n{code}\n```\nIt adds the numbers."


CORRECT = fenced("def add(a, b):\n    return a + b")
WRONG = fenced("def add(a, b):\n    return a - b")  # passes add(0, 0) only
SYNTAX_ERROR = fenced("def add(a, b)\n    return a + b")


def test_extract_program():
    assert extract_program(CORRECT) == "def add(a, b):\n    return a + b\n"
    two = fenced("x = 1") + "\nBetter:\n" + fenced("x = 2", "Python")
    assert extract_program(two) == "x = 2\n"  # the last block
    assert extract_program(fenced("x = 3", "")) == "x = 3\n"  # an unlabelled fence
    assert extract_program(fenced("ls", "bash")).startswith("Here is")  # not python: all text
    assert extract_program("x = 4") == "x = 4"
    chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": CORRECT}]
    assert extract_program(chat) == extract_program(CORRECT)
    assert extract_program({"role": "assistant", "content": "x = 5"}) == "x = 5"


def test_correct_wrong_and_broken_programs():
    completions = [CORRECT, WRONG, SYNTAX_ERROR, "def add(a, b): return a + b", "no code"]
    tests = [TESTS] * len(completions)
    assert code_test_reward(None, completions, tests, **LIMITS) == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert code_pass_fraction(None, completions, tests, **LIMITS) == [1.0, 1 / 3, 0.0, 1.0, 0.0]


def test_tests_as_a_list_and_missing_tests():
    completions = [CORRECT] * 4
    tests = [TESTS.splitlines(), None, "", "assert add(1, 1) ==\n"]  # the last does not parse
    assert code_test_reward(None, completions, tests, **LIMITS) == [1.0, None, None, None]
    assert code_pass_fraction(None, completions, tests, **LIMITS) == [1.0, None, None, None]
    assert code_pass_fraction(None, [CORRECT], ["import math"], **LIMITS) == [None]  # no test


def test_partial_credit_counts_asserts_and_calls_but_not_setup():
    tests = (
        "import math\n"
        "def check(candidate):\n    assert candidate(2, 2) == 4\n"
        "assert add(1, 2) == 3\n"
        "check(add)\n"
        "assert add(1, 1) == 3\n"  # wrong test: fails for every program
    )
    assert code_pass_fraction(None, [CORRECT], [tests], **LIMITS) == [2 / 3]
    assert code_test_reward(None, [CORRECT], [tests], **LIMITS) == [0.0]


def test_a_hanging_test_keeps_the_credit_of_earlier_ones():
    program = fenced("def add(a, b):\n    while a == 7:\n        pass\n    return a + b")
    tests = "assert add(1, 2) == 3\nassert add(7, 0) == 7\nassert add(2, 2) == 4"
    limits = {**LIMITS, "timeout_s": 1.0}
    start = time.monotonic()
    assert code_pass_fraction(None, [program], [tests], **limits) == [1 / 3]
    assert code_test_reward(None, [program], [tests], **limits) == [0.0]
    assert time.monotonic() - start < 2 * 1.0 + 2


@pytest.mark.parametrize(
    "program",  # add is always wrong; each tries to pass anyway
    [
        "import sys\ndef add(a, b): return None\nsys.exit(0)",
        "import os\ndef add(a, b): return None\nos._exit(0)",
        "import atexit, os\natexit.register(os._exit, 0)\ndef add(a, b): return None",
        "def add(a, b):\n    raise SystemExit(0)",
        "import builtins\nbuiltins.AssertionError = SystemExit\ndef add(a, b): return None",
        # A forged marker: the real one carries a random per-run token.
        "def add(a, b): return None\n"
        "for i in range(3): print('jgrpo-0000000000000000-passed:' + str(i))",
        "def add(a, b): return None\nprint = lambda *a, **k: None",
        # Objects that say yes to every comparison, or an int whose value is wrong.
        "class Yes:\n    __eq__ = __lt__ = __gt__ = lambda s, o: True\ndef add(a, b): return Yes()",
        "class Five(int):\n    __eq__ = lambda s, o: True\n    __hash__ = int.__hash__\n"
        "def add(a, b): return Five(-7)",
        "class Meta(type):\n    __eq__ = lambda s, o: True\n    __hash__ = type.__hash__\n"
        "class Any(metaclass=Meta):\n    __eq__ = lambda s, o: True\n"
        "def add(a, b): return Any()",
        # Replacing the comparison the tests make, through the globals or the builtins.
        "def add(a, b):\n    globals()['_jgrpo_value'] = lambda x: 0\n    return None",
        "import builtins\nbuiltins.isinstance = lambda *a: True\ndef add(a, b): return None",
        "import gc\nfor f in gc.get_objects():\n    pass\ndef add(a, b): return None",
    ],
)
def test_reward_hacks_score_zero(program):
    completions = [fenced(program)]
    assert code_test_reward(None, completions, [TESTS], **LIMITS) == [0.0]
    assert code_pass_fraction(None, completions, [TESTS], **LIMITS) == [0.0]


def test_attacks_and_loops_score_zero_within_the_timeout():
    completions = [
        fenced("while True:\n    pass"),
        fenced("import os\nwhile True:\n    os.fork()"),
        fenced("x = bytearray(10**10)"),
        fenced("print(open('/etc/passwd').read())\ndef add(a, b): return a + b"),
        CORRECT,
    ]
    start = time.monotonic()
    rewards = code_test_reward(None, completions, [TESTS] * 5, max_workers=2, **LIMITS)
    assert rewards == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert time.monotonic() - start < LIMITS["timeout_s"] + 1.5


def test_works_through_score_completions():
    scores = score_completions(
        {"tests": code_test_reward, "fraction": code_pass_fraction},
        {"tests": 1.0, "fraction": 0.5},
        ["p0", "p1", "p2"],
        [CORRECT, WRONG, CORRECT],
        {"tests": [TESTS, TESTS, None], "completion_ids": [[1], [2], [3]]},
    )
    np.testing.assert_allclose(scores.total, [1.5, 0.5 / 3, 0.0])
    assert scores.valid.tolist() == [True, True, False]
    assert scores.failures == {"tests": 0, "fraction": 0}


def test_hacks_on_truth_tests_score_zero():
    tests = "assert is_even(2)\nassert not is_even(3)"
    flip = fenced(
        "class Flip:\n    calls = 0\n    def __bool__(self):\n        Flip.calls += 1\n"
        "        return Flip.calls == 1\ndef is_even(n): return Flip()"
    )
    patched = fenced(
        "import builtins\nbuiltins.bool = lambda x: True\ndef is_even(n): return n % 2 == 1"
    )
    right = fenced("def is_even(n): return n % 2 == 0")
    fractions = code_pass_fraction(None, [flip, patched, right], [tests] * 3, **LIMITS)
    assert fractions == [0.0, 0.0, 1.0]


def test_comparisons_of_built_in_values_and_their_subclasses_still_pass():
    """namedtuples, Counters, dict views, str subclasses and floats compare by their values."""
    program = fenced(
        "import collections, enum\n"
        "Point = collections.namedtuple('Point', 'x y')\n"
        "class Color(str, enum.Enum):\n    RED = 'red'\n"
        "def point(n): return Point(n, n + 1)\n"
        "def letters(): return collections.Counter('aab')\n"
        "def table(): return {'a': [1, 2], 'b': (3,), 'c': {4}, 'd': None}\n"
        "def tenth(): return 0.1 + 0.2\n"
        "def color(): return Color.RED\n"
        "def is_even(n): return n % 2 == 0"
    )
    tests = [
        "assert point(1) == (1, 2) and point(1) != (2, 1)",
        "assert letters() == {'a': 2, 'b': 1}",
        "assert table() == {'d': None, 'c': {4}, 'b': (3,), 'a': [1, 2]}",
        "assert abs(tenth() - 0.3) < 1e-9 and 0.3 <= tenth() < 1",
        "assert is_even(2) and not is_even(3)",
        "assert 2 in point(1) and 5 not in point(1)",
        "assert point(1) is not None",
        "assert sorted(table().keys()) == ['a', 'b', 'c', 'd'] and 'a' in table().keys()",
        "assert [1, 2] in table().values() and ('d', None) in table().items()",
        "assert color() == 'red'",
        "def check(candidate):\n    assert candidate(4) == (4, 5)\ncheck(point)",
    ]
    assert code_pass_fraction(None, [program], [tests], **LIMITS) == [1.0]
