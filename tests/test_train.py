"""The training loop end to end on the tiny demo config: metrics, checkpoints, resume, export."""

import dataclasses
import functools
import logging
import os
import pathlib
import runpy
import signal
import socket
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jgrpo import train as train_module
from jgrpo.collect import zero_signal_of
from jgrpo.config import load_config
from jgrpo.metrics import read_metrics
from jgrpo.rewards import RewardError
from jgrpo.tasks import Task
from jgrpo.tasks.arithmetic import addition_task

TINY = [
    "rollout.max_prompt_length=8",
    "rollout.max_new_tokens=4",
    "rollout.prompts_per_step=4",
    "rollout.num_generations=4",
    "optim.lr=1e-3",
    "train.progress=false",
    "train.tensorboard=false",
    "task.reward_workers=0",  # rewards in-process: no worker start-up per run (one test uses them)
    "mesh.devices=1",  # as on a laptop; tests/test_sharding.py trains on the 8 devices
]

REQUIRED_METRICS = {
    "step",
    "reward/mean",
    "reward/std",
    "reward/correct/mean",
    "reward/correct/std",
    "reward/format/mean",
    "reward/format/std",
    "frac_zero_std",
    "advantage/mean",
    "advantage/std",
    "loss",
    "clip_frac/low",
    "clip_frac/high",
    "entropy",
    "completion_len/mean",
    "truncated_frac",
    "lr",
    "grad_norm",
    "sampler/gap",
    "time/rollout",
    "time/reward",
    "time/update",
    "tokens_per_s",
}


def tiny_config(run_dir, *extra):
    return load_config(None, [*TINY, f"train.run_dir={run_dir}", *extra])


def assert_trees_equal(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_end_to_end_metrics_checkpoints_eval_and_export(tmp_path, count_compiles, caplog):
    from jgrpo import models

    config = tiny_config(
        tmp_path,
        "train.steps=4",
        "train.save_every=2",
        "train.eval_every=1",
        "train.keep_checkpoints=1",
        "train.tensorboard=true",
        "task.reward_workers=2",  # the default: rewards in worker processes
    )
    compiles_after = {}
    result = train_module.train(
        config, on_step=lambda step, _: compiles_after.update({step: count_compiles()})
    )

    lines = read_metrics(tmp_path)
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    for line in lines:
        assert line.keys() >= REQUIRED_METRICS, REQUIRED_METRICS - line.keys()
        assert 0 <= line["eval/accuracy"] <= 1 and 0 <= line["frac_zero_std"] <= 1
        assert 0 < line["completion_len/mean"] <= 4
        assert line["sampler/gap"] < 1e-4  # the f32 sampler is the policy being trained
    # Nothing compiles after the first step (rollout, update, eval all reuse their programs).
    assert compiles_after[4] == compiles_after[1], compiles_after
    assert list((tmp_path / "tensorboard").iterdir())
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert checkpoints == ["4"]  # keep_checkpoints=1
    # The HF export holds the final parameters and loads back (with the task's tokenizer).
    exported = models.from_pretrained(tmp_path / "hf")
    assert_trees_equal(exported.params(), result.state.params)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "hf")("3+4=")["input_ids"][1:] == [6, 13, 7, 14]
    # Any checkpoint exports on request, with the config stored in it.
    script = pathlib.Path(__file__).parent.parent / "scripts" / "export_checkpoint.py"
    export_script = runpy.run_path(str(script))  # its main(), in this process
    assert export_script["main"]([str(tmp_path), str(tmp_path / "again")]) == tmp_path / "again"
    assert_trees_equal(models.from_pretrained(tmp_path / "again").params(), result.state.params)
    # Rerunning a finished run resumes at its end and does nothing more; the settings that
    # differ from the checkpoint's are named.
    with caplog.at_level(logging.WARNING, logger="jgrpo.train"):
        again = train_module.train(tiny_config(tmp_path, "train.steps=4", "train.export=false"))
    assert (
        "resuming with settings other than the checkpoint's (these apply from step 5): "
        "task.reward_workers: 2 -> 0; train.eval_every: 1 -> 20; train.save_every: 2 -> 50; "
        "train.keep_checkpoints: 1 -> 3; train.export: True -> False; train.tensorboard: "
        "True -> False"
    ) in caplog.text, caplog.text
    assert again.steps_done == 4 and len(read_metrics(tmp_path)) == 4
    assert_trees_equal(again.state.params, result.state.params)


def test_evaluate_before_and_after_training_matches_the_loops_eval(tmp_path, monkeypatch):
    closed = []

    class RecordingPool(train_module.VerifierPool):
        def close(self):
            closed.append(self)
            super().close()

    monkeypatch.setattr(train_module, "VerifierPool", RecordingPool)
    config = tiny_config(
        tmp_path,
        "train.steps=3",
        "train.eval_every=3",
        "train.log_samples=3",
        "train.export=false",
        "task.reward_workers=1",  # evaluate closes the pool it started
    )
    before, before_samples = train_module.evaluate(config)
    assert len(closed) == 1
    assert before.keys() == {"eval/reward", "eval/accuracy"}
    assert 0 <= before["eval/accuracy"] <= 1 and 0 <= before["eval/reward"] <= 1.2
    assert len(before_samples) == 3
    for prompt, completion, reward in before_samples:
        assert isinstance(prompt, str) and prompt.endswith("=") and isinstance(completion, str)
        assert 0 <= reward <= 1.2

    result = train_module.train(config)
    after, after_samples = train_module.evaluate(config, result.state.params)
    (*_, last) = read_metrics(tmp_path)
    assert after == {"eval/reward": last["eval/reward"], "eval/accuracy": last["eval/accuracy"]}
    assert len(after_samples) == 3 and after_samples != before_samples  # the policy moved
    assert len(closed) == 3  # each evaluate and the train run closed its pool


def test_the_policy_changes_and_adam_state_is_saved(tmp_path):
    config = tiny_config(tmp_path, "train.steps=2", "train.save_every=1", "train.eval_every=0")
    trainer = train_module.Trainer(config)
    initial = jax.tree.map(np.asarray, trainer.model.params())
    result = train_module.train(config)
    changed = jax.tree.map(
        lambda a, b: not np.array_equal(a, np.asarray(b)), initial, result.state.params
    )
    assert all(jax.tree.leaves(changed))
    assert int(result.state.step) == 2  # one optimizer step per training step here


