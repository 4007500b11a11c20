"""jgrpo.generate and `python -m jgrpo.generate`: prompts in, text out."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
from tiny_hf import make_tokenizer, save_char_checkpoint, save_generation_config
from transformers import AutoTokenizer, GenerationConfig

import jgrpo
from jgrpo.config import load_config
from jgrpo.generation import bucket_length, encode_prompts, pad_prompts, stop_token_ids
from jgrpo.models.hf import from_pretrained

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w3{% endif %}"
)


def test_bucket_length():
    assert [bucket_length(n) for n in (1, 16, 17, 100, 4096, 4097)] == [16, 16, 32, 128, 4096, 8192]
    assert bucket_length(5, buckets=(8, 4)) == 8


def test_pad_prompts_left_pads_with_a_mask_from_lengths():
    ids, mask = pad_prompts([[5, 6, 7], [9]], buckets=(4,))
    np.testing.assert_array_equal(ids, [[0, 5, 6, 7], [0, 0, 0, 9]])
    np.testing.assert_array_equal(mask, [[0, 1, 1, 1], [0, 0, 0, 1]])


def test_chat_prompts_go_through_the_template():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    messages = [{"role": "user", "content": "w5 w6"}]
    assert encode_prompts(tokenizer, ["w5 w6", messages]) == [[5, 6], [5, 6, 3]]
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="prompt 0 is a list of chat messages but the tokenizer"):
        encode_prompts(tokenizer, [messages])
    with pytest.raises(ValueError, match="prompt 0 must be a string or a list of chat messages"):
        encode_prompts(tokenizer, [42])


def test_generate_returns_text_and_ids(hf_checkpoint):
    directory, _ = hf_checkpoint("llama3")
    model, tokenizer = from_pretrained(directory), make_tokenizer()
    assert stop_token_ids(tokenizer, model.config) == (2,)
    out = jgrpo.generate(
        model, tokenizer, ["w5 w7", "w9"], num_generations=3, max_new_tokens=6, temperature=0.9
    )
    assert len(out.texts) == 2 and all(len(row) == 3 for row in out.texts)
    tokens, lengths = np.asarray(out.rollout.tokens), np.asarray(out.rollout.lengths)
    for p in range(2):
        for g in range(3):
            ids = out.token_ids[p][g]
            assert ids == tokens[p * 3 + g, : lengths[p * 3 + g]].tolist()
            assert out.texts[p][g] == tokenizer.decode(ids, skip_special_tokens=True)
    again = jgrpo.generate(
        model, tokenizer, ["w5 w7", "w9"], num_generations=3, max_new_tokens=6, temperature=0.9
    )
    assert again.token_ids == out.token_ids  # the default key is fixed: reproducible


def test_stop_tokens_include_those_of_generation_config(hf_checkpoint, tmp_path):
    """generation_config.json's eos_token_id, an int or a list, joins the tokenizer's and
    config.json's EOS (2 here): the ids transformers' GenerationConfig reads from the file."""
    directory = shutil.copytree(hf_checkpoint("llama3")[0], tmp_path / "checkpoint")
    model, tokenizer = from_pretrained(directory), make_tokenizer()
    assert stop_token_ids(tokenizer, model.config, directory) == (2,)  # no such file
    for eos in ([9, 2], 7):
        save_generation_config(directory, eos)
        theirs = GenerationConfig.from_pretrained(directory).eos_token_id
        assert set(np.atleast_1d(theirs).tolist()) == set(np.atleast_1d(eos).tolist())
        expected = tuple(sorted({2, *np.atleast_1d(eos).tolist()}))
        assert stop_token_ids(tokenizer, model.config, directory) == expected
        assert stop_token_ids(tokenizer, model.config) == (2,)  # no checkpoint, no file


def test_generate_stops_on_a_generation_config_eos(hf_checkpoint, tmp_path):
    """A checkpoint whose generation_config.json lists the token greedy decoding emits first
    stops there, as transformers' generate does, and says so (not truncated)."""
    directory = shutil.copytree(hf_checkpoint("llama3")[0], tmp_path / "checkpoint")
    model, tokenizer = from_pretrained(directory), make_tokenizer()
    greedy = dict(max_new_tokens=6, temperature=0.0)
    first = jgrpo.generate(model, tokenizer, "w5 w7", **greedy).token_ids[0][0]
    assert len(first) == 6 and 2 not in first  # without the file: no stop in 6 tokens
    save_generation_config(directory, [first[0], 2])
    stopped = jgrpo.generate(model, tokenizer, "w5 w7", **greedy)
    assert stopped.token_ids[0][0] == [first[0]]
    assert not bool(stopped.rollout.truncated[0])


def test_the_trainer_samples_and_exports_with_generation_config(tmp_path):
    """The training rollout and the greedy evaluation stop on generation_config.json's ids
    too, and an export writes the file back as it came."""
    from jgrpo.train import Trainer, export

    directory = save_char_checkpoint(tmp_path / "chat")
    tokenizer_eos = json.loads((directory / "config.json").read_text())["eos_token_id"]
    newline = AutoTokenizer.from_pretrained(directory).convert_tokens_to_ids("\n")
    assert newline != tokenizer_eos  # an id the tokenizer and config.json do not stop on
    written = save_generation_config(directory, [tokenizer_eos, newline]).read_text()
    overrides = [f"model.path={directory}", "mesh.devices=1", "task.reward_workers=0"]
    trainer = Trainer(load_config(None, overrides))
    expected = tuple(sorted({tokenizer_eos, newline}))
    assert trainer.sampling.stop_token_ids == expected
    assert trainer.greedy.stop_token_ids == expected
    out = export(trainer, trainer.initial_params(), tmp_path / "hf")
    assert (out / "generation_config.json").read_text() == written


def test_command_line(hf_checkpoint):
    # (With model_type qwen2, AutoTokenizer would rebuild the test's word-level tokenizer as
    # a Qwen2 BPE tokenizer; the Llama checkpoint keeps it as saved.)
    directory, _ = hf_checkpoint("llama3")
    root = pathlib.Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jgrpo.generate",
            "--model",
            str(directory),
            "--prompt",
            "w5 w7",
            "--num-generations",
            "2",
            "--max-new-tokens",
            "5",
            "--temperature",
            "0",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    lines = out.stdout.splitlines()
    assert lines[0] == "=== prompt 0: w5 w7"
    assert lines[1].startswith("--- generation 0 (") and lines[3].startswith("--- generation 1 (")
    assert lines[2] == lines[4]  # greedy: both generations agree
