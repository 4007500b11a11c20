"""GSM8K: answer parsing, prompts, local JSONL and offline TFDS sources, the task's rewards."""

import json
import pathlib

import pytest
from offline import forbid_tfds_downloads, refusing_url

from jgrpo.tasks import gsm8k
from jgrpo.tasks.datasets import DatasetError
from jgrpo.tasks.gsm8k import DEFAULT_SYSTEM, gsm8k_examples, gsm8k_task, parse_answer

ROOT = pathlib.Path(__file__).parent.parent
DATA = ROOT / "tests" / "data" / "gsm8k"  # train.jsonl (3 rows), test.jsonl (2)


@pytest.mark.parametrize(
    "solution, answer",
    [
        ("3 * 4 = <<3*4=12>>12\n#### 12", "12"),
        ("so 1,234 in all.\n#### 1,234", "1234"),  # thousands commas removed
        ("#### 1 000", "1000"),
        ("4 - 9 = -5\n#### -5", "-5"),
        ("half of 7 is 3.5\n####3.5 ", "3.5"),
        ("a #### in the text\n#### 7", "7"),  # the last mark is the answer
    ],
)
def test_the_reference_is_the_number_after_the_last_mark(solution, answer):
    assert parse_answer(solution) == answer


@pytest.mark.parametrize(
    "solution, problem",
    [
        ("The answer is 12.", "no '####'"),
        ("#### twelve", "not a number: 'twelve'"),
        ("####", "not a number: ''"),
    ],
)
def test_solutions_without_a_final_number_are_rejected(solution, problem):
    with pytest.raises(ValueError, match=problem):
        parse_answer(solution)


def test_jsonl_source_builds_chat_prompts_with_the_system_prompt():
    train = gsm8k_examples("train", source="jsonl", path=DATA)
    assert [e["answer"] for e in train] == ["12", "2434", "-5"]
    first = json.loads((DATA / "train.jsonl").read_text().splitlines()[0])
    assert train[0] == {
        "prompt": [
            {"role": "system", "content": DEFAULT_SYSTEM},
            {"role": "user", "content": first["question"]},
        ],
        "answer": "12",
        "solution": first["answer"],
    }
    assert "<think></think>" in DEFAULT_SYSTEM and "<answer></answer>" in DEFAULT_SYSTEM
    bare = gsm8k_examples("test", source="jsonl", path=DATA, system_prompt=None)
    assert [len(e["prompt"]) for e in bare] == [1, 1]  # only the user's turn


def test_text_prompts_put_the_system_prompt_before_the_question():
    (first, *_) = gsm8k_examples("test", source="jsonl", path=DATA, chat=False, system_prompt="S")
    assert (
        first["prompt"]
        == "S\n\n" + "A train travels 60 miles each hour for 2 hours. How far does it go?"
    )
    (first, *_) = gsm8k_examples("test", source="jsonl", path=DATA, chat=False, system_prompt="")
    assert first["prompt"].startswith("A train")


def test_rows_without_a_final_answer_are_reported_by_row(tmp_path, caplog):
    rows = [
        {"question": "q1", "answer": "x\n#### 1"},
        {"question": "q2", "answer": "no mark here"},
        {"question": ["q3"], "answer": "#### 3"},
        {"question": "q4", "answer": "#### 4"},
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError) as raised:
        gsm8k_examples("train", source="jsonl", path=tmp_path)
    assert "train.jsonl row 2: answer has no '####'" in str(raised.value)
    assert "train.jsonl row 3: " in str(raised.value)
    kept = gsm8k_examples("train", source="jsonl", path=tmp_path, on_error="skip")
    assert [e["answer"] for e in kept] == ["1", "4"]


def test_bad_sources_are_named():
    with pytest.raises(ValueError, match="needs path="):
        gsm8k_examples("train", source="jsonl")
    with pytest.raises(FileNotFoundError, match="no dev.jsonl or dev.json"):
        gsm8k_examples("dev", source="jsonl", path=DATA)
    with pytest.raises(ValueError, match="source must be"):
        gsm8k_examples("train", source="csv")


def test_the_recipe_page_counts_the_example_rows():
    rows = {
        split: len((DATA / f"{split}.jsonl").read_text().splitlines())
        for split in ("train", "test")
    }
    page = " ".join((ROOT / "docs" / "recipes.md").read_text().split())
    assert (
        f"(`tests/data/gsm8k` is an example with {rows['train']} training and {rows['test']} "
        "test rows)" in page
    )


def test_a_mistyped_path_says_so_in_one_line():
    with pytest.raises(FileNotFoundError) as raised:
        gsm8k_examples("train", source="jsonl", path=f"{DATA}k")
    assert str(raised.value) == (
        f"the GSM8K path {DATA}k does not exist: give task.path (path=) a folder holding "
        "train.jsonl and test.jsonl, like tests/data/gsm8k."
    )
    with pytest.raises(FileNotFoundError, match="train.jsonl is a file: give task.path"):
        gsm8k_examples("train", source="jsonl", path=DATA / "train.jsonl")