@pytest.mark.parametrize("reference_dtype", ["float32", "bfloat16"])
def test_the_update_compiled_ahead_is_the_program_the_first_step_calls(
    tmp_path, count_compiles, reference_dtype
):
    """`train` compiles the update in a thread while the first rollout runs. The batch the
    step makes must match the arguments it was compiled for (shapes, dtypes, shardings), so
    that the step's call finds it in jit's cache and compiles nothing; the reference too,
    in model.reference_dtype, and it outlives the step that donates the state."""
    # A learning rate no other test uses: an update program no other test compiled.
    config = tiny_config(
        tmp_path,
        "optim.lr=7e-4",
        "algorithm.beta=0.04",
        "train.steps=2",
        f"model.reference_dtype={reference_dtype}",
    )
    trainer = train_module.Trainer(config)
    start = count_compiles()
    trainer.compile_update_ahead()
    trainer.compile_update_ahead()  # a second request joins the first
    trainer.compiled_update()
    assert count_compiles() == start + 1
    params = trainer.initial_params()
    reference = trainer.reference_params(params)
    state = trainer.initial_state(params)
    groups, _, _ = trainer.collect(state.params, reference, jax.random.key(0), 0)
    batch = trainer.to_batch(groups, trainer.advantages(groups))

    def signature(tree):
        return jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), tree)

    expected_state, expected_batch, expected_reference = trainer.update_arguments()
    assert signature(batch) == signature(expected_batch)
    assert signature(reference) == signature(expected_reference)
    assert signature(state) == signature(expected_state)
    before = count_compiles()  # the rollout and the advantages are compiled by now
    state, metrics, _ = trainer.step(state, reference, 0, 0)
    assert count_compiles() == before
    assert int(state.step) == 1 and np.isfinite(metrics["loss"])
    assert not any(x.is_deleted() for x in jax.tree.leaves(reference))  # not the state's
    # Policy == reference at the first step: the KL is 0 but for the reference's rounding.
    if reference_dtype == "float32":
        assert metrics["kl"] == 0.0
    else:
        assert 0.0 < metrics["kl"] < 1e-4


def test_a_bf16_reference_rounds_the_weight_matrices_once(tmp_path):
    """model.reference_dtype=bfloat16: the reference holds the initial parameters with the
    layers' kernels, the embedding table and the output projection rounded to bf16, norms
    f32, and the update scores it as the f32 model with rounded embeddings and bf16
    products summed in f32 (`completion_logprobs(..., matmul_dtype="bfloat16")`)."""
    from jgrpo.update import completion_logprobs

    config = tiny_config(tmp_path, "algorithm.beta=0.04", "model.reference_dtype=bfloat16")
    trainer = train_module.Trainer(config)
    params = trainer.initial_params()
    reference = trainer.reference_params(params)
    assert jax.tree.structure(reference) == jax.tree.structure(params)
    rounded = {"embed", "lm_head"} | {n for n in params["layers"] if n.endswith("_kernel")}
    for path, value in jax.tree_util.tree_leaves_with_path(reference):
        expected = functools.reduce(lambda tree, key: tree[key.key], path, params)
        if path[-1].key in rounded:
            expected = expected.astype(jnp.bfloat16)
        assert value.dtype == expected.dtype, path
        np.testing.assert_array_equal(np.asarray(value), np.asarray(expected))
    assert reference["final_norm"].dtype == jnp.float32
    groups, _, _ = trainer.collect(params, reference, jax.random.key(1), 0)
    batch = trainer.to_batch(groups, np.zeros(len(groups.rewards), np.float32))
    round_embeddings = dict(params, embed=params["embed"].astype(jnp.bfloat16).astype(jnp.float32))
    scored = {
        dtype: np.asarray(
            completion_logprobs(
                weights,
                batch,
                model_config=trainer.model_config,
                temperature=1.0,
                chunk_size=4096,
                shared_prompt_rows=trainer.group_size,
                matmul_dtype=dtype,
            )[0]
        )
        for dtype, weights in (("float32", params), ("bfloat16", round_embeddings))
    }
    frozen = np.asarray(trainer.frozen_logprobs(reference, batch))
    np.testing.assert_allclose(frozen, scored["bfloat16"], rtol=1e-6, atol=1e-6)
    assert 0 < np.abs(frozen - scored["float32"]).max() < 0.05
    # Without beta there is no reference; with bf16 parameters it is a plain copy.
    assert (
        train_module.Trainer(
            tiny_config(tmp_path, "model.reference_dtype=bfloat16")
        ).reference_params(params)
        is None
    )
    config = tiny_config(
        tmp_path, "algorithm.beta=0.04", "model.dtype=bfloat16", "model.reference_dtype=bfloat16"
    )
    trainer = train_module.Trainer(config)
    params = trainer.initial_params()
    reference = trainer.reference_params(params)
    assert jax.tree.structure(reference) == jax.tree.structure(params)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(reference))


def test_completion_widths_are_rounded_fractions_of_the_limit():
    assert train_module.completion_widths(64, 1) == (64,)
    assert train_module.completion_widths(64, 4) == (16, 32, 48, 64)
    # ceil(100 k / 3) = 34, 67, 100 -> multiples of 8, at most the limit
    assert train_module.completion_widths(100, 3) == (40, 72, 100)
    # 3, 5, 8, 10, 13, 15, 18, 20 -> 8, 16, 24 -> 20
    assert train_module.completion_widths(20, 8) == (8, 16, 20)
    assert train_module.completion_widths(4, 4) == (4,)


def test_prompt_width_is_the_longest_prompt_rounded_up_to_eight_at_most_the_limit():
    assert train_module.prompt_width(5, 256) == 8
    assert train_module.prompt_width(8, 256) == 8
    assert train_module.prompt_width(9, 256) == 16
    assert train_module.prompt_width(39, 39) == 39  # never past the limit
    assert train_module.prompt_width(0, 256) == 8  # an empty split


def test_each_split_pads_to_the_longest_prompt_it_uses(tmp_path):
    task = addition_task()  # "<s>a+b=": 5 tokens
    task.eval = [*task.eval[:3], {**task.eval[3], "prompt": "1234567+89012345="}]  # 18 tokens
    config = tiny_config(tmp_path, "rollout.max_prompt_length=24")
    assert train_module.Trainer(config, task).prompt_widths == {"train": 8, "eval": 24}
    # evaluate reads only the first eval_size examples: the long fourth is not among them
    config = tiny_config(tmp_path, "rollout.max_prompt_length=24", "task.eval_size=3")
    assert train_module.Trainer(config, task).prompt_widths == {"train": 8, "eval": 8}


def test_prompts_pad_to_the_longest_prompt_and_train_as_at_the_full_limit(
    tmp_path, monkeypatch, count_compiles
):
    """Positions count real tokens only, so padding prompts to the data's longest prompt
    instead of max_prompt_length changes no sample, loss or gradient beyond rounding."""
    settings = ["rollout.max_prompt_length=24", "algorithm.beta=0.04"]
    trimmed = train_module.Trainer(tiny_config(tmp_path / "trimmed", *settings))
    full = train_module.Trainer(tiny_config(tmp_path / "full", *settings))
    assert trimmed.prompt_widths == {"train": 8, "eval": 8}  # "<s>4+4=": 5 tokens at most
    monkeypatch.setattr(full, "prompt_widths", {"train": 24, "eval": 24})  # as before trimming
    params = trimmed.initial_params()
    results = {}
    for name, trainer in (("trimmed", trimmed), ("full", full)):
        state = trainer.initial_state(jax.tree.map(jnp.copy, params))
        groups, _, _ = trainer.collect(params, params, jax.random.key(1), 0)
        next_state, metrics, position = trainer.step(state, params, 0, 0)
        before = count_compiles()
        trainer.step(next_state, params, 1, position)
        assert count_compiles() == before  # one prompt width: nothing compiles again
        results[name] = groups, metrics, trainer.evaluate(params)[0]
    (trimmed_groups, trimmed_metrics, trimmed_eval), (full_groups, full_metrics, full_eval) = (
        results["trimmed"],
        results["full"],
    )
    assert trimmed_groups.prompt_ids.shape == (16, 8) and full_groups.prompt_ids.shape == (16, 24)
    np.testing.assert_array_equal(trimmed_groups.prompt_ids, full_groups.prompt_ids[:, 16:])
    np.testing.assert_array_equal(trimmed_groups.tokens, full_groups.tokens)
    assert full_metrics["grad_norm"] > 0
    for name in ("loss", "grad_norm", "entropy", "kl", "reward/mean"):
        np.testing.assert_allclose(trimmed_metrics[name], full_metrics[name], rtol=1e-5, atol=1e-8)
    assert trimmed_eval == full_eval

    # A prompt the trainer never saw that is longer than its width: an error, not a cut.
    with pytest.raises(ValueError, match="more than the 8 columns this Trainer pads prompts to"):
        train_module.encode_examples(trimmed.tokenizer, [{"prompt": "123+4567="}], 8, 24)


