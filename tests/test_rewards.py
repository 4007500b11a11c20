"""The reward protocol: TRL signature, weights, None, exceptions, the failure share."""

import logging
import math

import numpy as np
import pytest

from jgrpo.rewards import RewardError, score_completions
from jgrpo.rewards.pool import VerifierTimeout


def length_reward(prompts, completions, **_):
    return [float(len(c)) for c in completions]


def answer_reward(prompts, completions, answer, **_):
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def test_weighted_sum_and_fields_reach_the_functions():
    seen = {}

    def spy(prompts, completions, answer, completion_ids, **kwargs):
        seen.update(prompts=prompts, answer=answer, ids=completion_ids, extra=kwargs)
        return [0.5] * len(completions)

    scores = score_completions(
        {"len": length_reward, "answer": answer_reward, "spy": spy},
        {"len": 0.5, "answer": 2.0},  # spy: default weight 1
        ["p0", "p1"],
        ["ab", "7"],
        {"answer": ["ab", "8"], "completion_ids": [[1, 2], [3]], "level": [1, 2]},
    )
    np.testing.assert_allclose(scores.total, [0.5 * 2 + 2.0 * 1 + 0.5, 0.5 * 1 + 0 + 0.5])
    assert scores.valid.tolist() == [True, True]
    np.testing.assert_array_equal(scores.per_function["answer"], [1.0, 0.0])
    assert seen == {
        "prompts": ["p0", "p1"],
        "answer": ["ab", "8"],
        "ids": [[1, 2], [3]],
        "extra": {"level": [1, 2]},
    }
    assert scores.failures == {"len": 0, "answer": 0, "spy": 0}


def test_none_leaves_a_function_out_and_all_none_is_invalid():
    def only_first(prompts, completions, **_):
        return [1.0, None, None]

    def only_second(prompts, completions, **_):
        return [3.0, 2.0, None]

    scores = score_completions(
        {"a": only_first, "b": only_second}, {"a": 1.0, "b": 1.0}, ["p"] * 3, ["x"] * 3, {}
    )
    np.testing.assert_allclose(scores.total, [4.0, 2.0, 0.0])
    assert scores.valid.tolist() == [True, True, False]
    assert math.isnan(scores.per_function["a"][1])
    assert scores.failures == {"a": 0, "b": 0}  # None is not a failure


def test_an_exception_scores_only_the_offending_rows_none(caplog):
    def fragile(prompts, completions, **_):
        return [1.0 / float(c) for c in completions]  # "zero" and "x" raise

    completions = ["1", "2", "0", "4", "5", "8", "10", "20", "25", "x"]
    with caplog.at_level(logging.WARNING, logger="jgrpo.rewards"):
        scores = score_completions(
            {"inv": fragile}, {}, ["p"] * 10, completions, {}, max_failure_share=0.2
        )
    values = scores.per_function["inv"]
    assert np.isnan(values[2]) and np.isnan(values[9])
    np.testing.assert_allclose(values[[0, 1, 3]], [1.0, 0.5, 0.25])
    assert scores.valid.tolist() == [True, True, False] + [True] * 6 + [False]
    assert scores.failures == {"inv": 2}
    assert "failed on completion 2" in caplog.text and "'0'" in caplog.text


def test_too_many_failures_stop_the_step_with_a_clear_message():
    def broken(prompts, completions, **_):
        raise KeyError("answer")

    with pytest.raises(RewardError, match=r"2 of 8 reward scores failed.*broken: 2.*share 0.2"):
        score_completions(
            {"broken": broken, "len": length_reward},
            {},
            ["p"] * 4,
            ["a"] * 4,
            {},
            max_failure_share=0.2,  # 1.6 of 8 scores may fail: the second failure stops it
        )


class TimingOutPool:
    """A pool whose every call times out, counting the calls (the seconds they would cost)."""

    def __init__(self):
        self.calls = 0

    def run(self, fn, kwargs, *, name):
        self.calls += 1
        raise VerifierTimeout(f"reward function {name!r} took longer than 60 s")


def test_a_reward_that_always_hangs_stops_the_step_once_the_failure_share_is_passed():
    """Its batch call times out, then each row's: the retries stop at the first failure past
    the share (0.1 x 32 = 3.2 scores may fail), 5 timeouts instead of 33."""
    pool = TimingOutPool()
    with pytest.raises(RewardError, match="4 of 32 reward scores failed.*hangs: 4"):
        score_completions({"hangs": length_reward}, {}, ["p"] * 32, ["a"] * 32, {}, pool=pool)
    assert pool.calls == 1 + 4


