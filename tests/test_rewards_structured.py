"""Structured-JSON rewards: what counts as the object, schema near-misses, the answer rule and
the weighted totals."""

import json

import pytest

from jgrpo.rewards import score_completions
from jgrpo.rewards.structured import (
    STRUCTURED_REWARDS,
    STRUCTURED_WEIGHTS,
    extract_object,
    json_answer_correct,
    json_extra_text,
    json_parses,
    json_required_fields,
    json_schema_valid,
    schema_errors,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Oslo", "Lima"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
GOOD = '{"name": "Ann", "age": 30, "city": "Oslo"}'


def rewards(completion, schema=SCHEMA, answer=30, answer_key="age") -> dict[str, float]:
    """Every component on one completion."""
    fields = {"schema": [schema], "answer": [answer], "answer_key": [answer_key]}
    return {
        name: fn(prompts=["p"], completions=[completion], **fields)[0]
        for name, fn in STRUCTURED_REWARDS.items()
    }


@pytest.mark.parametrize(
    "completion, parses, extra",
    [
        (GOOD, 1, 0),
        (f"\n  {GOOD}  \n", 1, 0),
        (f"```json\n{GOOD}\n```", 1, 0),
        (f"```JSON\n{GOOD}\n```", 1, 0),
        (f"```\n{GOOD}\n```", 1, 0),
        (f"{GOOD}\nHope this helps!", 1, 1),  # trailing prose
        (f"Sure, here it is: {GOOD}", 1, 1),  # prose before
        (f"Here you go:\n```json\n{GOOD}\n```", 1, 1),  # prose before the fence
        (f"```json\n{GOOD}\n```\nDone.", 1, 1),  # prose after the fence
        (f"```json\n{GOOD}", 1, 1),  # an unclosed fence is not a fence
        (f"{GOOD}\n{GOOD}", 1, 1),  # two objects: the first is scored, the second is extra
        (f"[{GOOD}]", 1, 1),  # the object inside an array; the brackets are extra
        ("{'name': 'Ann', 'age': 30}", 0, 0),  # single quotes
        ('{"name": "Ann", "age": 30,}', 0, 0),  # trailing comma
        ('{"age": NaN}', 0, 0),  # not JSON
        ('{"name": "Ann", "age": 30', 0, 0),  # truncated
        ("{not json} " + GOOD, 0, 0),  # only the first balanced object is a candidate
        ("The age is 30.", 0, 0),  # no object: nothing to be extra to
        ("", 0, 0),
        ("   ", 0, 0),
    ],
)
def test_what_counts_as_the_object_and_extra_text(completion, parses, extra):
    assert json_parses(completions=[completion]) == [parses]
    assert json_extra_text(completions=[completion]) == [extra]


def test_the_scanner_respects_strings_and_escapes():
    assert extract_object('{"name": "a}b"} tail') == ({"name": "a}b"}, " tail")
    assert extract_object('{"s": "{{{", "t": "}"}') == ({"s": "{{{", "t": "}"}, "")
    assert extract_object(r'{"q": "say \"}\" now", "n": {"k": [1, {"x": "\\"}]}}')[0] == {
        "q": 'say "}" now',
        "n": {"k": [1, {"x": "\\"}]},
    }
    # A quote or brace in the prose before the object does not matter: the scan starts at "{".
    assert extract_object('He said "ok" {"a": 1}') == ({"a": 1}, 'He said "ok" ')
    deep = '{"a": ' * 100_000 + "1" + "}" * 100_000
    assert extract_object(deep) == (None, deep)  # too deep for the parser: no object, no crash


def test_chat_completions_are_scored_on_the_last_message():
    chat = [{"role": "assistant", "content": f"```json\n{GOOD}\n```"}]
    assert (
        rewards(chat)
        == rewards(GOOD)
        == {
            "json_parses": 1,
            "json_schema_valid": 1,
            "json_required_fields": 1,
            "json_answer_correct": 1,
            "json_extra_text": 0,
        }
    )
    history = [
        {"role": "assistant", "content": GOOD},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "no"},
    ]
    assert json_parses(completions=[history]) == [0]


@pytest.mark.parametrize(
    "completion, reason",
    [
        ('{"name": "Ann", "age": "42", "city": "Oslo"}', "is not of type integer"),
        ('{"name": "Ann", "age": 30.5, "city": "Oslo"}', "is not of type integer"),
        ('{"name": "Ann", "age": true, "city": "Oslo"}', "is not of type integer"),
        ('{"name": null, "age": 30, "city": "Oslo"}', "is not of type string"),
        ('{"name": "Ann", "age": 30}', "required property 'city' is missing"),
        ('{"name": "Ann", "age": 30, "city": "Oslo", "zip": 1}', "additional property 'zip'"),
        ('{"name": "Ann", "age": 30, "city": "Paris"}', "is not one of"),
        ('{"name": "Ann", "age": -1, "city": "Oslo"}', "below the minimum 0"),
        ('{"name": "Ann", "age": 151, "city": "Oslo"}', "above the maximum 150"),
    ],
)
def test_schema_near_misses_fail(completion, reason):
    assert json_parses(completions=[completion]) == [1]
    assert json_schema_valid(completions=[completion], schema=[SCHEMA]) == [0]
    (error,) = schema_errors(json.loads(completion), SCHEMA)
    assert reason in error