def test_the_update_runs_on_the_narrowest_width_that_holds_every_completion(
    tmp_path, monkeypatch, count_compiles
):
    """With completion_buckets the step trims the batch to the width its completions need,
    and updates as the untrimmed step does (dr_grpo: its divisor stays max_new_tokens). Every
    width compiles ahead, so the step compiles nothing."""
    settings = ["rollout.max_new_tokens=16", "algorithm.loss_type=dr_grpo", "algorithm.beta=0.04"]
    trimmed = train_module.Trainer(
        tiny_config(tmp_path / "trimmed", *settings, "algorithm.completion_buckets=4")
    )
    full = train_module.Trainer(tiny_config(tmp_path / "full", *settings))
    assert trimmed.completion_widths == (8, 16) and full.completion_widths == (16,)
    start = count_compiles()
    trimmed.compile_update_ahead()
    assert trimmed.compiled_update(8) is not trimmed.compiled_update()
    assert count_compiles() == start + 2
    params = trimmed.initial_params()
    groups, collected, position = trimmed.collect(params, params, jax.random.key(0), 0)
    groups.mask[:, 6:] = False  # as if every completion had stopped within 6 tokens
    groups.mask[:, :6] = True
    groups.tokens[:, 6:] = trimmed.sampling.pad_token_id
    assert trimmed.completion_width(groups) == 8
    batch = trimmed.to_batch(groups, trimmed.advantages(groups), 8)
    assert batch.completion_mask.shape == (16, 8) and batch.input_ids.shape == (16, 8 + 8)
    longer = dataclasses.replace(groups, mask=groups.mask.copy())
    longer.mask[3, 8] = True
    assert trimmed.completion_width(longer) == 16

    metrics = {}
    for name, trainer in (("trimmed", trimmed), ("full", full)):
        monkeypatch.setattr(trainer, "collect", lambda *_: (groups, dict(collected), position))
        state = trainer.initial_state(jax.tree.map(jnp.copy, params))
        before = count_compiles()
        _, metrics[name], _ = trainer.step(state, params, 0, 0)
        if name == "trimmed":
            assert count_compiles() == before  # width 8: compiled ahead
    assert metrics["trimmed"]["completion_width"] == 8
    assert metrics["full"]["completion_width"] == 16
    assert metrics["full"]["grad_norm"] > 0
    for name in ("loss", "grad_norm", "entropy", "kl"):
        np.testing.assert_allclose(
            metrics["trimmed"][name], metrics["full"][name], rtol=1e-5, atol=1e-8
        )


