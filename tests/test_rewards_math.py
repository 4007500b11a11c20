"""Math answer checking: extraction, exact numeric comparison, the reward, strict vs lenient."""

import functools
from fractions import Fraction

import pytest

from jgrpo.rewards import score_completions
from jgrpo.rewards.math import (
    answers_match,
    completion_text,
    extract_answer,
    math_answer_reward,
    parse_number,
    reference_answer,
)

strict_reward = functools.partial(math_answer_reward, mode="strict")


def reward(completion, answer, mode="lenient"):
    (score,) = math_answer_reward(["prompt"], [completion], [answer], mode=mode)
    return score


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("42", Fraction(42)),
        ("-7", Fraction(-7)),
        ("+7", Fraction(7)),
        ("\u22125", Fraction(-5)),  # unicode minus sign
        ("1,234", Fraction(1234)),
        ("1,234,567.25", Fraction(4938269, 4)),
        ("3.50", Fraction(7, 2)),
        ("2.0", Fraction(2)),
        (".5", Fraction(1, 2)),
        ("42.", Fraction(42)),
        ("1/2", Fraction(1, 2)),
        ("-3/4", Fraction(-3, 4)),
        (r"\frac{1}{2}", Fraction(1, 2)),
        (r"\dfrac{3}{4}", Fraction(3, 4)),
        (r"\tfrac{1}{3}", Fraction(1, 3)),
        (r"\frac12", Fraction(1, 2)),
        (r"-\frac{1}{2}", Fraction(-1, 2)),
        (r"\frac{-1}{2}", Fraction(-1, 2)),
        (r"\frac{1.5}{3}", Fraction(1, 2)),
        ("$1,234.50", Fraction(2469, 2)),
        (r"\$18", Fraction(18)),
        ("€5", Fraction(5)),
        ("50%", Fraction(50)),
        (r"50\%", Fraction(50)),
        ("42 apples", Fraction(42)),
        ("5 km", Fraction(5)),
        ("5km", Fraction(5)),
        ("12 km/h", Fraction(12)),
        (r"42 \text{ apples}", Fraction(42)),
        (r"\text{42}", Fraction(42)),
        (r"90^\circ", Fraction(90)),
        ("90°", Fraction(90)),
        ("x = 5", Fraction(5)),
        ("**42**", Fraction(42)),
        ("$-5$", Fraction(-5)),
        (r"1{,}234", Fraction(1234)),
        ("\u0664\u0662", Fraction(42)),  # Arabic-Indic ٤٢
        ("\u06f4\u06f2", Fraction(42)),  # Extended Arabic-Indic (Persian) ۴۲
        ("\uff14\uff12", Fraction(42)),  # full-width ４２
        ("\u0968\u096a", Fraction(24)),  # Devanagari २४
        ("\u0663\u066b\u0665", Fraction(7, 2)),  # ٣٫٥ with the Arabic decimal separator
    ],
)
def test_parse_number_accepts_every_spelling(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize(
    "text",
    [
        "41 or 42",  # a hedge is not one number
        "42 or maybe 41",
        "6*7",
        "1,23",  # not a thousands separator
        "1 1/2",
        "5x",  # algebra, not a unit
        "2π",
        r"2\pi",
        "1/0",
        "(5)",
        "five",
        "",
        "x = 5 = 6",
        "5 m^2",  # a digit after the number: refuse rather than guess
    ],
)
def test_parse_number_refuses_what_is_not_one_number(text):
    assert parse_number(text) is None


def test_comparison_is_exact_not_floating_point():
    assert 0.1 + 0.2 != 0.3  # what a float comparison would trip over
    assert answers_match("0.3", "3/10")
    assert answers_match(r"\frac{1}{3}", "1/3")
    assert not answers_match("0.3333333333", "1/3")
    assert not answers_match("0.30000000000000004", "0.3")


@pytest.mark.parametrize("mode", ["lenient", "strict"])
@pytest.mark.parametrize(
    ("predicted", "reference"),
    [
        ("3.50", "3.5"),
        ("2.0", "2"),
        ("0.5", r"\frac{1}{2}"),
        (r"\dfrac{1}{2}", "1/2"),
        ("1234", "1,234"),
        ("$1,234", "1234"),
        ("42 apples", "42"),
        ("\u0664\u0662", "42"),
        ("-0.25", "-1/4"),
    ],
)
def test_numbers_match_by_value_in_both_modes(predicted, reference, mode):
    assert answers_match(predicted, reference, mode=mode)


def test_text_answers_lenient_ignores_case_and_spacing_strict_does_not():
    assert answers_match("  New   York ", "new york")
    assert not answers_match("  New   York ", "new york", mode="strict")
    assert answers_match(" Paris ", "Paris", mode="strict")
    assert not answers_match("Paris", "London")
    assert not answers_match("2 3", "23")  # spacing collapses but never vanishes
    assert not answers_match(None, "42")


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        (r"So $x = \boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        (r"\boxed{\left\{1, 2\right\}}", r"\left\{1, 2\right\}"),  # nested and escaped braces
        (r"\boxed {7}", "7"),
        (r"\fbox{7}", "7"),
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),
        ("#### 1,234\n", "1,234"),
        ("The answer is 42.", "42"),
        ("Thus the final answer is: 3.5.", "3.5"),
        ("The answer is $3.5$. Next we check 17.", "$3.5$"),
        ("**Answer:** 42", "42"),
        ("ANSWER: 9", "9"),
        ("The answer is:\n\n12", "12"),
        ("The answer is 41. Wait, no: the answer is 42. Also 17 is prime.", "42"),
        ("<answer> 42 </answer>", "42"),
        ("<answer>7</answer> then <answer>8</answer>", "8"),
        ("<answer>\nThe answer is 42</answer>", "42"),
        ("<think>the answer is 41</think>\n<answer>42</answer>", "42"),  # reasoning is skipped
        ("The answer is \u0664\u0662.", "42"),  # digits come back as ASCII
        (r"The answer is 3 but \boxed{4}", "4"),  # boxed outranks prose
        ("The answer is 5\n#### 6", "6"),  # GSM8K's marker outranks prose
        ("<answer>5</answer> so the answer is 6", "6"),  # prose outranks tags
    ],
)
def test_extract_explicit_forms_in_both_modes(text, answer):
    assert extract_answer(text) == answer
    assert extract_answer(text, mode="strict") == answer


