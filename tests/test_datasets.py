"""Prompt datasets: JSON/JSONL and TFDS loading, row-numbered errors, reject vs skip, lengths."""

import json
import logging
import socket
import sys

import numpy as np
import pytest
from offline import forbid_tfds_downloads, refusing_url

from jgrpo.tasks.arithmetic import char_tokenizer
from jgrpo.tasks.datasets import (
    DatasetError,
    check_prompt_lengths,
    load_jsonl,
    load_tfds,
    unreachable,
)

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]


def write_jsonl(path, *lines):
    """Lines as given: dicts are dumped as JSON, strings are written verbatim."""
    path.write_text(
        "".join((json.dumps(line) if isinstance(line, dict) else line) + "\n" for line in lines)
    )
    return path


def test_prompt_field_becomes_prompt_and_other_fields_are_kept(tmp_path):
    path = write_jsonl(
        tmp_path / "data.jsonl",
        {"question": "1+1?", "answer": "2", "level": 1},
        {"question": "2+2?", "answer": "4", "level": 2},
    )
    assert load_jsonl(path, prompt_field="question") == [
        {"prompt": "1+1?", "answer": "2", "level": 1},
        {"prompt": "2+2?", "answer": "4", "level": 2},
    ]
    # A list keeps only those fields; a dict keeps and renames them.
    assert load_jsonl(path, prompt_field="question", fields=["answer"]) == [
        {"prompt": "1+1?", "answer": "2"},
        {"prompt": "2+2?", "answer": "4"},
    ]
    assert load_jsonl(path, prompt_field="question", fields={"answer": "target", "level": "l"}) == [
        {"prompt": "1+1?", "target": "2", "l": 1},
        {"prompt": "2+2?", "target": "4", "l": 2},
    ]


def test_chat_prompts_are_kept_as_messages(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", {"prompt": CHAT, "answer": "hello"})
    (example,) = load_jsonl(path)
    assert example == {"prompt": CHAT, "answer": "hello"}


def test_json_files_hold_a_list_of_rows(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"prompt": "a"}, {"prompt": CHAT, "id": 7}]))
    assert load_jsonl(path) == [{"prompt": "a"}, {"prompt": CHAT, "id": 7}]
    # Rows of a .json list are numbered by position, from 1.
    path.write_text(json.dumps([{"prompt": "a"}, {"prompt": "  "}]))
    with pytest.raises(DatasetError, match=r"data\.json row 2: prompt is empty"):
        load_jsonl(path)
    path.write_text(json.dumps({"prompt": "a"}))
    with pytest.raises(DatasetError, match="must be a list of objects, got dict"):
        load_jsonl(path)
    path.write_text('[{"prompt": "a"},')
    with pytest.raises(DatasetError, match="not valid JSON"):
        load_jsonl(path)


@pytest.mark.parametrize(
    "line, problem",
    [
        ('{"prompt": "unclosed', "is not valid JSON"),
        ('["prompt", "x"]', "is not an object (got list)"),
        ('{"text": "x", "answer": "1"}', "has no prompt field 'prompt'"),
        (
            '{"prompt": 12, "answer": "1"}',
            "prompt must be text or a list of chat messages, got int",
        ),
        ('{"prompt": "", "answer": "1"}', "prompt is empty"),
        ('{"prompt": " \\n\\t ", "answer": "1"}', "prompt is empty"),
        ('{"prompt": [], "answer": "1"}', "prompt is an empty list of messages"),
        ('{"prompt": [{"role": "user"}], "answer": "1"}', "prompt message 0 is not a"),
        ('{"prompt": ["hi"], "answer": "1"}', "prompt message 0 is not a"),
        (
            '{"prompt": [{"role": "user", "content": " "}], "answer": "1"}',
            "prompt messages are all empty",
        ),
        ('{"prompt": "x"}', "has no field 'answer'"),
    ],
)
def test_each_malformed_row_is_named_with_its_line(tmp_path, line, problem):
    # Line 2 is blank: it holds no row but is counted, so the bad row is reported as line 4.
    path = write_jsonl(
        tmp_path / "data.jsonl",
        {"prompt": "a", "answer": "1"},
        "",
        {"prompt": "b", "answer": "2"},
        line,
    )
    with pytest.raises(DatasetError) as raised:
        load_jsonl(path, fields=["answer"])
    message = str(raised.value)
    assert f"{path} row 4: {problem}" in message
    assert "1 of 3 rows cannot be used" in message


def test_reject_quotes_ten_problems_and_counts_them_all(tmp_path):
    lines = [{"prompt": "ok"}] + [{"prompt": ""}] * 12 + [{"prompt": "ok"}]
    path = write_jsonl(tmp_path / "data.jsonl", *lines)
    with pytest.raises(DatasetError) as raised:
        load_jsonl(path)
    message = str(raised.value)
    assert "12 of 14 rows cannot be used" in message
    assert [f"row {n}:" in message for n in range(2, 14)] == [True] * 10 + [False] * 2
    assert "... and 2 more" in message
    assert isinstance(raised.value, ValueError)