def test_packed_completions_update_as_the_padded_batch_does(tmp_path, monkeypatch, count_compiles):
    """With pack_completions each group's completions run in the fewest packed rows that
    hold them (here 2 of G = 4), with the padded batch's loss, gradient norm, entropy and KL;
    every packed row count compiles ahead, so the step compiles nothing."""
    settings = ["rollout.max_new_tokens=16", "algorithm.loss_type=grpo", "algorithm.beta=0.04"]
    packed = train_module.Trainer(
        tiny_config(tmp_path / "packed", *settings, "algorithm.pack_completions=true")
    )
    padded = train_module.Trainer(tiny_config(tmp_path / "padded", *settings))
    assert packed.group_size == 4
    assert packed.update_shapes == [(16, 1), (16, 2), (16, 3), (16, 4)]
    start = count_compiles()
    packed.compile_update_ahead()
    programs = [packed.compiled_update(16, rows) for rows in (4, 3, 2, 1)]  # the order compiled
    assert len({id(program) for program in programs}) == 4
    assert packed.compiled_update() is programs[0]  # G rows: the most
    assert count_compiles() == start + 4
    params = packed.initial_params()
    groups, collected, position = packed.collect(params, params, jax.random.key(0), 0)
    # each group: completions of 10, 6, 6 and 4 tokens -> packed rows 10 + 6 and 6 + 4
    lengths = np.tile([10, 6, 6, 4], len(groups.mask) // 4)
    groups.mask[:] = np.arange(16)[None] < lengths[:, None]
    groups.tokens[~groups.mask] = packed.sampling.pad_token_id
    assert packed.update_shape(groups) == (16, 2) and padded.update_shape(groups) == (16, None)
    batch = packed.to_batch(groups, packed.advantages(groups), 16, 2)
    assert batch.packed.source.shape == (len(groups.mask) // 2, 16)

    metrics = {}
    for name, trainer in (("packed", packed), ("padded", padded)):
        monkeypatch.setattr(trainer, "collect", lambda *_: (groups, dict(collected), position))
        state = trainer.initial_state(jax.tree.map(jnp.copy, params))
        before = count_compiles()
        _, metrics[name], _ = trainer.step(state, params, 0, 0)
        if name == "packed":
            assert count_compiles() == before  # 2 packed rows: compiled ahead
    assert metrics["packed"]["packed_rows"] == 2 and "packed_rows" not in metrics["padded"]
    assert metrics["padded"]["grad_norm"] > 0
    for name in ("loss", "grad_norm", "entropy", "kl"):
        np.testing.assert_allclose(
            metrics["packed"][name], metrics["padded"][name], rtol=1e-5, atol=1e-8
        )


def test_with_buckets_and_packing_the_update_takes_the_fewest_slots(tmp_path):
    """Widths 8 and 16 (two buckets), G = 4: of the widths that hold every completion, the
    one whose packed rows hold the fewest slots, the narrower on a tie."""
    trainer = train_module.Trainer(
        tiny_config(
            tmp_path,
            "rollout.max_new_tokens=16",
            "algorithm.completion_buckets=2",
            "algorithm.pack_completions=true",
        )
    )
    assert trainer.update_shapes == [(w, r) for w in (8, 16) for r in (1, 2, 3, 4)]

    def shape(*group_lengths):
        lengths = np.array(group_lengths * 4)  # every group alike
        return trainer.update_shape(SimpleNamespace(mask=np.arange(16) < lengths[:, None]))

    # width 8: 6 | 6 | 4 2 = 3 rows, 24 slots; width 16: 6 6 4 | 2 = 2 rows, 32 slots
    assert shape(6, 6, 4, 2) == (8, 3)
    # width 8 holds 2 + 2 + 2 + 2 in one row; width 16 needs a row too, of 16 slots
    assert shape(2, 2, 2, 2) == (8, 1)
    # a completion of 10 tokens: only width 16 (10 6 | 6 4)
    assert shape(10, 6, 6, 4) == (16, 2)
    # 4 x 8 slots or 2 x 16: a tie, the narrower width
    assert shape(8, 8, 8, 8) == (8, 4)


def test_pack_completions_without_the_shared_prompt_update_runs_padded(tmp_path, caplog):
    """Packing needs whole groups per micro-batch; a layout that splits them (here 4 prompts
    of G = 4 in 8 micro-batches of 2 rows) warns and trains on the padded batch."""
    split = ("algorithm.pack_completions=true", "algorithm.grad_accumulation=8")
    trainer = train_module.Trainer(tiny_config(tmp_path / "trainer", *split))
    assert trainer.update_config.shared_prompt_rows == 1
    assert trainer.config.algorithm.pack_completions is False
    assert trainer.batch_shardings.packed is None
    assert {rows for _, rows in trainer.update_shapes} == {None}
    with caplog.at_level(logging.WARNING, logger="jgrpo.train"):
        train_module.train(tiny_config(tmp_path / "run", *split, "train.steps=1"))
    assert "algorithm.pack_completions is off for this run" in caplog.text
    assert "prompts_per_step=4 divisible by" in caplog.text and "= 1 x 8 x 1" in caplog.text
    (line,) = read_metrics(tmp_path / "run")
    assert "packed_rows" not in line and np.isfinite(line["loss"])


def test_packing_without_the_shared_prompt_forward_says_so(tmp_path, caplog):
    """Packing turned off because the shared-prompt update is off names that field, not the
    whole-groups rule."""
    off = ("algorithm.pack_completions=true", "algorithm.shared_prompt_forward=false")
    with caplog.at_level(logging.WARNING, logger="jgrpo.train"):
        trainer = train_module.Trainer(tiny_config(tmp_path, *off))
    assert trainer.config.algorithm.pack_completions is False
    assert "algorithm.pack_completions is off for this run" in caplog.text
    assert "algorithm.shared_prompt_forward=true" in caplog.text
    assert "divisible" not in caplog.text


def test_profile_steps_trace_the_chosen_steps(tmp_path, monkeypatch):
    """train.profile_steps traces steps profile_start .. profile_start + n - 1 into
    run_dir/profile (a trace TensorBoard's profile plugin reads), and only those."""
    calls = []
    start, stop = jax.profiler.start_trace, jax.profiler.stop_trace

    def start_trace(directory, *args, **kwargs):
        calls.append(("start", len(read_metrics(tmp_path)) + 1, directory))
        return start(directory, *args, **kwargs)

    def stop_trace():
        calls.append(("stop", len(read_metrics(tmp_path)), None))
        return stop()

    monkeypatch.setattr(jax.profiler, "start_trace", start_trace)
    monkeypatch.setattr(jax.profiler, "stop_trace", stop_trace)
    config = tiny_config(
        tmp_path, "train.steps=4", "train.profile_steps=2", "train.profile_start=2"
    )
    train_module.train(config)
    # started before step 2 (1 line of metrics written), stopped once step 3 had run and
    # before its metrics were written (2 lines)
    assert calls == [("start", 2, str(tmp_path / "profile")), ("stop", 2, None)]
    assert list((tmp_path / "profile").rglob("*.xplane.pb"))


def test_an_error_while_compiling_ahead_reaches_the_caller(tmp_path):
    trainer = train_module.Trainer(tiny_config(tmp_path))

    def broken(*args):
        raise ValueError("cannot trace the update")

    trainer.update = jax.jit(broken)
    trainer.compile_update_ahead()
    with pytest.raises(ValueError, match="cannot trace the update"):
        trainer.compiled_update()


# --- Resume after a kill ---------------------------------------------------------------------

KILL_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from jgrpo.config import ConfigError, load_config
    from jgrpo.train import train
    config = load_config(None, sys.argv[1:])
    # A pause after each step, so the parent's signal lands between steps.
    train(config, on_step=lambda step, _: time.sleep(1.0))
    """
)

RESUME = ["train.steps=4", "train.eval_every=0", "train.export=false"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    return train_module.train(tiny_config(run_dir, *RESUME))


def run_and_signal(run_dir, sig, *overrides, when) -> subprocess.CompletedProcess:
    """Starts a run in a new process and sends it `sig` once the path `when` exists."""
    process = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, *TINY, f"train.run_dir={run_dir}", *RESUME, *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ),
    )
    deadline = time.monotonic() + 240
    try:
        while not when() and process.poll() is None:
            assert time.monotonic() < deadline, "the run never got there"
            time.sleep(0.05)
    except BaseException:
        process.kill()  # no run left behind by a failing test
        process.wait()
        raise
    process.send_signal(sig)
    output, _ = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, output)


def test_sigkill_then_rerun_reaches_the_uninterrupted_parameters(tmp_path, uninterrupted):
    checkpoint_2 = tmp_path / "checkpoints" / "2"
    killed = run_and_signal(
        tmp_path, signal.SIGKILL, "train.save_every=2", when=checkpoint_2.exists
    )
    assert killed.returncode == -signal.SIGKILL, killed.stdout
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]  # killed mid-run
    resumed = train_module.train(tiny_config(tmp_path, *RESUME, "train.save_every=2"))
    assert resumed.steps_done == 4
    assert_trees_equal(resumed.state, uninterrupted.state)
    assert [line["step"] for line in read_metrics(tmp_path)] == [1, 2, 3, 4]


@pytest.mark.parametrize(("sig", "named"), [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "Ctrl-C")])
def test_sigterm_saves_exits_zero_and_resumes_exactly(tmp_path, uninterrupted, sig, named):
    """SIGTERM, and a Ctrl-C (SIGINT) alike."""

    def step_2_logged():
        return (tmp_path / "metrics.jsonl").exists() and len(read_metrics(tmp_path)) >= 2

    # save_every=3: the step-2 checkpoint below exists only because of the signal.
    stopped = run_and_signal(tmp_path, sig, "train.save_every=3", when=step_2_logged)
    assert stopped.returncode == 0, stopped.stdout
    assert f"{named}: saving a checkpoint after this step" in stopped.stdout
    assert "Traceback" not in stopped.stdout
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]
    assert [line["step"] for line in read_metrics(tmp_path)] == [1, 2]
    resumed = train_module.train(tiny_config(tmp_path, *RESUME, "train.save_every=3"))
    assert_trees_equal(resumed.state, uninterrupted.state)


def ctrl_c():
    """SIGINT to this process; a KeyboardInterrupt would end the whole pytest session."""
    try:
        signal.raise_signal(signal.SIGINT)
    except KeyboardInterrupt:
        pytest.fail("the first Ctrl-C was not caught")


def test_a_damaged_newest_checkpoint_resumes_from_the_one_before_exactly(
    tmp_path, uninterrupted, caplog
):
    """One flipped bit in a weight file of the newest checkpoint: the resume names it, goes
    back to the step before, replaces the damaged step when it saves it again, and still
    reaches the uninterrupted run's parameters."""
    from jgrpo import models
    from jgrpo.checkpoint import CheckpointDamaged, Checkpointer

    first = train_module.train(
        tiny_config(tmp_path, *RESUME, "train.steps=2", "train.save_every=1")
    )
    step_2 = tmp_path / "checkpoints" / "2" / "state"
    data = [p for p in step_2.rglob("*") if p.is_file() and p.parent.name == "d"]
    largest = max(data, key=lambda p: p.stat().st_size)
    damaged = bytearray(largest.read_bytes())
    damaged[len(damaged) // 2] ^= 0x10
    largest.write_bytes(bytes(damaged))

    with pytest.raises(CheckpointDamaged, match="step 2 .* is damaged: 1 array"):
        train_module.export_checkpoint(tmp_path, tmp_path / "export", step=2)
    train_module.export_checkpoint(tmp_path, tmp_path / "export")  # the newest intact: step 1
    with Checkpointer(tmp_path / "checkpoints") as checkpointer:
        step_1, _ = checkpointer.restore(first.state, step=1)
    assert_trees_equal(models.from_pretrained(tmp_path / "export").params(), step_1.params)

    with caplog.at_level(logging.INFO, logger="jgrpo"):
        resumed = train_module.train(tiny_config(tmp_path, *RESUME, "train.save_every=1"))
    assert f"checkpoint step 2 in {tmp_path / 'checkpoints'} is damaged (" in caplog.text
    assert f"resuming {tmp_path} from step 1" in caplog.text
    assert f"deleting the damaged checkpoint step 2 in {tmp_path / 'checkpoints'}" in caplog.text
    assert_trees_equal(resumed.state, uninterrupted.state)
    assert [line["step"] for line in read_metrics(tmp_path)] == [1, 2, 3, 4]
    with Checkpointer(tmp_path / "checkpoints") as checkpointer:  # step 2 is whole again
        state, meta = checkpointer.restore(first.state, step=2)
    assert meta["step"] == 2
    assert_trees_equal(state, first.state)


def test_a_first_ctrl_c_asks_the_loop_to_stop_and_a_second_one_interrupts():
    before = signal.getsignal(signal.SIGINT)
    assert before is signal.default_int_handler  # Python's, as in a script or a notebook
    with train_module._Preemption() as preemption:
        ctrl_c()
        assert preemption.requested
        assert signal.getsignal(signal.SIGINT) is before  # put back at the first
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def test_the_cli_ends_at_once_on_a_second_ctrl_c(tmp_path, monkeypatch):
    """The CLI runs with the system's default SIGINT action, which the loop's first Ctrl-C
    puts back: the second ends the process without waiting for Python (a KeyboardInterrupt
    would wait for the compilation or device program under way)."""
    seen = {}

    def fake_train(config):
        seen["during"] = signal.getsignal(signal.SIGINT)
        with train_module._Preemption() as preemption:
            ctrl_c()
            seen["after_one"] = signal.getsignal(signal.SIGINT)
        return train_module.TrainResult(None, 1, tmp_path, preemption.requested)

    monkeypatch.setattr(train_module, "train", fake_train)
    before = signal.getsignal(signal.SIGINT)
    assert train_module.main([f"train.run_dir={tmp_path}"]) == 0
    assert seen == {"during": signal.SIG_DFL, "after_one": signal.SIG_DFL}
    assert signal.getsignal(signal.SIGINT) is before


def test_a_second_run_on_the_same_run_dir_is_refused_and_a_killed_runs_lock_is_not(tmp_path):
    """Two runs on one train.run_dir would interleave checkpoints and metrics: the second is
    refused while the first runs. The lock is the OS's (flock), so the first run's SIGKILL
    releases it and the rerun resumes."""
    refused = []

    def try_a_second_run():
        if not (tmp_path / "metrics.jsonl").exists():  # the first run is in its loop
            return False
        with pytest.raises(train_module.RunDirInUse) as error:
            train_module.train(tiny_config(tmp_path, *RESUME))
        refused.append(str(error.value))
        return True

    killed = run_and_signal(tmp_path, signal.SIGKILL, "train.save_every=1", when=try_a_second_run)
    assert killed.returncode == -signal.SIGKILL, killed.stdout
    (message,) = refused
    assert message.startswith(f"train.run_dir={tmp_path} is in use by another run (process ")
    assert f" on {socket.gethostname()}); " in message
    assert message.endswith("wait for it to end, or give this run another train.run_dir.")
    resumed = train_module.train(tiny_config(tmp_path, *RESUME, "train.save_every=1"))
    assert resumed.steps_done == 4
    assert [line["step"] for line in read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_a_moving_reference_is_checkpointed_and_resumes_exactly(tmp_path):
    """algorithm.ref_sync_steps=1: the reference moves after every step, so a run resumed
    at step 2 reaches the uninterrupted run's parameters only with the step-2 reference
    restored from its checkpoint (the initial one would change steps 3 and 4)."""
    sync = [
        *RESUME,
        "algorithm.beta=0.5",
        "algorithm.ref_sync_steps=1",
        "train.save_every=2",
    ]
    whole = train_module.train(tiny_config(tmp_path / "whole", *sync))
    train_module.train(tiny_config(tmp_path / "parts", *sync, "train.steps=2"))
    resumed = train_module.train(tiny_config(tmp_path / "parts", *sync))
    assert_trees_equal(resumed.state, whole.state)
    kl = [line["kl"] for line in read_metrics(tmp_path / "whole")]
    assert kl == [line["kl"] for line in read_metrics(tmp_path / "parts")]
    assert kl[0] == 0.0 and all(value > 0 for value in kl[1:])  # the policy leads its reference
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), whole.state.params
    )
    from jgrpo.checkpoint import Checkpointer

    with Checkpointer(tmp_path / "whole" / "checkpoints") as checkpointer:
        reference = checkpointer.restore_reference(target, 4)
    initial = train_module.Trainer(tiny_config(tmp_path / "whole", *sync)).initial_params()

    def distance(a, b):
        pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
        return sum(float(jnp.sum((x - y) ** 2)) for x, y in pairs)

    # 0.6 of the way to the policy after each step: near the step-4 policy (about half a
    # step's move behind it), far nearer than the initial weights four steps back.
    to_policy = distance(reference, whole.state.params)
    assert 0 < to_policy < 0.1 * distance(initial, whole.state.params)
    # Resumed with the sync off, the reference stays where it moved to (not the initial one)
    # and is still saved, so a later resume finds it.
    train_module.train(
        tiny_config(tmp_path / "parts", *sync, "algorithm.ref_sync_steps=0", "train.steps=5")
    )
    with Checkpointer(tmp_path / "parts" / "checkpoints") as checkpointer:
        assert_trees_equal(checkpointer.restore_reference(target, 5), reference)


def test_the_reference_sync_mixes_in_f32_and_keeps_each_dtype(tmp_path):
    trainer = train_module.Trainer(
        tiny_config(tmp_path, "algorithm.beta=0.1", "algorithm.ref_sync_steps=3")
    )
    reference = {"w": jnp.array([1.0, 2.0]), "b": jnp.array([4.0], jnp.bfloat16)}
    params = {"w": jnp.array([3.0, -2.0]), "b": jnp.array([1.5])}
    mixed = trainer.synced_reference(reference, params)  # alpha 0.6, the default
    np.testing.assert_allclose(mixed["w"], [0.6 * 3 + 0.4 * 1, 0.6 * -2 + 0.4 * 2], rtol=1e-6)
    assert mixed["b"].dtype == jnp.bfloat16 and float(mixed["b"][0]) == 2.5  # 0.9 + 1.6


# --- Rewards, sampling options and errors inside the loop --------------------------------------


def test_a_reward_function_that_raises_or_returns_none_does_not_stop_the_run(tmp_path):
    base = addition_task()
    calls = []

    def flaky(prompts, completions, answer, **_):
        calls.append(len(completions))
        if any(p.startswith("0+") for p in prompts):
            raise ValueError("cannot parse")  # some rows fail; retried one by one
        return [None if a == "5" else 1.0 for a in answer]

    task = Task(
        name="flaky",
        train=base.train,
        eval=base.eval,
        reward_fns={**base.reward_fns, "flaky": flaky},
        reward_weights=base.reward_weights,
        correctness="correct",
        tokenizer=base.tokenizer,
    )
    config = tiny_config(
        tmp_path,
        "train.steps=3",
        "train.eval_every=0",
        "train.export=false",
        "rollout.prompts_per_step=8",
        "task.max_reward_failure_share=0.5",
    )
    result = train_module.train(config, task=task)
    assert result.steps_done == 3
    lines = read_metrics(tmp_path)
    assert sum(line["reward_failures"] for line in lines) > 0  # some rows started with "0+"
    assert all(line["reward/flaky/mean"] == 1.0 for line in lines)  # the mean of what scored

    def always_broken(prompts, completions, **_):
        raise RuntimeError("verifier crashed")

    task.reward_fns = {"correct": base.reward_fns["correct"], "broken": always_broken}
    with pytest.raises(RewardError, match="more than the allowed share"):
        train_module.train(tiny_config(tmp_path / "broken", "train.steps=1"), task=task)


def test_dynamic_sampling_replaces_groups_without_signal(tmp_path):
    base = addition_task()

    def half_constant(prompts, completions, **_):
        # Prompts with an even first operand always score 0: their groups carry no signal.
        return [
            0.0 if int(p[0]) % 2 == 0 else float(len(c))
            for p, c in zip(prompts, completions, strict=True)
        ]

    task = Task(
        name="half",
        train=base.train,
        eval=base.eval,
        reward_fns={"half": half_constant},
        reward_weights={},
        correctness="half",
        tokenizer=base.tokenizer,
    )
    config = tiny_config(
        tmp_path,
        "algorithm.dynamic_sampling=true",
        "algorithm.max_extra_rollouts=6",
        "rollout.temperature=2.0",
    )
    trainer = train_module.Trainer(config, task)
    params = trainer.model.params()
    groups, metrics, position = trainer.collect(params, None, jax.random.key(0), 0)
    g = config.rollout.num_generations
    assert len(groups.rewards) == 4 * g
    assert not zero_signal_of(groups, g).any()
    assert all(int(p[0]) % 2 == 1 for p in groups.prompts)
    assert metrics["dynamic/extra_rollouts"] >= 1 and position == 4 * (
        1 + metrics["dynamic/extra_rollouts"]
    )
    assert metrics["frac_zero_std"] > 0

    # Without extra rollouts the step is filled up with zero-signal groups (advantage 0).
    config = tiny_config(
        tmp_path, "algorithm.dynamic_sampling=true", "algorithm.max_extra_rollouts=0"
    )
    trainer = train_module.Trainer(config, task)
    groups, metrics, _ = trainer.collect(params, None, jax.random.key(0), 0)
    flat = zero_signal_of(groups, g)
    assert metrics["dynamic/zero_signal_kept"] == flat.sum() > 0
    advantages = trainer.advantages(groups).reshape(-1, g)
    np.testing.assert_array_equal(advantages[flat], 0.0)


def test_the_update_runs_each_prompt_once_when_batches_hold_whole_groups():
    """G rows share one prompt forward unless a micro-batch or a batch shard splits groups."""

    def shared_rows(*overrides, batch_shards=1):
        config = load_config(
            None, ["rollout.prompts_per_step=4", "rollout.num_generations=8", *overrides]
        )
        update = train_module.update_config_of(config, beta_in_loss=0.0, batch_shards=batch_shards)
        return update.shared_prompt_rows

    assert shared_rows() == 8  # on by default
    assert shared_rows("algorithm.shared_prompt_forward=false") == 1
    assert shared_rows("algorithm.num_minibatches=2", "algorithm.grad_accumulation=2") == 8
    assert shared_rows("algorithm.grad_accumulation=8") == 1  # 4 rows per micro-batch
    assert shared_rows(batch_shards=4) == 8
    assert shared_rows("algorithm.num_minibatches=2", batch_shards=4) == 1  # 2 prompts, 4 shards


def test_overlong_penalty_is_dapos_soft_ramp():
    lengths = np.array([10, 12, 13, 14, 16])
    penalty = train_module.overlong_penalty(lengths, limit=16, buffer=4, factor=1.0)
    np.testing.assert_allclose(penalty, [0.0, 0.0, -0.25, -0.5, -1.0])
    assert not train_module.overlong_penalty(lengths, 16, 0, 1.0).any()


def test_mask_truncated_and_kl_in_reward(tmp_path):
    config = tiny_config(
        tmp_path,
        "algorithm.mask_truncated=true",
        "algorithm.beta=0.1",
        "algorithm.kl_in_reward=true",
        "algorithm.overlong_buffer=2",
        "train.steps=2",
        "train.eval_every=0",
        "train.export=false",
    )
    trainer = train_module.Trainer(config)
    assert trainer.update_config.beta == 0.0  # the KL moved from the loss to the reward
    params = trainer.model.params()
    groups, metrics, _ = trainer.collect(params, params, jax.random.key(1), 0)
    # Policy == reference: the KL term is exactly 0 (k3 of identical log-probs).
    np.testing.assert_allclose(groups.per_function["kl_penalty"], 0.0, atol=1e-6)
    assert "reward/overlong/mean" in metrics and metrics["reward/overlong/mean"] <= 0
    batch = trainer.to_batch(groups, np.zeros(len(groups.rewards), np.float32))
    mask = np.asarray(batch.completion_mask)
    assert not mask[groups.truncated].any() and groups.truncated.any()
    np.testing.assert_array_equal(mask[~groups.truncated], groups.mask[~groups.truncated])
    result = train_module.train(config)
    assert "reward/kl_penalty/mean" in read_metrics(tmp_path)[-1] and result.steps_done == 2


def test_bf16_matmuls_reach_the_update_and_the_reference_logprobs(tmp_path):
    """model.matmul_dtype=bfloat16 sets the update's matmul dtype and the KL-in-reward
    reference log-probs' (both sides of the KL computed alike: exactly 0 at the start)."""
    from jgrpo.update import completion_logprobs

    config = tiny_config(
        tmp_path,
        "model.matmul_dtype=bfloat16",
        "algorithm.beta=0.1",
        "algorithm.kl_in_reward=true",
        "train.steps=1",
        "train.eval_every=0",
        "train.export=false",
    )
    trainer = train_module.Trainer(config)
    assert trainer.update_config.matmul_dtype == "bfloat16"
    params = trainer.model.params()
    groups, _, _ = trainer.collect(params, params, jax.random.key(1), 0)
    np.testing.assert_allclose(groups.per_function["kl_penalty"], 0.0, atol=1e-6)
    batch = trainer.to_batch(groups, np.zeros(len(groups.rewards), np.float32))
    scored = {
        dtype: completion_logprobs(
            params,
            batch,
            model_config=trainer.model_config,
            temperature=1.0,
            chunk_size=4096,
            matmul_dtype=dtype,
        )[0]
        for dtype in ("float32", "bfloat16")
    }
    frozen = np.asarray(trainer.frozen_logprobs(params, batch))
    np.testing.assert_allclose(frozen, scored["bfloat16"], rtol=1e-6, atol=1e-6)
    assert np.abs(frozen - np.asarray(scored["float32"])).max() > 1e-6
    assert train_module.train(config).steps_done == 1


def test_bf16_sampling_with_the_sampler_correction(tmp_path):
    """rollout.weights_dtype=bfloat16 samples from a policy a little off the f32 one; the
    rollout's log-probs reach the update, which logs their gap to the f32 policy's and
    weights each token by min(pi / pi_sampler, cap) (algorithm.sampler_correction)."""
    config = tiny_config(
        tmp_path,
        "rollout.weights_dtype=bfloat16",
        "algorithm.sampler_correction=token",
        "algorithm.sampler_correction_cap=1.0002",
        "train.steps=1",
        "train.eval_every=0",
        "train.export=false",
    )
    trainer = train_module.Trainer(config)
    assert trainer.update_config.sampler_correction == "token"
    params = trainer.initial_params()
    groups, _, _ = trainer.collect(params, None, jax.random.key(1), 0)
    batch = trainer.to_batch(groups, np.zeros(len(groups.rewards), np.float32))
    np.testing.assert_array_equal(batch.sampler_logprobs, groups.sampler_logprobs)
    policy = np.asarray(trainer.frozen_logprobs(params, batch))  # f32 weights
    mask = groups.mask
    log_ratio = (policy - groups.sampler_logprobs)[mask]
    gap = np.abs(log_ratio).mean()
    assert 1e-5 < gap < 0.05, gap  # bf16 rounding of the weights, no more
    cap = np.float32(1.0002)  # the tiny model's bf16 weights move a token's ratio by ~1e-4
    weights = np.minimum(np.exp(log_ratio), cap)
    capped = (weights == cap).mean()
    assert 0 < capped < 1  # the cap cuts some tokens
    _, metrics = trainer.compiled_update()(trainer.initial_state(params), batch, None)
    np.testing.assert_allclose(metrics["sampler_gap"][0, 0], gap, rtol=1e-3)
    np.testing.assert_allclose(metrics["sampler_weight_mean"][0, 0], weights.mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["sampler_capped_frac"][0, 0], capped, atol=1e-6)
    assert train_module.train(config).steps_done == 1
    logged = read_metrics(tmp_path)[-1]
    assert {"sampler/gap", "sampler/weight_mean", "sampler/capped_frac"} <= logged.keys()


def test_the_sampler_corrections_bounds_reach_the_update():
    config = load_config(
        None,
        [
            "algorithm.sampler_correction=sequence",
            "algorithm.sampler_correction_cap=3",
            "algorithm.sampler_correction_mode=mask",
            "algorithm.sampler_correction_floor=0.5",
        ],
    )
    update = train_module.update_config_of(config, beta_in_loss=0.0)
    assert (update.sampler_correction, update.sampler_correction_cap) == ("sequence", 3.0)
    assert (update.sampler_correction_mode, update.sampler_correction_floor) == ("mask", 0.5)
    default = train_module.update_config_of(load_config(None, []), beta_in_loss=0.0)
    assert (default.sampler_correction_mode, default.sampler_correction_floor) == ("truncate", 0)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], "none"),  # auto: the sampler is the f32 policy itself
        (["rollout.weights_dtype=bfloat16"], "token"),  # auto: a rounded sampler, corrected
        (["rollout.weights_dtype=bfloat16", "algorithm.sampler_correction=none"], "none"),
        (["algorithm.sampler_correction=sequence"], "sequence"),
    ],
)
def test_the_sampler_correction_defaults_on_for_bf16_sampling(overrides, expected):
    """algorithm.sampler_correction=auto (the default) corrects a bf16 sampler, as TRL
    corrects its vLLM samples by default, and leaves an f32 one alone."""
    config = load_config(None, overrides)
    assert config.sampler_correction == expected
    assert train_module.update_config_of(config, beta_in_loss=0.0).sampler_correction == expected