@pytest.mark.parametrize(
    ("text", "lenient"),
    [
        ("6 * 7 = 42", "42"),
        ("We get 1,234 in total.", "1,234"),
        ("The change in temperature is 10-12", "12"),  # a minus after a digit is not a sign
        ("so x = -2", "-2"),
        (r"Half is \frac{1}{2}", r"\frac{1}{2}"),
        ("three quarters, i.e. 3/4", "3/4"),
        ("<think>6 * 7 = 42</think> it is 41", "41"),
        ("<think>6 * 7 = 42</think>", None),  # only reasoning: no answer
        (r"truncated \boxed{42", "42"),  # an unclosed box is not an answer
        ("no digits here", None),
        ("", None),
    ],
)
def test_last_number_fallback_is_lenient_only(text, lenient):
    assert extract_answer(text) == lenient
    assert extract_answer(text, mode="strict") is None


def test_strict_refuses_disagreeing_boxes_lenient_takes_the_last():
    hedge = r"It is \boxed{41} or \boxed{42}."
    assert extract_answer(hedge) == "42"
    assert extract_answer(hedge, mode="strict") is None
    same = r"\boxed{0.5}, that is \boxed{\frac{1}{2}}"  # agreeing boxes are no hedge
    assert extract_answer(same, mode="strict") == r"\frac{1}{2}"