def test_skip_logs_each_bad_row_and_keeps_the_rest_in_order(tmp_path, caplog):
    path = write_jsonl(
        tmp_path / "data.jsonl",
        {"prompt": "first"},
        "not json",
        {"prompt": "second"},
        {"prompt": ""},
        {"prompt": "third"},
    )
    with caplog.at_level(logging.WARNING, logger="jgrpo.tasks"):
        examples = load_jsonl(path, on_error="skip")
    assert [e["prompt"] for e in examples] == ["first", "second", "third"]
    logged = [r.getMessage() for r in caplog.records if r.name == "jgrpo.tasks"]
    assert any(f"{path} row 2: is not valid JSON" in m for m in logged)
    assert any(f"{path} row 4: prompt is empty" in m for m in logged)
    assert any("skipped 2 of 5 rows" in m for m in logged)


def test_a_check_reports_its_rows_like_malformed_ones(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", {"prompt": "a", "n": 1}, {"prompt": "b", "n": -1})
    check = lambda example: None if example["n"] > 0 else "n must be positive"
    with pytest.raises(DatasetError, match="row 2: n must be positive"):
        load_jsonl(path, check=check)
    assert load_jsonl(path, check=check, on_error="skip") == [{"prompt": "a", "n": 1}]


def test_unusable_arguments_and_empty_results_are_errors(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", {"question": "q", "prompt": "p"})
    with pytest.raises(DatasetError, match="has both 'prompt' and the prompt field 'question'"):
        load_jsonl(path, prompt_field="question")
    assert load_jsonl(path, prompt_field="question", fields={"prompt": "draft"}) == [
        {"prompt": "q", "draft": "p"}
    ]
    with pytest.raises(ValueError, match="would overwrite 'prompt'"):
        load_jsonl(path, fields={"question": "prompt"})
    with pytest.raises(ValueError, match="on_error must be one of 'reject', 'skip'"):
        load_jsonl(path, on_error="ignore")
    with pytest.raises(ValueError, match="expected a .jsonl or .json file"):
        load_jsonl(tmp_path / "data.csv")
    # Skipping every row, or an empty file, leaves nothing to train on: an error, not [].
    bad = write_jsonl(tmp_path / "bad.jsonl", {"prompt": ""})
    with pytest.raises(DatasetError, match="no usable rows"):
        load_jsonl(bad, on_error="skip")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DatasetError, match="no usable rows"):
        load_jsonl(empty)


def test_prompts_over_the_token_limit_are_reported_with_their_rows(caplog):
    tokenizer = char_tokenizer("abcdefghijklmnopqrstuvwxyz ")  # BOS + one token a character
    examples = [{"prompt": "abc"}, {"prompt": "abcdef"}, {"prompt": "ab"}, {"prompt": "abcde"}]
    assert check_prompt_lengths(examples, tokenizer, 7) == examples  # "abcdef" is 7 tokens
    with pytest.raises(DatasetError) as raised:
        check_prompt_lengths(examples, tokenizer, 4, source="train")
    message = str(raised.value)
    assert "train row 2: prompt is 7 tokens, more than 4" in message
    assert "train row 4: prompt is 6 tokens, more than 4" in message
    assert "2 of 4 rows" in message and "row 1:" not in message
    with caplog.at_level(logging.WARNING, logger="jgrpo.tasks"):
        kept = check_prompt_lengths(examples, tokenizer, 4, on_error="skip")
    assert kept == [examples[0], examples[2]]
    assert any("examples row 2: prompt is 7 tokens" in r.getMessage() for r in caplog.records)


def test_chat_prompt_lengths_count_the_chat_template():
    tokenizer = char_tokenizer("abcdefghijklmnopqrstuvwxyz ")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant {% endif %}"
    )
    chat = [{"prompt": [{"role": "user", "content": "hi"}]}]  # "user hi assistant " = 18
    assert check_prompt_lengths(chat, tokenizer, 18) == chat
    with pytest.raises(DatasetError, match="row 1: prompt is 18 tokens, more than 17"):
        check_prompt_lengths(chat, tokenizer, 17)


