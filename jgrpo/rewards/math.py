"""Correctness reward for math answers: find the final answer, compare it by value.

A policy trained on a correctness reward learns whatever the checker lets through, so the
checker has two jobs: credit every way of writing the right answer (`1,234`, `1234.0`,
`\\frac{1}{2}` for `0.5`, `42 apples`, digits in any script) and credit nothing else (a hedge
such as "41 or 42", a box around each candidate). Numbers are compared as exact rationals
(`fractions.Fraction`), so float rounding never decides a reward.

The final answer of a completion is, in this priority (the last occurrence of a form wins):
  1. `\\boxed{...}` (nested braces allowed);
  2. GSM8K's `#### 42`;
  3. "The answer is 42" / "Answer: 42" (case-insensitive; up to the end of the sentence);
  4. `<answer>42</answer>`;
  5. lenient mode only: the last number in the text.
Closed `<think>...</think>` blocks are removed first: reasoning is never the answer.

Modes: "lenient" (the default) also takes the last number and compares text answers after
whitespace and case normalisation; "strict" accepts only the explicit forms, compares text
answers exactly and gives no answer when several boxed answers disagree. Numbers compare
by value in both modes. Pick a mode with `functools.partial(math_answer_reward, mode="strict")`.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from jgrpo.rewards.scoring import completion_text

MODES = ("lenient", "strict")

Completion = str | Sequence[dict[str, Any]]  # text, or chat messages ending with the reply

# Separators and signs written outside ASCII; digits of any script are mapped separately.
_ASCII = {
    "\u2212": "-",  # minus sign
    "\uff0d": "-",  # full-width hyphen-minus
    "\uff0b": "+",  # full-width plus
    "\u066b": ".",  # Arabic decimal separator
    "\u066c": ",",  # Arabic thousands separator
    "\uff0c": ",",  # full-width comma
    "\uff0e": ".",  # full-width full stop
    "\uff0f": "/",  # full-width solidus
    "\u2044": "/",  # fraction slash
}

_DECIMAL = r"(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?"  # 1,234.5 or 1234.5, no sign
_LATEX_FRAC = (  # \frac{a}{b}, or \frac12 with single digits
    r"\\[dt]?frac\s*(?:\{(?P<num>[^{}]*)\}|(?P<num1>[0-9]))(?:\{(?P<den>[^{}]*)\}|(?P<den1>[0-9]))"
)
# Words after a number ("42 apples", "5 km/h", "5km"), holding no digit or '='. A single
# letter right after the digits is algebra, not a unit: "5x", "2i" and "2π" are not numbers.
_UNIT = r"(?:\s+[^\W\d_][^\d=]*|[^\W\d_]{2,}[^\d=]*)?"

_NUMBER = re.compile(
    rf"(?P<sign>[-+]?)\s*(?:{_LATEX_FRAC}|(?P<value>{_DECIMAL})(?:\s*/\s*(?P<den2>{_DECIMAL}))?)"
    rf"{_UNIT}"
)
# A number inside running text; a sign counts only when it does not follow a word ("10-2").
_NUMBER_IN_TEXT = re.compile(
    r"(?:(?<![\w)}])[-+])?"
    rf"(?:\\[dt]?frac\s*\{{[^{{}}]*\}}\{{[^{{}}]*\}}|{_DECIMAL}(?:\s*/\s*{_DECIMAL})?)"
)
_THINK = re.compile(r"<think>(?:(?!<think>).)*?</think>", re.DOTALL)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_GSM8K = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_IS = re.compile(r"\banswer\s*(?:is\b\s*:?|:)", re.IGNORECASE)
# The value after it: up to a full stop (not a decimal point), a closing tag or the line's end.
_ANSWER_VALUE = re.compile(r"\s*(.*?)(?:\.(?:\s|$)|</|$)", re.MULTILINE)
# Tag bodies never span another opening tag, so unclosed tags cost linear time, not quadratic.
_ANSWER_TAG = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox|operatorname)\s*\{([^{}]*)\}")
_LATEX_NOISE = re.compile(r"\\[$%!,;:()\[\]]|\\left|\\right|\^\s*\{?\\circ\}?|\\circ|[$%°]")
_ASSIGNMENT = re.compile(r"^[A-Za-z]\w*\s*=\s*(?=\S)")  # "x = 5" -> "5"


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")


def _to_ascii(text: str) -> str:
    """Digits of any script (Arabic-Indic, full-width, ...) and their separators to ASCII."""
    chars = []
    for char in text:
        if char in _ASCII:
            chars.append(_ASCII[char])
        elif not char.isascii() and unicodedata.decimal(char, None) is not None:
            chars.append(str(unicodedata.decimal(char)))
        else:
            chars.append(char)
    return "".join(chars)


def _clean(text: str) -> str:
    """Drops what never changes an answer's value: math delimiters, `\\text{}`, `%`, `$`,
    currency symbols, markdown bold, degree marks, an `x =` prefix, end punctuation."""
    text = _to_ascii(text).replace("{,}", ",")
    text = _LATEX_TEXT.sub(r" \1", text)
    text = _LATEX_NOISE.sub("", text)
    text = "".join(char for char in text if unicodedata.category(char) != "Sc")
    text = text.strip(" \t\n*").rstrip(".,;:!").strip()  # end punctuation, markdown bold
    text = _ASSIGNMENT.sub("", text)
    return re.sub(r"(?<![0-9])\.(?=[0-9])", "0.", text)  # ".5" -> "0.5"


def _decimal(text: str) -> Fraction:
    return Fraction(text.replace(",", ""))


def parse_number(text: str) -> Fraction | None:
    """The exact value of a numeric answer, or None if `text` is not one number.

    Accepts signs, thousands separators, decimals, `a/b`, `\\frac{a}{b}` (`\\dfrac`,
    `\\tfrac`), `$`, `%`, currency symbols, digits of any script and trailing unit words
    ("42 apples"). A second number anywhere ("41 or 42") makes it not a number.
    """
    match = _NUMBER.fullmatch(_clean(text))
    if match is None:
        return None
    sign = -1 if match["sign"] == "-" else 1
    if match["value"] is not None:
        try:
            numerator = _decimal(match["value"])
            denominator = Fraction(1) if match["den2"] is None else _decimal(match["den2"])
        except ValueError:  # past Python's 4300-digit int limit: no answer anyone expects
            return None
    else:  # \frac{a}{b}: each part may itself be a signed number
        numerator = parse_number(match["num"] if match["num"] is not None else match["num1"])
        denominator = parse_number(match["den"] if match["den"] is not None else match["den1"])
        if numerator is None or denominator is None:
            return None
    if denominator == 0:
        return None
    return sign * numerator / denominator


def _normalize_text(text: str) -> str:
    return " ".join(_clean(text).split()).casefold()


def answers_match(predicted: str | None, reference: str, *, mode: str = "lenient") -> bool:
    """Whether two final answers agree: by exact value when both are numbers, else as text
    (whitespace- and case-insensitive in lenient mode, exact after stripping in strict)."""
    _check_mode(mode)
    if predicted is None:
        return False
    predicted_value, reference_value = parse_number(predicted), parse_number(reference)
    if predicted_value is not None and reference_value is not None:
        return predicted_value == reference_value
    if mode == "strict":
        return predicted.strip() == reference.strip()
    return _normalize_text(predicted) == _normalize_text(reference)


def _boxed(text: str) -> list[str]:
    """The contents of every `\\boxed{...}` with balanced braces, in order."""
    contents, start = [], 0
    while match := _BOXED.search(text, start):
        depth, end = 1, match.end()
        while end < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
        if depth:  # unbalanced (e.g. a truncated completion): not an answer
            break
        contents.append(text[match.end() : end - 1].strip())
        start = end
    return contents


def _last_answer_is(text: str) -> str | None:
    """The value after the last "answer is" / "answer:" that has one, up to the end of its
    sentence. Read from the end, so a text full of markers still costs linear time."""
    for end in reversed([match.end() for match in _ANSWER_IS.finditer(text)]):
        if value := _ANSWER_VALUE.match(text, end)[1].strip(" *_.,;:!"):
            return value
    return None


def extract_answer(text: str, *, mode: str = "lenient") -> str | None:
    """The final answer of a math completion (see the module docstring), or None.

    Digits of any script come back as ASCII digits.
    """
    _check_mode(mode)
    text = _THINK.sub(" ", _to_ascii(text))
    if boxed := _boxed(text):
        if mode == "strict" and any(not answers_match(b, boxed[-1], mode=mode) for b in boxed):
            return None  # several boxed candidates that disagree: a hedge
        return boxed[-1]
    for values in (_GSM8K.findall(text), [_last_answer_is(text)], _ANSWER_TAG.findall(text)):
        if values := [value.strip() for value in values if value and value.strip()]:
            return values[-1]
    if mode == "lenient" and (numbers := _NUMBER_IN_TEXT.findall(text)):
        return numbers[-1]
    return None


def reference_answer(reference: Any) -> str:
    """The final answer of a dataset's reference: a bare answer, or a worked solution that
    marks it (GSM8K's `... #### 72`, `\\boxed{72}`)."""
    if reference is None:
        raise ValueError("math_answer_reward needs a reference answer; got None.")
    text = str(reference)
    return extract_answer(text, mode="strict") or text.strip()


def math_answer_reward(
    prompts: Sequence[Any],
    completions: Sequence[Completion],
    answer: Sequence[Any],
    *,
    mode: str = "lenient",
    **_,
) -> list[float]:
    """1.0 when a completion's final answer equals the reference `answer`, else 0.0."""
    _check_mode(mode)
    return [
        float(
            answers_match(
                extract_answer(completion_text(completion), mode=mode),
                reference_answer(reference),
                mode=mode,
            )
        )
        for completion, reference in zip(completions, answer, strict=True)
    ]