def test_reference_answer_reads_bare_answers_and_gsm8k_solutions():
    solution = "She earns 12 * 100 = <<12*100=1200>>1200 and 34 more.\n#### 1,234"
    assert reference_answer(solution) == "1,234"
    assert reference_answer(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert reference_answer(" 42 ") == "42"
    assert reference_answer(42) == "42"
    with pytest.raises(ValueError, match="reference"):
        reference_answer(None)


@pytest.mark.parametrize(
    ("completion", "answer", "lenient", "strict"),
    [
        # right answers, written many ways
        (r"Step 1 ... \boxed{1234}", "#### 1,234", 1.0, 1.0),
        ("The answer is 1234.0 dollars.", "She pays...\n#### 1,234", 1.0, 1.0),
        ("The answer is $1,234.", "1234", 1.0, 1.0),
        ("Answer: \u0661\u0662\u0663\u0664", "1234", 1.0, 1.0),
        ("The answer is \uff11\uff12\uff13\uff14.", "1234", 1.0, 1.0),
        ("The answer is 42 apples.", "42", 1.0, 1.0),
        (r"\boxed{\dfrac{1}{2}}", "0.5", 1.0, 1.0),
        ("#### -3", "-3", 1.0, 1.0),
        ("The answer is +3", "3", 1.0, 1.0),
        ("The answer is 3.50", "3.5", 1.0, 1.0),
        ("<answer>25%</answer>", "25", 1.0, 1.0),
        ("The answer is 42. Then 17 and 99 show up in the check.", "42", 1.0, 1.0),
        ("The answer is 41. Wait, I made an error: the answer is 42.", "42", 1.0, 1.0),
        ("<think>maybe 41</think><answer>42</answer>", "42", 1.0, 1.0),
        ("<think>the answer is 41</think><answer>42</answer>", "41", 0.0, 0.0),
        # lenient only
        ("6 * 7 = 42", "42", 1.0, 0.0),
        ("The capital is: paris", "Paris", 0.0, 0.0),
        ("The answer is paris", "Paris", 1.0, 0.0),
        (r"\boxed{41} \boxed{42}", "42", 1.0, 0.0),
        # wrong or hedged: never credit
        ("The answer is 41 or 42", "42", 0.0, 0.0),
        ("The answer is 41 or 42", "41", 0.0, 0.0),
        ("The answer is 42 or 41", "42", 0.0, 0.0),
        (r"\boxed{41} \boxed{42}", "41", 0.0, 0.0),
        ("The answer is 41. It is not 42.", "42", 0.0, 0.0),  # the marker's value decides
        (r"\boxed{41}. The true answer is 42.", "42", 0.0, 0.0),  # the box outranks prose
        ("The answer is 4", "42", 0.0, 0.0),
        ("The answer is 42", "-42", 0.0, 0.0),
        ("The answer is 1,234", "1234.5", 0.0, 0.0),
        ("The answer is 5x", "5", 0.0, 0.0),
        ("no answer at all", "42", 0.0, 0.0),
        ("", "0", 0.0, 0.0),
    ],
)
def test_math_answer_reward(completion, answer, lenient, strict):
    assert reward(completion, answer) == lenient
    assert reward(completion, answer, mode="strict") == strict


def test_chat_completions_and_extra_fields():
    chat = [
        [{"role": "assistant", "content": "The answer is 42."}],
        [
            {"role": "user", "content": "the answer is 42"},
            {"role": "assistant", "content": "I think it is 41."},
        ],
    ]
    assert completion_text(chat[1]) == "I think it is 41."
    scores = math_answer_reward(
        prompts=[[{"role": "user", "content": "6*7?"}]] * 2,
        completions=chat,
        answer=["42", "42"],
        completion_ids=[[1, 2], [3]],
    )
    assert scores == [1.0, 0.0]
    assert strict_reward(prompts=["p"], completions=["6*7=42"], answer=["42"]) == [0.0]
    assert strict_reward.func(prompts=["p"], completions=["6*7=42"], answer=["42"]) == [1.0]


def test_bad_mode_and_length_mismatch_raise():
    with pytest.raises(ValueError, match="mode"):
        math_answer_reward(["p"], ["42"], ["42"], mode="loose")
    with pytest.raises(ValueError, match="mode"):
        extract_answer("42", mode="exact")
    with pytest.raises(ValueError):
        math_answer_reward(["p", "p"], ["42", "41"], ["42"])


def test_runs_under_score_completions():
    scores = score_completions(
        {"correct": math_answer_reward, "strict": strict_reward},
        {"correct": 1.0, "strict": 0.5},
        ["p"] * 3,
        [r"\boxed{1234}", "so 1234", "The answer is 41 or 1234"],
        {"answer": ["#### 1,234"] * 3, "completion_ids": [[1]] * 3},
    )
    assert scores.per_function["correct"].tolist() == [1.0, 1.0, 0.0]
    assert scores.per_function["strict"].tolist() == [1.0, 0.0, 0.0]
    assert scores.total.tolist() == [1.5, 1.0, 0.0]


def test_long_adversarial_texts_are_handled():
    # each would take quadratic time (or raise) with a naive regex or int conversion
    assert extract_answer("the answer is " * 5000 + "the answer is 42.") == "42"
    assert extract_answer("<answer>" * 20000 + "<answer>7</answer>", mode="strict") == "7"
    assert extract_answer("<think>" * 20000 + "3", mode="strict") is None
    assert parse_number("9" * 20000) is None  # past Python's int-from-text digit limit
    assert reward("The answer is " + "9" * 20000, "9") == 0.0
