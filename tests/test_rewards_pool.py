"""The reward worker pool: which functions go to a worker, timeouts, workers that die or cannot
start, and scripts without a __main__ guard."""

import logging
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jgrpo.rewards import RewardError, score_completions
from jgrpo.rewards.pool import VerifierPool, VerifierTimeout, WorkerDied

# Reward functions in a module of their own that imports only the standard library, so a
# worker loads it in milliseconds.
REWARDS = """
import os
import time


def length(prompts, completions, **_):
    return [float(len(c)) for c in completions]


def exits(prompts, completions, **_):
    os._exit(3)


def hangs(prompts, completions, **_):
    time.sleep(600)
"""


@pytest.fixture
def rewards(tmp_path, monkeypatch):
    """The REWARDS module, importable from tmp_path (as the worker processes see it)."""
    (tmp_path / "pool_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import pool_rewards

    yield pool_rewards
    del sys.modules["pool_rewards"]


def call(pool, fn, *completions):
    return pool.run(fn, {"prompts": ["p"] * len(completions), "completions": list(completions)})


def test_a_worker_that_exits_during_a_call_is_noticed_at_once_and_replaced(rewards):
    with VerifierPool(workers=1, timeout_s=60) as pool:  # noticed by the timeout: a failure
        with pytest.raises(WorkerDied, match="exited with code 3 before it answered"):
            call(pool, rewards.exits, "a")
        assert call(pool, rewards.length, "abc", "de") == [3.0, 2.0]  # a new worker


def test_a_dead_worker_is_a_failure_of_its_rows_and_the_step_goes_on(rewards):
    with VerifierPool(workers=2, timeout_s=60) as pool:
        scores = score_completions(
            {"exits": rewards.exits, "length": rewards.length},
            {},
            ["p"] * 3,
            ["a", "bb", "ccc"],
            {},
            max_failure_share=0.5,
            pool=pool,
        )
    assert scores.failures == {"exits": 3, "length": 0}
    np.testing.assert_array_equal(scores.total, [1.0, 2.0, 3.0])


def test_a_hanging_call_times_out_and_a_spare_takes_the_next(rewards):
    with VerifierPool(workers=2, timeout_s=0.5) as pool:
        assert call(pool, rewards.length, "ab") == [2.0]
        first, spare = pool._workers
        with pytest.raises(VerifierTimeout, match="longer than 0.5 s"):
            call(pool, rewards.hangs, "a")
        assert first.process.returncode is not None  # killed
        assert call(pool, rewards.length, "abcd") == [4.0]
        assert pool._workers[0] is spare and len(pool._workers) == 2


def test_a_worker_that_cannot_start_is_an_error_not_a_restart_loop(rewards, tmp_path, monkeypatch):
    broken = tmp_path / "broken_worker.py"
    broken.write_text("import sys\nsys.exit(7)\n")
    monkeypatch.setattr("jgrpo.rewards.pool._WORKER_FILE", str(broken))
    message = "exited with code 7 at start.*reward_workers=0"
    with VerifierPool(workers=2, timeout_s=600) as pool, pytest.raises(RewardError, match=message):
        call(pool, rewards.length, "a")


def test_a_module_no_worker_can_import_is_an_error_naming_the_fix(rewards, tmp_path, caplog):
    (tmp_path / "pool_rewards.py").unlink()  # imported here, gone for the workers
    message = "'length' cannot be loaded.*ModuleNotFoundError"
    with VerifierPool(workers=1, timeout_s=600) as pool, pytest.raises(RewardError, match=message):
        pool.run(rewards.length, {"prompts": ["p"], "completions": ["a"]}, name="length")
    assert "No module named 'pool_rewards'" in caplog.text


def test_functions_that_cannot_go_to_a_worker_run_here_with_the_timeout(caplog):
    import threading

    release = threading.Event()
    caplog.set_level(logging.INFO, logger="jgrpo.rewards")
    with VerifierPool(workers=1, timeout_s=0.2) as pool:
        with pytest.raises(VerifierTimeout, match="left running"):
            pool.run(lambda **_: release.wait(600), {}, name="stuck")
        release.set()
        ones = pool.run(lambda completions, **_: [1.0] * len(completions), {"completions": "ab"})
        assert ones == [1.0, 1.0]
        assert pool._workers == []  # no worker was started
    assert "'stuck' cannot be pickled" in caplog.text


SCRIPT = """
import pathlib
from jgrpo.rewards.pool import VerifierPool
from pool_rewards import length

with open("runs.txt", "a") as runs:  # each execution of this script adds a line
    runs.write("ran\\n")


def shout(prompts, completions, **_):
    return [2.0 for _ in completions]


with VerifierPool(workers=2, timeout_s=60) as pool:
    kwargs = {"prompts": ["p"], "completions": ["abc"]}
    print(pool.run(shout, kwargs, name="shout"), pool.run(length, kwargs, name="length"))
"""


@pytest.mark.parametrize("how", ["file", "stdin", "-c"])
def test_a_script_without_a_main_guard_runs_once_with_workers_on(rewards, tmp_path, how):
    """multiprocessing's spawn and forkserver workers run such a script again (its training,
    its pool, and so on); the pool's workers never run __main__."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    command = {
        "file": [sys.executable, str(script)],
        "stdin": [sys.executable, "-"],
        "-c": [sys.executable, "-c", SCRIPT],
    }[how]
    with script.open() as stdin:
        out = subprocess.run(
            command, stdin=stdin, cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[0] == "[2.0] [3.0]"
    assert (tmp_path / "runs.txt").read_text() == "ran\n"
