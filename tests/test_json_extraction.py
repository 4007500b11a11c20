"""The generated JSON-extraction task: seeded, held out, and solvable from its own ground truth."""

import json

import pytest

from jgrpo.rewards import score_completions
from jgrpo.rewards.structured import STRUCTURED_WEIGHTS, schema_errors
from jgrpo.tasks.json_extraction import SYSTEM_PROMPT, json_extraction_task


@pytest.fixture(scope="module")
def task():
    return json_extraction_task()


def _user_text(example) -> str:
    return example["prompt"][-1]["content"]


def test_examples_are_a_function_of_the_seed(task):
    assert json_extraction_task().train == task.train and json_extraction_task().eval == task.eval
    other = json_extraction_task(seed=1)
    assert [e["prompt"] for e in other.train] != [e["prompt"] for e in task.train]


def test_held_out_split_shares_no_prompt_with_training(task):
    train = [_user_text(e) for e in task.train]
    held = [_user_text(e) for e in task.eval]
    assert len(train) == 1800 and len(held) == 200
    assert len(set(train)) == 1800 and len(set(held)) == 200 and not set(train) & set(held)
    # held_out=0: the eval split is the training set, answered greedily.
    small = json_extraction_task(num_examples=10, held_out=0)
    assert small.eval == small.train and len(small.train) == 10
    with pytest.raises(ValueError, match="held_out"):
        json_extraction_task(num_examples=10, held_out=10)


def test_prompts_are_chat_messages_or_text(task):
    example = task.train[0]
    system, user = example["prompt"]
    assert system == {"role": "system", "content": SYSTEM_PROMPT} and user["role"] == "user"
    assert json.dumps(example["schema"]) in user["content"]
    plain = json_extraction_task(num_examples=5, held_out=1, chat=False)
    assert isinstance(plain.train[0]["prompt"], str)
    assert plain.train[0]["prompt"].startswith(SYSTEM_PROMPT)
    assert json.dumps(plain.train[0]["schema"]) in plain.train[0]["prompt"]
    assert task.tokenizer is None and task.correctness == "json_answer_correct"


def test_ground_truth_is_stated_in_the_text_and_the_schema_varies(task):
    shapes, keys = set(), set()
    for example in task.train + task.eval:
        text, record = _user_text(example), example["record"]
        schema = example["schema"]
        assert list(record) == schema["required"] == list(schema["properties"])
        assert schema["additionalProperties"] is False and 3 <= len(record) <= 6
        assert example["answer"] == record[example["answer_key"]]
        facts = {
            "name": lambda v: v,
            "age": str,
            "city": lambda v: v,
            "item": lambda v: f"{v}s",
            "quantity": lambda v: f" {v} ",
            "unit_price": lambda v: f"${v:.2f}",
        }
        for field, value in record.items():
            assert facts[field](value) in text, (field, value, text)
        shapes.add(tuple(record))
        keys.add(example["answer_key"])
    assert len(shapes) > 100 and len(keys) == 6


def test_every_examples_ground_truth_scores_full_marks(task):
    examples = task.train + task.eval
    for example in examples:
        assert schema_errors(example["record"], example["schema"]) == []
    # A perfect completion built from the generator's ground truth, fenced or bare, chat or not.
    completions = [
        json.dumps(e["record"]) if i % 2 else f"```json\n{json.dumps(e['record'], indent=2)}\n```"
        for i, e in enumerate(examples)
    ]
    completions = [
        c if i % 3 else [{"role": "assistant", "content": c}] for i, c in enumerate(completions)
    ]
    fields = {key: [e[key] for e in examples] for key in ("schema", "answer", "answer_key")}
    scores = score_completions(
        task.reward_fns,
        task.reward_weights,
        prompts=[e["prompt"] for e in examples],
        completions=completions,
        fields=fields,
    )
    best = sum(w for w in STRUCTURED_WEIGHTS.values() if w > 0)  # 7: the penalty is 0
    assert scores.total.tolist() == [best] * len(examples)
    assert scores.per_function["json_answer_correct"].tolist() == [1] * len(examples)
    assert scores.per_function["json_extra_text"].tolist() == [0] * len(examples)


def test_a_wrong_age_in_a_perfect_object_loses_only_the_answer(task):
    example = next(e for e in task.eval if e["answer_key"] == "age")
    record = dict(example["record"], age=19 if example["answer"] == 18 else 18)
    assert record["age"] != example["answer"] and not schema_errors(record, example["schema"])
    fields = {key: [example[key]] for key in ("schema", "answer", "answer_key")}
    scores = score_completions(
        task.reward_fns, task.reward_weights, ["p"], [json.dumps(record)], fields
    )
    assert scores.total.tolist() == [3]  # 1 + 1 + 1 + 0 - 0