def test_the_loss_options_reach_the_update_config():
    config = load_config(
        None,
        [
            "algorithm.beta=0.04",
            "algorithm.kl_bias_correction=true",
            "algorithm.dual_clip=3",
            "algorithm.top_entropy_quantile=0.2",
            "algorithm.off_policy_mask_threshold=0.5",
            "algorithm.cispo_max_ratio=4",
            "algorithm.sapo_temperature_pos=0.5",
            "algorithm.sapo_temperature_neg=1.5",
        ],
    )
    update = train_module.update_config_of(config, beta_in_loss=0.04)
    assert update.kl_bias_correction and update.dual_clip == 3.0
    assert update.top_entropy_quantile == 0.2 and update.off_policy_mask_threshold == 0.5
    assert update.cispo_max_ratio == 4.0
    assert (update.sapo_temperature_pos, update.sapo_temperature_neg) == (0.5, 1.5)
    sapo = load_config(None, ["algorithm.policy_loss=sapo"])
    assert train_module.update_config_of(sapo, beta_in_loss=0.0).policy_loss == "sapo"
    default = train_module.update_config_of(load_config(None, []), beta_in_loss=0.0)
    assert not default.kl_bias_correction and default.dual_clip is None
    assert default.top_entropy_quantile == 1.0 and default.off_policy_mask_threshold is None
    assert default.policy_loss == "clip"
    metrics = train_module._update_metrics(
        {"clip_frac_dual": np.array([[0.25, 0.75]]), "off_policy_masked_frac": np.array([[0.5]])}
    )
    assert metrics == {"clip_frac/dual": 0.5, "off_policy/masked_frac": 0.5}


