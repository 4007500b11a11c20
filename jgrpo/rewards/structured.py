"""Rewards for structured output: a JSON object that parses, fits a schema, and holds the answer.

Each component is its own reward function, so every one is logged apart and a run shows which
part of the format the policy has (or has not) learned. All take TRL's signature and read the
example fields `schema` (a JSON schema), `answer` and `answer_key` (the name of the object's
field that holds the answer, "answer" when the example has none).

What counts as the object: the completion's text is stripped, the first `{` starts a candidate,
and a scanner that knows JSON strings and escapes finds its balanced closing `}` (so
`{"name": "a}b"}` is one object). That candidate must parse as strict JSON (no single quotes,
trailing commas or NaN); if it does not, the completion has no object. A later object is not
tried: the prompt asks for one object and nothing else. A single ```json ... ``` (or bare ```)
fence directly around the object is allowed and is not extra text.

    reward                weight  scores 1.0 when
    json_parses            +1     the completion holds a JSON object
    json_schema_valid      +1     the object validates against `schema`
    json_required_fields   +1     every key in `schema["required"]` is present (whatever its type)
    json_answer_correct    +4     object[answer_key] equals `answer` (rule below)
    json_extra_text        -1     there is non-whitespace text outside the object and its fence

Weight arithmetic (weighted totals; the best is 7, since the penalty is then 0):
    right answer, valid object, nothing else         1 + 1 + 1 + 4 - 0 = 7
    right answer, valid object, trailing prose       1 + 1 + 1 + 4 - 1 = 6
    right answer, a required field missing           1 + 0 + 0 + 4 - 0 = 5
    right answer, a required field missing, prose    1 + 0 + 0 + 4 - 1 = 4
    wrong answer, perfect format                     1 + 1 + 1 + 0 - 0 = 3
A right answer always scores at least 1 + 4 - 1 = 4 (it needs an object that parses), and
everything format can give a wrong answer adds up to 3: format never outweighs correctness.
The answer's weight is 4, not 2: with 2, a missing required field (which fails both the
schema and the required-fields check) would let a formatted wrong answer tie or beat a right
one.

Answer rule: the answer must have the reference's JSON kind. Numbers compare by value (30,
30.0 and 3e1 are all 30; booleans are not numbers), strings after strip() and casefold(),
lists, objects, booleans and null exactly (numbers inside them by value). So "30" for an
integer answer is wrong, and it also fails the schema: a type error is not a right answer.
Following JSON Schema, 30.0 is an integer (a number with no fractional part).

Schemas are checked by `schema_errors`, a small validator for the subset that structured-output
tasks use (jsonschema is not a dependency): type (object, array, string, integer, number,
boolean, null, or a list of them), properties, required, additionalProperties (a bool or a
schema), items (one schema), enum, minimum and maximum. An unsupported keyword raises rather
than being ignored, so a schema that asks for more is never passed silently.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from jgrpo.rewards.scoring import completion_text

_FENCE = "```"


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _object_end(text: str, start: int) -> int | None:
    """Index just past the `}` that balances the `{` at text[start], or None if unbalanced."""
    depth = 0
    in_string = escaped = False
    for index in range(start, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return index + 1
    return None


def _strip_fence(before: str, after: str) -> tuple[str, str]:
    """Drops a ```json (or ```) fence that directly wraps the object; both ends must be there."""
    head, tail = before.rstrip(), after.lstrip()
    if not tail.startswith(_FENCE):
        return before, after
    for opening in (_FENCE + "json", _FENCE):
        if head.lower().endswith(opening):
            return head[: -len(opening)], tail[len(_FENCE) :]
    return before, after


def extract_object(completion) -> tuple[dict | None, str]:
    """(the completion's JSON object or None, the text outside it and its fence).

    With no object the whole text counts as outside. See the module docstring for the rule.
    """
    text = completion_text(completion).strip()
    start = text.find("{")
    end = None if start < 0 else _object_end(text, start)
    if end is None:
        return None, text
    try:
        value = json.loads(text[start:end], parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return None, text
    before, after = _strip_fence(text[:start], text[end:])
    return value, before + after


# --------------------------------------------------------------------------- schema validation

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "number": lambda v: _is_number(v),
    "integer": lambda v: _is_number(v) and (isinstance(v, int) or v.is_integer()),
}
_VALIDATING = {
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "enum",
    "minimum",
    "maximum",
}
_ANNOTATIONS = {"$schema", "$id", "$comment", "title", "description", "default", "examples"}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _json_equal(a: Any, b: Any) -> bool:
    """Equality of JSON values: numbers by value, booleans never equal to numbers."""
    if _is_number(a) or _is_number(b):
        if not (_is_number(a) and _is_number(b)):
            return False
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        try:
            return float(a) == float(b)
        except OverflowError:  # an integer too large for a float cannot equal a float
            return False
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def schema_errors(value: Any, schema: Mapping[str, Any], path: str = "$") -> list[str]:
    """Why `value` fails `schema` (empty when it validates), each error prefixed by its path.

    Covers the subset in the module docstring; raises ValueError on any other keyword.
    """
    unknown = set(schema) - _VALIDATING - _ANNOTATIONS
    if unknown:
        raise ValueError(
            f"schema keyword(s) {sorted(unknown)} at {path} are not supported; this validator "
            f"covers {sorted(_VALIDATING)}."
        )
    errors: list[str] = []
    if "type" in schema:
        names = [schema["type"]] if isinstance(schema["type"], str) else list(schema["type"])
        for name in names:
            if name not in _TYPES:
                raise ValueError(f"unknown schema type {name!r} at {path}.")
        if not any(_TYPES[name](value) for name in names):
            errors.append(f"{path}: {value!r} is not of type {' or '.join(names)}")
    if "enum" in schema and not any(_json_equal(value, option) for option in schema["enum"]):
        errors.append(f"{path}: {value!r} is not one of {schema['enum']!r}")
    if _is_number(value):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value!r} is below the minimum {schema['minimum']!r}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value!r} is above the maximum {schema['maximum']!r}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path}: required property {key!r} is missing")
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in properties:
                errors += schema_errors(item, properties[key], f"{path}.{key}")
            elif extra is False:
                errors.append(f"{path}: additional property {key!r} is not allowed")
            elif isinstance(extra, Mapping):
                errors += schema_errors(item, extra, f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{path}[{index}]")
    return errors


# --------------------------------------------------------------------------- reward functions


def json_parses(completions, **_) -> list[float]:
    """1.0 when the completion holds a JSON object (see the module docstring), else 0.0."""
    return [float(extract_object(c)[0] is not None) for c in completions]


def json_schema_valid(completions, schema: Sequence[Mapping], **_) -> list[float]:
    """1.0 when the object validates against the example's schema; 0.0 when it fails or
    there is no object."""
    scores = []
    for completion, example_schema in zip(completions, schema, strict=True):
        value, _outside = extract_object(completion)
        scores.append(float(value is not None and not schema_errors(value, example_schema)))
    return scores


def json_required_fields(completions, schema: Sequence[Mapping], **_) -> list[float]:
    """1.0 when every key of the schema's top-level `required` is in the object (values are
    the schema reward's business), else 0.0; 0.0 when there is no object."""
    scores = []
    for completion, example_schema in zip(completions, schema, strict=True):
        value, _outside = extract_object(completion)
        required = example_schema.get("required", [])
        scores.append(float(value is not None and all(key in value for key in required)))
    return scores


def _answer_matches(got: Any, want: Any) -> bool:
    if isinstance(got, str) and isinstance(want, str):
        return got.strip().casefold() == want.strip().casefold()
    return _json_equal(got, want)


def json_answer_correct(
    completions, answer: Sequence[Any], answer_key: Sequence[str] | None = None, **_
) -> list[float]:
    """1.0 when object[answer_key] equals the example's answer (rule in the module docstring),
    else 0.0; answer_key defaults to "answer" when the examples have no such field."""
    keys = ["answer"] * len(completions) if answer_key is None else answer_key
    scores = []
    for completion, want, key in zip(completions, answer, keys, strict=True):
        value, _outside = extract_object(completion)
        scores.append(
            float(value is not None and key in value and _answer_matches(value[key], want))
        )
    return scores


def json_extra_text(completions, **_) -> list[float]:
    """1.0 when non-whitespace text lies outside the object and its fence, else 0.0 (weighted
    -1, so it is a penalty). 0.0 when there is no object: nothing is extra to a missing object,
    and a penalty there would rank an empty completion above any text without JSON."""
    scores = []
    for completion in completions:
        value, outside = extract_object(completion)
        scores.append(float(value is not None and bool(outside.strip())))
    return scores


STRUCTURED_REWARDS = {
    "json_parses": json_parses,
    "json_schema_valid": json_schema_valid,
    "json_required_fields": json_required_fields,
    "json_answer_correct": json_answer_correct,
    "json_extra_text": json_extra_text,
}
STRUCTURED_WEIGHTS = {
    "json_parses": 1.0,
    "json_schema_valid": 1.0,
    "json_required_fields": 1.0,
    "json_answer_correct": 4.0,
    "json_extra_text": -1.0,
}

__all__ = [
    "STRUCTURED_REWARDS",
    "STRUCTURED_WEIGHTS",
    "extract_object",
    "json_answer_correct",
    "json_extra_text",
    "json_parses",
    "json_required_fields",
    "json_schema_valid",
    "schema_errors",
]