def test_schema_valid_and_required_fields():
    ok = [
        GOOD,
        '{"city": "Lima", "age": 0, "name": ""}',
        '{"name": "A", "age": 30.0, "city": "Oslo"}',
    ]
    assert json_schema_valid(completions=ok, schema=[SCHEMA] * 3) == [1, 1, 1]  # 30.0 is an integer
    assert json_schema_valid(completions=["no json"], schema=[SCHEMA]) == [0]
    # Required fields: presence only; a wrong type is the schema reward's business.
    completions = [GOOD, '{"name": 1, "age": "x", "city": 2}', '{"name": "Ann"}', "none"]
    assert json_required_fields(completions=completions, schema=[SCHEMA] * 4) == [1, 1, 0, 0]
    assert json_required_fields(completions=["{}"], schema=[{"type": "object"}]) == [1]


def test_schema_validator_covers_arrays_nesting_and_rejects_unknown_keywords():
    schema = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string"}},
            "size": {"type": ["number", "null"]},
            "meta": {"type": "object", "additionalProperties": {"type": "integer"}},
        },
        "title": "annotations are allowed",
    }
    assert schema_errors({"tags": ["a"], "size": None, "meta": {"x": 1}, "more": 1}, schema) == []
    assert schema_errors({"tags": ["a", 2]}, schema) == ["$.tags[1]: 2 is not of type string"]
    assert schema_errors({"meta": {"x": "1"}}, schema) == ["$.meta.x: '1' is not of type integer"]
    assert schema_errors({"size": "big"}, schema) == ["$.size: 'big' is not of type number or null"]
    assert schema_errors(True, {"enum": [1]}) != []  # true is not 1
    with pytest.raises(ValueError, match="'pattern'"):
        schema_errors("a", {"type": "string", "pattern": "a+"})
    with pytest.raises(ValueError, match="unknown schema type"):
        schema_errors("a", {"type": "text"})


@pytest.mark.parametrize(
    "value, answer, correct",
    [
        (30, 30, 1),
        (30.0, 30, 1),  # numbers compare by value
        (3e1, 30, 1),
        ("30", 30, 0),  # a string is not a number (it also fails an integer schema)
        (31, 30, 0),
        (True, 1, 0),  # booleans are not numbers
        (12.5, 12.5, 1),
        (10**400, 1.0, 0),  # too large for a float: unequal, no crash
        (" ann ", "Ann", 1),  # strings after strip and casefold
        ("STRASSE", "straße", 1),
        ("Anne", "Ann", 0),
        ([1, 2], [1, 2], 1),
        ([2, 1], [1, 2], 0),  # lists exactly
        (["A"], ["a"], 0),  # strings inside lists exactly
        ({"a": [1.0]}, {"a": [1]}, 1),  # numbers inside by value
        ({"a": 1, "b": 2}, {"a": 1}, 0),
        (None, None, 1),
        (False, False, 1),
    ],
)
def test_answer_rule(value, answer, correct):
    completion = json.dumps({"age": value})
    assert json_answer_correct(completions=[completion], answer=[answer], answer_key=["age"]) == [
        correct
    ]


def test_answer_key_defaults_to_answer_and_a_missing_key_is_wrong():
    completions = ['{"answer": 7}', '{"result": 7}', "7"]
    assert json_answer_correct(completions=completions, answer=[7, 7, 7]) == [1, 0, 0]
    assert json_answer_correct(
        completions=['{"age": 7, "answer": 1}'], answer=[7], answer_key=["age"]
    ) == [1]


def test_weighted_totals_keep_the_answer_worth_more_than_format():
    completions = [
        GOOD,  # right answer, valid object:           1 + 1 + 1 + 4 - 0 = 7
        GOOD.replace("30", "31"),  # wrong answer, perfect format:  1 + 1 + 1 + 0 - 0 = 3
        GOOD + " The age is 30.",  # right, trailing prose:  1 + 1 + 1 + 4 - 1 = 6
        '{"name": "Ann", "age": 30}',  # right, a field missing:    1 + 0 + 0 + 4 - 0 = 5
        '{"name": "Ann", "age": 30} ok',  # right, field missing, prose: 1 + 0 + 0 + 4 - 1 = 4
        "Her age is 30.",  # no object:                       0 + 0 + 0 + 0 - 0 = 0
    ]
    n = len(completions)
    scores = score_completions(
        STRUCTURED_REWARDS,
        STRUCTURED_WEIGHTS,
        prompts=["p"] * n,
        completions=completions,
        fields={"schema": [SCHEMA] * n, "answer": [30] * n, "answer_key": ["age"] * n},
    )
    assert scores.total.tolist() == [7, 3, 6, 5, 4, 0]
    # A right answer never scores below everything format gives a wrong one.
    assert min(scores.total[[0, 2, 3, 4]]) > scores.total[1]
    assert scores.valid.all() and not any(scores.failures.values())
    assert scores.per_function["json_extra_text"].tolist() == [0, 0, 1, 0, 1, 0]
    # The best total is the sum of the positive weights (the penalty is then 0).
    assert max(scores.total) == sum(w for w in STRUCTURED_WEIGHTS.values() if w > 0)
    assert STRUCTURED_REWARDS.keys() == STRUCTURED_WEIGHTS.keys()