def test_the_logits_budget_reaches_the_update():
    config = load_config(None, ["model.keep_logits_mib=0"])
    assert train_module.update_config_of(config, beta_in_loss=0.0).keep_logits_mib == 0
    default = train_module.update_config_of(load_config(None, []), beta_in_loss=0.0)
    assert default.keep_logits_mib == 512


def test_a_prompt_longer_than_the_limit_is_an_error_not_a_truncation(tmp_path):
    from jgrpo.tasks.datasets import DatasetError

    # "<s>" + "4+4=" is 5 tokens; with operands up to 10, "10+10=" makes 7.
    config = tiny_config(tmp_path, "task.max_operand=10", "rollout.max_prompt_length=6")
    with pytest.raises(
        DatasetError, match=r"addition train row \d+: prompt is 7 tokens, more than 6"
    ):
        train_module.Trainer(config)
    # on_error=skip leaves those prompts out (logged), and keeps every other one.
    trainer = train_module.Trainer(
        tiny_config(
            tmp_path, "task.max_operand=10", "rollout.max_prompt_length=6", "task.on_error=skip"
        )
    )
    assert len(trainer.task.train) == 121 - 1  # only "10+10=" is too long
    assert all(e["prompt"] != "10+10=" for e in trainer.task.train)


def test_main_help_and_bad_configs(capsys, tmp_path):
    assert train_module.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "rollout.num_generations" in out and "default 8" in out
    assert train_module.main(["rollout.num_generation=4"]) == 2
    assert "Did you mean rollout.num_generations" in capsys.readouterr().err
    assert train_module.main(["rollout.num_generations=1"]) == 2
    assert ">= 2" in capsys.readouterr().err
    assert train_module.main([str(tmp_path / "missing.yaml")]) == 2


