"""Layout rewards: the think-then-answer layout, custom patterns, per-tag partial credit."""

import pytest

from jgrpo.rewards import score_completions
from jgrpo.rewards.format import (
    THINK_ANSWER,
    layout_reward,
    make_layout_reward,
    tag_count_reward,
)


def layout(completion, **kwargs):
    (score,) = layout_reward(["prompt"], [completion], **kwargs)
    return score


@pytest.mark.parametrize(
    "completion",
    [
        "<think>6 * 7 = 42</think><answer>42</answer>",
        "<think>\nFirst, 6 * 7.\nThat is 42.\n</think>\n\n<answer>\n42\n</answer>",
        "  <think>x</think> <answer>y</answer>\n\n",  # surrounding whitespace is stripped
        "<think>a < b and b > c</think><answer>a < c</answer>",  # other angle brackets are fine
        "<think>use <b>bold</b></think><answer>ok</answer>",
    ],
)
def test_think_answer_layout_accepted(completion):
    assert layout(completion) == 1.0


@pytest.mark.parametrize(
    "completion",
    [
        "<think>reason</think><answer>42",  # missing closing tag
        "<think>reason<answer>42</answer>",
        "<think>reason</think><answer>42</answer> Hope this helps!",  # text after </answer>
        "<think>reason</think><answer>42</answer><answer>41</answer>",  # two answer blocks
        "<think>reason</think><answer>42</answer>\n<answer>41</answer>",
        "<think></think><answer>42</answer>",  # empty think
        "<think> \n\t </think><answer>42</answer>",  # blank think
        "<think>reason</think><answer></answer>",  # empty answer
        "<think>reason</think><answer>  </answer>",
        "<think>a</think><think>b</think><answer>42</answer>",  # two think blocks
        "<think>a <think>b</think><answer>42</answer>",  # nested think
        "<think>a</think><answer>4<answer>2</answer>",  # nested answer
        "Sure! <think>reason</think><answer>42</answer>",  # text before <think>
        "<think>reason</think> so <answer>42</answer>",  # text between the blocks
        "<answer>42</answer><think>reason</think>",  # wrong order
        "<answer>42</answer>",
        "<think>reason</think>",
        "42",
        "",
        "<THINK>reason</THINK><ANSWER>42</ANSWER>",  # tags are case-sensitive
    ],
)
def test_think_answer_near_misses_score_zero(completion):
    assert layout(completion) == 0.0


def test_chat_completions_and_extra_fields():
    completions = [
        [{"role": "assistant", "content": "<think>r</think><answer>1</answer>"}],
        [
            {"role": "user", "content": "<think>r</think><answer>1</answer>"},
            {"role": "assistant", "content": "1"},
        ],
    ]
    scores = layout_reward(["p", "p"], completions, answer=["1", "1"], completion_ids=[[], []])
    assert scores == [1.0, 0.0]


def test_custom_pattern():
    # a template that opens the think block in the prompt
    opened = r".+?</think>\s*<answer>.+?</answer>"
    assert layout("reason</think><answer>42</answer>", pattern=opened) == 1.0
    assert layout("reason</think><answer>42</answer>") == 0.0
    assert layout("anything\nat all", pattern=r"anything.at all") == 1.0  # DOTALL
    assert layout("x", pattern=THINK_ANSWER) == 0.0


def test_make_layout_reward_names_and_validates():
    digits = make_layout_reward(r"[0-9]+", name="digits_only")
    assert digits.__name__ == "digits_only"
    assert digits(["p"] * 3, [" 12 ", "1a", [{"role": "assistant", "content": "7"}]]) == [
        1.0,
        0.0,
        1.0,
    ]
    assert digits(prompts=["p"], completions=["3"], answer=["3"], pattern=["ignored"]) == [1.0]
    assert make_layout_reward(THINK_ANSWER).__name__ == "layout_reward"
    with pytest.raises(ValueError, match=r"\(unclosed"):
        make_layout_reward("(unclosed")
    with pytest.raises(ValueError, match="invalid layout pattern"):
        layout_reward(["p"], ["x"], pattern="[")


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("<think>r</think><answer>1</answer>", 1.0),
        ("<think>r</think><answer>1", 0.75),
        ("<think>r</think>", 0.5),
        ("<think>r</think><answer>1</answer><answer>2</answer>", 0.5),  # doubled tags: none
        ("plain text", 0.0),
    ],
)
def test_tag_count_reward(completion, score):
    assert tag_count_reward(["p"], [completion]) == [score]


def test_runs_under_score_completions():
    scores = score_completions(
        {"layout": layout_reward, "tags": tag_count_reward},
        {"layout": 1.0, "tags": 0.5},
        ["p", "p"],
        ["<think>r</think><answer>1</answer>", "<think>r</think><answer>1"],
        {"answer": ["1", "1"], "completion_ids": [[1], [2]]},
    )
    assert scores.per_function["layout"].tolist() == [1.0, 0.0]
    assert scores.total.tolist() == [1.5, 0.375]