@pytest.mark.parametrize(
    "bad", [float("nan"), float("inf"), -float("inf"), 1e39, np.float64(-1e300)]
)
def test_a_non_finite_score_counts_as_a_failure(bad, caplog):
    """NaN, +-inf and values beyond float32's range (inf once stored) would make the loss NaN."""

    def bad_reward(prompts, completions, **_):
        return [bad, 1.0]

    with caplog.at_level(logging.WARNING, logger="jgrpo.rewards"):
        scores = score_completions(
            {"n": bad_reward, "len": length_reward},
            {},
            ["p"] * 2,
            ["a", "bc"],
            {},
            max_failure_share=1,
        )
    assert scores.failures == {"n": 1, "len": 0}
    assert np.isnan(scores.per_function["n"][0]) and scores.per_function["n"][1] == 1.0
    np.testing.assert_array_equal(scores.total, [1.0, 3.0])  # row 0: only len scored it
    assert scores.valid.tolist() == [True, True]
    assert "on completion 0 (scored None)" in caplog.text


@pytest.mark.parametrize(
    "returned, message",
    [
        ([1.0], "returned 1 values for 2 completions"),
        (None, "returned None"),
        (["high", 1.0], "returned 'high'"),
    ],
)
def test_a_malformed_return_is_an_error_naming_the_function(returned, message):
    def bad(prompts, completions, **_):
        return returned

    with pytest.raises(RewardError, match=f"'bad'.*{message}|{message}"):
        score_completions({"bad": bad}, {}, ["p"] * 2, ["a", "b"], {})


def slow_on_seven(prompts, completions, **_):
    """A verifier that hangs on one completion (module-level: it can go to a worker)."""
    import time

    if "7" in completions:
        time.sleep(60)
    return [float(len(c)) for c in completions]


def test_a_hanging_verifier_costs_its_timeout_not_the_step():
    from jgrpo.rewards.pool import VerifierPool

    with VerifierPool(workers=2, timeout_s=2.0) as pool:
        scores = score_completions(
            {
                "slow": slow_on_seven,
                "len": length_reward,
                "local": lambda completions, **_: [1.0] * len(completions),
            },
            {},
            ["p"] * 4,
            ["ab", "7", "abc", "d"],
            {},
            max_failure_share=0.5,
            pool=pool,
        )
    # The batch call timed out, then each row ran alone: only the hanging row is lost (had the
    # pool waited out the 60 s sleep, that row would hold its length, 1.0).
    np.testing.assert_array_equal(scores.per_function["slow"][[0, 2, 3]], [2.0, 3.0, 1.0])
    assert np.isnan(scores.per_function["slow"][1])
    assert scores.failures == {"slow": 1, "len": 0, "local": 0}
    np.testing.assert_array_equal(scores.per_function["len"], [2.0, 1.0, 3.0, 1.0])
    np.testing.assert_array_equal(scores.per_function["local"], [1.0] * 4)  # ran in-process


def test_a_function_from_a_notebook_runs_in_process_not_in_a_worker(monkeypatch):
    """A worker imports a function's module by name; a notebook's __main__ has no file, so
    sending it there would fail in the worker (and stall the pool). It runs here instead."""
    import sys
    import types

    from jgrpo.rewards.pool import VerifierPool

    main = types.ModuleType("__main__")  # as in a Jupyter kernel: no __file__

    def from_a_cell(prompts, completions, **_):
        return [2.0] * len(completions)

    from_a_cell.__module__, from_a_cell.__qualname__ = "__main__", "from_a_cell"
    main.from_a_cell = from_a_cell
    monkeypatch.setitem(sys.modules, "__main__", main)
    with VerifierPool(workers=1, timeout_s=5.0) as pool:
        assert pool.run(from_a_cell, {"prompts": ["p"], "completions": ["c"]}) == [2.0]
        assert pool._workers == []  # no worker was started
        # Module-level functions (this file has one) still go to a worker.
        assert pool.run(length_reward, {"prompts": ["p"], "completions": ["abc"]}) == [3.0]
        assert pool._workers