# ----------------------------------------------------------------------------------------
# TFDS, offline: a tiny dataset built here, then read back by name as prepared files.


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    """A data_dir with `jgrpo_toy_prompts` 1.0.0 prepared as ArrayRecord (no TensorFlow)."""
    import array_record  # noqa: F401  (TFDS data sources read ArrayRecord files)
    import tensorflow_datasets as tfds

    # skip_registration: the loader must find it by name from the files alone, as it would
    # find a dataset prepared on another machine.
    class JgrpoToyPrompts(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            features = {
                "text": tfds.features.Text(),
                "target": tfds.features.Text(),
                "level": tfds.features.Scalar(dtype=np.int64),
                "tags": tfds.features.Sequence(tfds.features.Text()),
            }
            return tfds.core.DatasetInfo(
                builder=self,
                features=tfds.features.FeaturesDict(features),
                disable_shuffling=True,  # records in the order written, for the row numbers
            )

        def _split_generators(self, dl_manager):
            rows = [
                {"text": "Quelle est la capitale de la France ?", "target": "Paris"},
                {"text": "2 + 2 = ?", "target": "4"},
                {"text": "   ", "target": "blank"},
                {"text": "Nombre de côtés d'un carré ?", "target": "4"},
            ]
            test = [{"text": "1 + 1 = ?", "target": "2"}]
            return {"train": self._generate_examples(rows), "test": self._generate_examples(test)}

        def _generate_examples(self, rows):
            for key, row in enumerate(rows):
                yield key, {**row, "level": key, "tags": ["a", f"t{key}"]}

    directory = tmp_path_factory.mktemp("tfds")
    JgrpoToyPrompts(data_dir=str(directory), file_format="array_record").download_and_prepare()
    return directory


def test_tfds_dataset_loads_offline_by_name_without_tensorflow(tfds_dir):
    load = lambda split, **kw: load_tfds(
        "jgrpo_toy_prompts", split, data_dir=tfds_dir, prompt_field="text", **kw
    )
    assert load("test") == [{"prompt": "1 + 1 = ?", "target": "2", "level": 0, "tags": ["a", "t0"]}]
    # Bytes become str (accents included), int64 becomes int; TFDS slicing works.
    assert load("train[:2]", fields={"target": "answer", "level": "level"}) == [
        {"prompt": "Quelle est la capitale de la France ?", "answer": "Paris", "level": 0},
        {"prompt": "2 + 2 = ?", "answer": "4", "level": 1},
    ]
    # The blank prompt is record 3 of the split.
    with pytest.raises(DatasetError, match=r"TFDS jgrpo_toy_prompts \(train, .*\) row 3: prompt"):
        load("train", fields=["target"])
    kept = load("train", fields=["target"], on_error="skip")
    assert [e["target"] for e in kept] == ["Paris", "4", "4"]
    assert kept[2]["prompt"] == "Nombre de côtés d'un carré ?"
    with pytest.raises(DatasetError, match="row 1: has no field 'answer'"):
        load("test", fields=["answer"])
    assert "tensorflow" not in sys.modules


def test_tfds_unknown_dataset_is_an_error_without_network(tmp_path):
    import tensorflow_datasets as tfds

    with pytest.raises(tfds.core.registered.DatasetNotFoundError):
        load_tfds("jgrpo_no_such_dataset", "train", data_dir=tmp_path, download=False)


def test_a_download_from_an_unreachable_host_fails_at_once(tmp_path, monkeypatch):
    forbid_tfds_downloads(monkeypatch)
    with refusing_url() as url:
        host = url[len("http://") : -1]
        with pytest.raises(ConnectionError) as raised:
            load_tfds("gsm8k", "train", data_dir=tmp_path, download_url=url)
    assert str(raised.value) == (
        f"TFDS gsm8k is not prepared in {tmp_path / 'gsm8k' / '1.0.0'} and cannot be "
        f"downloaded: no connection to {host} (Connection refused)."
    )


def test_the_probe_connects_to_the_host_or_to_the_proxy_set_for_its_scheme(monkeypatch):
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        listening = f"https://127.0.0.1:{server.getsockname()[1]}/data.jsonl"
        assert unreachable(listening) is None
        with refusing_url() as url:
            proxy = url[len("http://") : -1]
            assert unreachable(url) == f"{proxy} (Connection refused)"
            monkeypatch.setenv("https_proxy", url)  # downloads would go through the proxy
            assert unreachable("https://example.com/data.jsonl") == unreachable(url)
            assert unreachable(listening.replace("https", "http")) is None  # no http proxy


def test_a_tfds_task_from_the_config_with_chat_prompts(tfds_dir):
    from jgrpo.config import load_config
    from jgrpo.train import build_task

    config = load_config(
        None,
        [
            "task.name=tfds",
            "task.dataset=jgrpo_toy_prompts",
            f"task.data_dir={tfds_dir}",
            "task.prompt_field=text",
            "task.rewards=math",
            "task.on_error=skip",  # the blank prompt (row 3)
            "task.chat=true",
            "task.system_prompt=Answer briefly.",
        ],
    )
    task = build_task(config)
    assert [e["target"] for e in task.train] == ["Paris", "4", "4"]
    assert task.eval[0]["prompt"] == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "1 + 1 = ?"},
    ]
    assert task.reward_weights == {"math": 1.0} and task.correctness == "math"
