"""The slot rollout (`rollout.max_concurrent`): rows decode in refilled slots, draw the tokens the
all-rows loop draws, and train alike; the KV budget that chooses the slot count."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tiny_hf import VOCAB

from jgrpo import train as train_module
from jgrpo.config import ConfigError, load_config
from jgrpo.generation import pad_prompts
from jgrpo.metrics import read_metrics
from jgrpo.models.group_decode import cache_bytes_per_slot
from jgrpo.models.hf import from_pretrained
from jgrpo.plan import plan_memory
from jgrpo.rollout import SamplingConfig, rollout
from jgrpo.setup import Setup

EOS = 2
# Ten of the 97 ids stop a completion: a random model's lengths then spread from 1 to the limit.
RAGGED_STOPS = tuple(range(EOS, EOS + 10))


def prompts(lengths=(5, 9, 3), seed=0):
    rng = np.random.default_rng(seed)
    return pad_prompts([rng.integers(12, VOCAB, n).tolist() for n in lengths])


def sample(
    model,
    max_concurrent,
    *,
    num_generations=4,
    max_new_tokens=24,
    ids_mask=None,
    stop_after=None,
    **settings,
):
    ids, mask = prompts() if ids_mask is None else ids_mask
    settings.setdefault("stop_token_ids", RAGGED_STOPS)
    return rollout(
        model.params(),
        jnp.asarray(ids),
        jnp.asarray(mask),
        jax.random.key(7),
        model_config=model.config,
        num_generations=num_generations,
        sampling=SamplingConfig(
            max_new_tokens=max_new_tokens, max_concurrent=max_concurrent, **settings
        ),
        stop_after=stop_after,
    )


def refill_schedule(lengths: np.ndarray, slots: int) -> np.ndarray:
    """The decode step after which each row draws its last token, when rows that need decode
    steps (length > 1: the first token comes from the prefill) take `slots` slots in row
    order, and each slot freed at a step takes the next waiting row, in slot order."""
    waiting = [row for row in range(len(lengths)) if lengths[row] > 1]
    held = [waiting.pop(0) if waiting else None for _ in range(slots)]
    left = {row: int(lengths[row]) - 1 for row in held if row is not None}
    finished_at = np.zeros(len(lengths), np.int32)
    step = 0
    while any(row is not None for row in held):
        step += 1
        for slot, row in enumerate(held):
            if row is None:
                continue
            left[row] -= 1
            if left[row] == 0:
                finished_at[row] = step
                held[slot] = waiting.pop(0) if waiting else None
                if held[slot] is not None:
                    left[held[slot]] = int(lengths[held[slot]]) - 1
    return finished_at


@pytest.mark.parametrize(
    ("family", "settings"),
    # q/k norm; filters on; windows per row (slots at their own positions)
    [("qwen3", {}), ("llama3", {"top_k": 20, "top_p": 0.9}), ("gemma3", {})],
)
def test_slots_draw_the_tokens_of_the_all_rows_loop(family, settings, hf_checkpoint):
    """Each row's tokens depend on the seed, the prompt and the row, not on the slot that ran
    it or on how many slots there are; its log-probs equal the all-rows loop's to float
    rounding (XLA:CPU picks its kernels by batch shape, e.g. a one-row product is a
    matrix-vector kernel, and a row sum over 256 columns rounds differently for 16 rows than
    for 15). Measured 0 to 1.5e-6 on a Zen 4 host with AVX-512; on a Zen 3 host without it
    (2026-12-08) gemma3's 3 slots put one log-prob of 288 2.4e-6 off (-4.567057 against
    -4.567060, 5 float32 ulps), the others within 1.5e-6."""
    model = from_pretrained(hf_checkpoint(family)[0])
    everything = sample(model, 0, **settings)
    lengths = np.asarray(everything.lengths)
    assert len(set(lengths.tolist())) >= 5 and lengths.min() >= 1  # ragged
    assert 0 < np.asarray(everything.truncated).sum() < len(lengths)
    np.testing.assert_array_equal(everything.finished_at, lengths - 1)
    # one slot count for gemma3: its windows per row are what it adds (5 layers compile slowly)
    for slots in (3,) if family == "gemma3" else (1, 3, 5):
        result = sample(model, slots, **settings)
        for name in ("tokens", "mask", "lengths", "truncated", "group_ids"):
            np.testing.assert_array_equal(getattr(result, name), getattr(everything, name), name)
        for name in ("logprobs", "sampler_logprobs"):
            np.testing.assert_allclose(
                getattr(result, name), getattr(everything, name), atol=3e-6, rtol=0
            )
        np.testing.assert_array_equal(result.finished_at, refill_schedule(lengths, slots))


def test_a_rows_draws_are_bit_for_bit_the_same_in_any_slot_beside_any_rows(hf_checkpoint):
    """At one slot count the decode step's kernels keep their shapes, and a row's tokens and
    log-probs are then exactly the same whichever slot runs it, from whichever decode step,
    beside whichever rows: here three early rows stop after 2 tokens, so every later row
    starts sooner, in another slot. (Across slot counts the shapes change, hence the
    rounding the test above allows.)"""
    model = from_pretrained(hf_checkpoint("qwen3")[0])
    before = sample(model, 3)
    rows, steps = before.tokens.shape
    cut = np.flatnonzero(np.asarray(before.lengths) > 2)[:3]  # three early rows, cut short
    stop_after = np.full(rows, steps + 1, np.int32)  # steps + 1: never
    stop_after[cut] = 2
    after = sample(model, 3, stop_after=jnp.asarray(stop_after))
    assert (np.asarray(after.lengths)[cut] == 2).all()
    kept = np.setdiff1d(np.arange(rows), cut)
    moved = np.asarray(after.finished_at)[kept] != np.asarray(before.finished_at)[kept]
    assert moved.sum() >= len(kept) // 2  # most rows now end at another decode step
    for name in ("tokens", "mask", "lengths", "truncated", "logprobs", "sampler_logprobs"):
        np.testing.assert_array_equal(
            np.asarray(getattr(after, name))[kept], np.asarray(getattr(before, name))[kept], name
        )


def test_slot_efficiency_of_the_schedule():
    """The schedule the test checks the engine against: 3 rows needing 4, 1 and 2 decode steps
    (lengths 5, 2, 3) and a row that stopped at its first token, in 2 slots."""
    assert refill_schedule(np.array([5, 2, 1, 3]), 2).tolist() == [4, 1, 0, 3]
    assert refill_schedule(np.array([5, 2, 1, 3]), 1).tolist() == [4, 5, 0, 7]


def test_greedy_slots_equal_transformers_generate(hf_checkpoint):
    directory, torch_model = hf_checkpoint("qwen2")
    model = from_pretrained(directory)
    ids, mask = prompts(lengths=(5, 9, 3, 7, 4, 6), seed=1)
    stops = tuple(range(EOS, EOS + 20))  # greedy rows of this model then stop at 3 to 12 tokens
    result = sample(
        model,
        2,
        num_generations=1,
        max_new_tokens=12,
        ids_mask=(ids, mask),
        temperature=0.0,
        stop_token_ids=stops,
    )
    with torch.no_grad():
        expected = torch_model.generate(
            torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            do_sample=False,
            max_new_tokens=12,
            eos_token_id=list(stops),
            pad_token_id=0,
        )[:, ids.shape[1] :].numpy()
    tokens, lengths = np.asarray(result.tokens), np.asarray(result.lengths)
    assert len(set(lengths.tolist())) > 1
    for row, length in enumerate(lengths):
        np.testing.assert_array_equal(tokens[row, :length], expected[row, :length])


TINY = [
    "rollout.max_prompt_length=8",
    "rollout.max_new_tokens=12",
    "rollout.prompts_per_step=4",
    "rollout.num_generations=4",
    "algorithm.beta=0.04",
    "optim.lr=1e-3",
    "train.steps=3",
    "train.eval_every=1",  # the greedy eval decodes in slots too
    "train.export=false",
    "train.progress=false",
    "train.tensorboard=false",
    "task.reward_workers=0",
]


def test_training_with_slots_equals_training_with_every_row_at_once(tmp_path, count_compiles):
    """Identical updates and training metrics for max_concurrent 0 and 3; only the rollout's
    own figures differ (slots, decode steps, efficiency, speed; `sampler/gap`, which reads
    the rollout's log-probs, to float rounding). Nothing compiles after step 1. On the 8
    test devices, the slots sharded over them."""
    runs, compiles = {}, {}
    for slots in (0, 3):
        run_dir = tmp_path / str(slots)
        config = load_config(
            None,
            [
                *TINY,
                "rollout.prompts_per_step=8",  # a prompt per device
                f"rollout.max_concurrent={slots}",
                f"train.run_dir={run_dir}",
            ],
        )
        on_step = lambda step, _, slots=slots: compiles.setdefault(slots, {}).update(  # noqa: E731
            {step: count_compiles()}
        )
        result = train_module.train(config, on_step=on_step)
        runs[slots] = (read_metrics(run_dir), result.state.params)
        assert compiles[slots][3] == compiles[slots][1]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), runs[0][1], runs[3][1])
    rollout_figures = {"sampler/gap", "tokens_per_s"}
    for every_row, slotted in zip(runs[0][0], runs[3][0], strict=True):
        assert every_row.keys() == slotted.keys()
        for name in every_row:
            if name.startswith(("time/", "rollout/")) or name in rollout_figures:
                continue
            assert every_row[name] == slotted[name], (every_row["step"], name)
        assert abs(every_row["sampler/gap"] - slotted["sampler/gap"]) < 1e-6
        rows = 32
        lengths = every_row["completion_len/mean"] * rows
        assert every_row["rollout/concurrent"] == rows and slotted["rollout/concurrent"] == 3
        assert every_row["rollout/decode_steps"] == every_row["completion_len/max"] - 1
        for line in (every_row, slotted):
            expected = (lengths - rows) / (
                line["rollout/concurrent"] * line["rollout/decode_steps"]
            )
            assert line["rollout/slot_efficiency"] == pytest.approx(expected)
        assert slotted["rollout/slot_efficiency"] > every_row["rollout/slot_efficiency"]


def budget_config(mib, *extra):
    return load_config(
        None,
        [*TINY, "mesh.devices=1", "rollout.max_new_tokens=32", f"rollout.kv_cache_mib={mib}"]
        + list(extra),
    )


def test_a_kv_cache_budget_chooses_the_slots_and_the_plan_reports_them():
    setup = Setup(budget_config(1.0))  # any budget, for the shapes
    per_token = cache_bytes_per_slot(setup.model_config, jnp.float32)
    prompts_bytes = 4 * setup.prompt_widths["train"] * per_token  # 4 prompts, stored once
    completion = 32 * per_token
    budget = (prompts_bytes + 5.5 * completion) / 2**20
    setup = Setup(budget_config(budget))
    assert setup.sampling.max_concurrent == 5
    plan = plan_memory(setup)
    assert plan.kv_cache == prompts_bytes + 5 * completion
    assert "5 of 16 sequences decode at once" in plan.report()
    assert (
        Setup(budget_config(2 * (prompts_bytes + 16 * completion) / 2**20)).sampling.max_concurrent
        == 0
    )
    with pytest.raises(ConfigError, match=r"rollout.kv_cache_mib=.* holds no completion slot"):
        Setup(budget_config((prompts_bytes + 0.5 * completion) / 2**20))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.max_concurrent=-1"], "rollout.max_concurrent must be >= 0"),
        (["rollout.kv_cache_mib=0"], "rollout.kv_cache_mib must be > 0 or null"),
        (
            ["rollout.kv_cache_mib=64", "rollout.max_concurrent=4"],
            "rollout.kv_cache_mib chooses rollout.max_concurrent, so set one of them",
        ),
    ],
)
def test_slot_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