def test_main_without_a_yaml_runs_demo_config(tmp_path, monkeypatch):
    from jgrpo.config import demo_config

    configs = []

    def fake_train(config):
        configs.append(config)
        return train_module.TrainResult(None, 0, tmp_path)

    monkeypatch.setattr(train_module, "train", fake_train)
    assert train_module.main([f"train.run_dir={tmp_path}", "smoke"]) == 0
    assert configs == [demo_config([f"train.run_dir={tmp_path}", "smoke"])]


def test_evaluate_logs_the_task_it_scores(tmp_path, caplog):
    """A policy trained on the CLI demo (sums of 0-4) evaluated with `load_config(None)` is
    scored on sums of 0-9: the log says which task, naming the settings that differ."""
    config = tiny_config(tmp_path, "task.max_operand=4", "train.log_samples=0")
    with caplog.at_level(logging.INFO, logger="jgrpo.train"):
        train_module.evaluate(config)
    assert "evaluating 25 eval prompts of task.name=addition, task.max_operand=4, " in caplog.text


def test_main_reports_bad_input_and_divergence_in_one_line_without_a_traceback(capsys, tmp_path):
    """Each of these ended in a traceback; now one line says what and where (a data file's
    problems are listed, one per row), with exit status 2 for bad input, 1 for divergence."""
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("rollout:\n  num_generations: [4,\n")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("train:\n  run_dir: caf\xe9\n".encode("latin-1"))
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1=", "answer": "2"}\n{"question": "2+2="}\n')
    run = [*TINY, f"train.run_dir={tmp_path / 'run'}", "train.eval_every=0"]
    jsonl = ["task.name=jsonl", "task.rewards=math"]
    cases = [  # argv, exit status, the start of the error's line
        ([str(bad_yaml)], 2, f"config error: {bad_yaml} is not valid YAML: "),
        ([str(latin)], 2, f"config error: {latin} is not UTF-8 text"),
        ([str(tmp_path)], 2, f"config error: {tmp_path} is a folder, not a config file"),
        (["train.steps=["], 2, "config error: override 'train.steps=[': the value is not valid"),
        (
            [*run, *jsonl, f"task.path={tmp_path / 'none.jsonl'}"],
            2,
            f"error: {tmp_path / 'none.jsonl'}: No such file or directory (from task.path=",
        ),
        ([*run, "task.rewards=nosuch:1"], 2, "error: task.rewards: unknown reward 'nosuch'"),
        ([*run, *jsonl, f"task.path={rows}"], 2, f"error: {rows}: 1 of 2 rows cannot be used"),
        # The first step whose groups have a signal moves the weights to ~1e30.
        ([*run, "optim.lr=1e30", "train.steps=3"], 1, "training diverged: step "),
    ]
    for argv, status, message in cases:
        assert train_module.main(argv) == status, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err, err
        (line,) = [line for line in err.splitlines() if "error: " in line or "diverged" in line]
        assert line.startswith(message), (line, message)
    assert "params_norm=inf is not finite" in line and "Lower optim.lr" in line
    assert not (tmp_path / "run" / "hf").exists()