def test_the_recipe_without_network_fails_at_once_naming_the_local_rows(tmp_path, monkeypatch):
    """TFDS's gsm8k not prepared and its download host unreachable: one line that names
    task.path, before TFDS starts a download (offline it retried for minutes, then ended in a
    requests traceback)."""
    from jgrpo.config import load_config
    from jgrpo.train import build_task

    forbid_tfds_downloads(monkeypatch)
    config = load_config(
        ROOT / "configs" / "gsm8k-qwen2.5-0.5b.yaml", ["smoke", f"task.data_dir={tmp_path}"]
    )
    with refusing_url() as url:
        monkeypatch.setattr(gsm8k, "DOWNLOAD_URL", url)
        with pytest.raises(ConnectionError) as raised:
            build_task(config)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"TFDS gsm8k is not prepared in {tmp_path}")
    assert f"no connection to {url[7:-1]} (Connection refused)" in message
    assert message.endswith(gsm8k.OFFLINE_HINT) and "task.path=DIR" in message


def test_the_cli_without_network_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """The same from `python -m jgrpo.train`: exit status 2 and the one line, no traceback."""
    import logging

    from jgrpo import train as train_module

    # main() logs through a handler on the stderr of its first call: give it this test's.
    monkeypatch.setattr(logging.getLogger("jgrpo"), "handlers", [])
    forbid_tfds_downloads(monkeypatch)
    recipe = str(ROOT / "configs" / "gsm8k-qwen2.5-0.5b.yaml")
    with refusing_url() as url:
        monkeypatch.setattr(gsm8k, "DOWNLOAD_URL", url)
        argv = [recipe, "smoke", f"task.data_dir={tmp_path}", f"train.run_dir={tmp_path}/run"]
        assert train_module.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    assert line.startswith(f"error: TFDS gsm8k is not prepared in {tmp_path}")
    assert line.endswith(gsm8k.OFFLINE_HINT)


@pytest.fixture(scope="module")
def gsm8k_tfds_dir(tmp_path_factory):
    """A data_dir with a tiny `gsm8k` 1.0.0, shaped like TFDS's own, as ArrayRecord files."""
    import array_record  # noqa: F401  (TFDS data sources read ArrayRecord files)
    import tensorflow_datasets as tfds

    # The same name, version and features as TFDS's gsm8k, so its own builder can read these
    # files; skip_registration leaves that builder's name to it.
    class Gsm8k(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            names = ["question", "answer", "annotation", "short_answer"]
            features = tfds.features.FeaturesDict({n: tfds.features.Text() for n in names})
            # TFDS shuffles the real one; kept in file order here so rows compare one to one.
            return tfds.core.DatasetInfo(builder=self, features=features, disable_shuffling=True)

        def _split_generators(self, dl_manager):
            return {split: self._generate_examples(split) for split in ("train", "test")}

        def _generate_examples(self, split):
            lines = (DATA / f"{split}.jsonl").read_text().splitlines()
            for key, line in enumerate(lines):
                row = json.loads(line)
                row["annotation"], row["short_answer"] = row["answer"].split("#### ")
                yield key, row

    directory = tmp_path_factory.mktemp("tfds")
    Gsm8k(data_dir=str(directory), file_format="array_record").download_and_prepare()
    return directory


def test_tfds_source_reads_the_same_examples_offline(gsm8k_tfds_dir):
    from_tfds = gsm8k_examples("train", data_dir=gsm8k_tfds_dir)
    assert from_tfds == gsm8k_examples("train", source="jsonl", path=DATA)
    assert [e["answer"] for e in gsm8k_examples("test[:1]", data_dir=gsm8k_tfds_dir)] == ["120"]


def test_a_prepared_copy_is_read_without_trying_the_download_host(gsm8k_tfds_dir, monkeypatch):
    forbid_tfds_downloads(monkeypatch)
    with refusing_url() as url:
        monkeypatch.setattr(gsm8k, "DOWNLOAD_URL", url)
        assert len(gsm8k_examples("train", data_dir=gsm8k_tfds_dir)) == 3


def test_task_scores_with_the_math_and_layout_rewards(gsm8k_tfds_dir):
    from jgrpo.rewards.format import layout_reward
    from jgrpo.rewards.math import math_answer_reward

    task = gsm8k_task(data_dir=gsm8k_tfds_dir, eval_size=1)
    assert task.name == "gsm8k" and task.tokenizer is None
    assert len(task.train) == 3 and [e["answer"] for e in task.eval] == ["120"]
    assert task.reward_fns == {"correct": math_answer_reward, "format": layout_reward}
    assert task.reward_weights == {"correct": 1.0, "format": 0.2}
    assert task.correctness == "correct" and task.max_reward == pytest.approx(1.2)
    # The reference as parsed is what the correctness reward checks against.
    prompts = [e["prompt"] for e in task.train]
    answers = [e["answer"] for e in task.train]
    right = [
        [{"role": "assistant", "content": f"<think>ok</think><answer>{a}</answer>"}]
        for a in answers
    ]
    wrong = [[{"role": "assistant", "content": "<think>ok</think><answer>7</answer>"}]] * 3
    assert task.reward_fns["correct"](prompts, right, answer=answers) == [1.0, 1.0, 1.0]
    assert task.reward_fns["correct"](prompts, wrong, answer=answers) == [0.0, 0.0, 0.0]
    # The layout the default system prompt asks for is the one the format reward checks.
    assert task.reward_fns["format"](prompts, right) == [1.0, 1.0, 1.0]
    bare = [[{"role": "assistant", "content": a}] for a in answers]
    assert task.reward_fns["format"](prompts, bare) == [0.0, 0.0, 0.0]

    local = gsm8k_task(source="jsonl", path=DATA, eval_split=None, chat=False)
    assert local.eval == local.train and isinstance(local.train[0]["prompt"], str)
    with pytest.raises(ValueError, match="eval_size=5 but the eval split 'test' has only 2"):
        gsm8k_task(source="jsonl", path=DATA, eval_size=5)
