"""Tasks: seeded resumable data order and the demo task's verifiers."""

from collections import Counter

import pytest

from jgrpo import tasks
from jgrpo.tasks.arithmetic import addition_task, char_tokenizer, correct_reward


def test_take_is_a_pure_function_of_seed_and_position():
    data = [{"prompt": str(i)} for i in range(10)]
    first = tasks.take(data, 25, position=0, seed=3)
    # Any split of the stream gives the same examples: a resumed run continues exactly.
    assert (
        tasks.take(data, 12, position=0, seed=3) + tasks.take(data, 13, position=12, seed=3)
        == first
    )
    # Each epoch is a permutation: every example once per 10.
    for epoch in range(2):
        assert Counter(e["prompt"] for e in first[10 * epoch : 10 * epoch + 10]) == Counter(
            str(i) for i in range(10)
        )
    assert first[:10] != first[10:20]  # epochs are reshuffled
    assert tasks.take(data, 10, position=0, seed=4) != first[:10]


def test_addition_rewards_check_the_sum_and_the_form():
    task = addition_task(max_operand=9)
    assert len(task.train) == 100 and task.max_reward == pytest.approx(1.2)
    completions = ["7", " 7", "07", "8", "7+", "777", ""]
    answers = ["7"] * len(completions)
    assert correct_reward(completions, answer=answers) == [1, 1, 0, 0, 0, 0, 0]
    # Format: a bare integer of at most 2 digits (the longest sum, 18), whatever its value.
    assert task.reward_fns["format"](completions) == [1, 1, 1, 1, 0, 0, 0]
    chat = [[{"role": "assistant", "content": "7"}]]
    assert correct_reward(chat, answer=["7"]) == [1.0]


def test_addition_held_out_problems_are_not_trained_on():
    task = addition_task(max_operand=4, held_out=5, seed=1)
    train = {e["prompt"] for e in task.train}
    held = {e["prompt"] for e in task.eval}
    assert len(held) == 5 and len(train) == 20 and not train & held


def test_char_tokenizer_round_trips_and_prepends_bos():
    tokenizer = char_tokenizer()
    ids = tokenizer("12+3=")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 6
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12+3="


def test_unknown_task_names_the_known_ones():
    with pytest.raises(
        ValueError, match="built-in tasks: addition, lookup, json_extraction, gsm8k, jsonl, tfds"
    ):
        tasks.get_task("gsm9k")