def test_non_finite_loss_stops_with_the_last_good_checkpoint(tmp_path, monkeypatch):
    real = train_module._update_metrics

    def poisoned(update):
        metrics = real(update)
        metrics["loss"] = float("nan")
        return metrics

    monkeypatch.setattr(train_module, "_update_metrics", poisoned)
    config = tiny_config(tmp_path, "train.steps=3", "train.eval_every=0")
    with pytest.raises(
        train_module.TrainingDiverged, match="step 1: .*no checkpoint was written yet"
    ):
        train_module.train(config)
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())


def test_weights_blown_up_by_the_update_stop_the_run_before_they_are_saved(tmp_path):
    """lr=1e30 leaves step 1's loss and gradient finite (computed before the update) but its
    weights near 1e30, whose norm overflows float32: the run stops at step 1, before the
    step-1 checkpoint and the export, so a rerun has nothing diverged to resume from."""
    config = tiny_config(
        tmp_path, "optim.lr=1e30", "train.steps=2", "train.save_every=1", "train.eval_every=0"
    )
    with pytest.raises(
        train_module.TrainingDiverged,
        match=r"step 1: params_norm=inf is not finite; no checkpoint was written yet",
    ):
        train_module.train(config)
    assert not list((tmp_path / "checkpoints").iterdir())
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_the_demo_learns_addition_from_scratch(tmp_path):
    """`python -m jgrpo.train` with no config (one CPU device, as users run it): the mean
    reward goes from near its random level to >= 0.9 of its maximum."""
    from jgrpo.config import DEMO_OVERRIDES

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # not the tests' 8 devices
    subprocess.run(
        [sys.executable, "-m", "jgrpo.train", f"train.run_dir={tmp_path}", "train.progress=false"],
        check=True,
        env=env,
        capture_output=True,
    )
    lines = read_metrics(tmp_path)
    config = load_config(None, DEMO_OVERRIDES)
    assert len(lines) == config.train.steps
    max_reward = addition_task(max_operand=config.task.max_operand).max_reward
    first = np.mean([line["reward/mean"] for line in lines[:20]])
    last = np.mean([line["reward/mean"] for line in lines[-20:]])
    assert first < 0.2 * max_reward  # near the random level at the start
    assert last >= 0.9 * max_reward, (first, last)
    assert lines[-1]["eval/accuracy"] >= 0.8  # greedy, over all 25 problems
    assert (tmp_path / "hf" / "config.json").exists()


def test_the_qwen_recipe_runs_on_a_local_hf_checkpoint(tmp_path, hf_checkpoint):
    """The real-model recipe, smoke-sized, on a tiny local checkpoint with a chat template."""
    import shutil

    from transformers import AutoTokenizer

    from jgrpo import models

    source, _ = hf_checkpoint("llama3")
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(source, checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    tokenizer.save_pretrained(checkpoint)
    recipe = pathlib.Path(__file__).parent.parent / "configs" / "qwen2.5-0.5b-addition.yaml"
    config = load_config(
        recipe,
        [
            f"model.path={checkpoint}",
            f"train.run_dir={tmp_path / 'run'}",
            "train.steps=1",
            "train.progress=false",
            "task.eval_size=2",
            "rollout.prompts_per_step=2",
            "rollout.num_generations=4",
            "rollout.max_new_tokens=4",
            "algorithm.num_minibatches=2",
            "algorithm.grad_accumulation=2",
            "mesh.fsdp=2",  # the 8 test devices, as on a TPU VM: export gathers the shards
            "mesh.tensor=4",
        ],
    )
    result = train_module.train(config)
    assert result.steps_done == 1
    (line,) = read_metrics(tmp_path / "run")
    assert {"reward/correct/mean", "reward/format/mean", "eval/accuracy", "loss"} <= line.keys()
    # The export keeps the checkpoint's tokenizer (with its chat template) and new weights.
    exported = models.from_pretrained(tmp_path / "run" / "hf")
    assert_trees_equal(exported.params(), result.state.params)
    assert AutoTokenizer.from_pretrained(tmp_path / "run" / "hf").chat_template
