"""`task.rewards`: built-in names and your own functions by import path (module:function)."""

import os
import subprocess
import sys

import pytest
from xla_flags import xla_flags

from jgrpo.config import load_config
from jgrpo.rewards.math import math_answer_reward
from jgrpo.rewards.registry import RewardSpecError, parse_reward_spec
from jgrpo.train import build_task

MY_REWARDS = """
import os

NOT_A_FUNCTION = 3


def ends_in_zero(prompts, completions, **fields):
    with open("calls.txt", "a") as calls:  # who ran it: the worker and its parent
        calls.write(f"{os.getpid()} {os.getppid()}\\n")
    return [1.0 if c.endswith("0") else 0.0 for c in completions]
"""


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """A folder holding my_rewards.py, the current directory, and (as for a script started
    elsewhere, or `python file.py`) not on sys.path."""
    (tmp_path / "my_rewards.py").write_text(MY_REWARDS)
    (tmp_path / "broken_rewards.py").write_text("import no_such_module\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield tmp_path
    for name in ("my_rewards", "broken_rewards"):
        sys.modules.pop(name, None)


def test_an_import_path_names_your_own_function_from_the_current_directory(user_folder):
    functions, weights = parse_reward_spec("my_rewards:ends_in_zero:2.5, math")
    assert list(functions) == ["ends_in_zero", "math"]  # the function's name: its metric key
    assert weights == {"ends_in_zero": 2.5, "math": 1.0}
    assert functions["math"] is math_answer_reward
    assert functions["ends_in_zero"](["p", "p"], ["10", "1"]) == [1.0, 0.0]
    assert sys.path[0] == str(user_folder)  # as `python -m` puts it, for the workers too
    functions, weights = parse_reward_spec("my_rewards:ends_in_zero")
    assert list(functions) == ["ends_in_zero"] and weights == {"ends_in_zero": 1.0}


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such:fn", r"cannot import 'no_such' \(ModuleNotFoundError.*put no_such.py in the"),
        ("broken_rewards:fn", r"cannot import 'broken_rewards' \(ModuleNotFoundError.*no_such_"),
        ("my_rewards:missing", r"'my_rewards' \(.*my_rewards.py\) has no 'missing'; name a"),
        ("my_rewards:NOT_A_FUNCTION", r"is a int, not a function; name a function fn\(prompts"),
        (
            "my_rewards:ends_in_zero:x",
            r"weight 'x' for 'ends_in_zero' .* not a number; give a finite",
        ),
        ("math:nan", r"weight 'nan' for 'math' .* not a number; give a finite weight"),
        ("a:b:c:d", "has too many ':'; write name:weight or module:function:weight"),
        ("my_rewards:2", "unknown reward 'my_rewards'"),
        ("maths:1", "unknown reward 'maths'.*or your own function as module:function"),
    ],
)
def test_a_reward_that_does_not_import_is_a_one_line_error_naming_the_fix(
    user_folder, spec, message
):
    with pytest.raises(RewardSpecError, match=message) as error:
        parse_reward_spec(spec)
    assert "\n" not in str(error.value)


def test_two_rewards_with_one_name_are_an_error(user_folder):
    (user_folder / "other.py").write_text("from my_rewards import ends_in_zero\n")
    with pytest.raises(RewardSpecError, match="two rewards named 'ends_in_zero'.*rename one"):
        parse_reward_spec("my_rewards:ends_in_zero, other:ends_in_zero")
    sys.modules.pop("other", None)


def test_build_task_uses_an_import_path_for_a_built_in_task(user_folder):
    config = load_config(None, ["task.rewards=my_rewards:ends_in_zero:0.5"])
    task = build_task(config)
    assert task.reward_weights == {"ends_in_zero": 0.5} and task.correctness == "ends_in_zero"


def test_the_command_line_trains_with_your_own_reward_in_a_worker(user_folder):
    overrides = [
        "task.rewards=my_rewards:ends_in_zero",
        "task.reward_workers=1",
        "train.steps=1",
        "train.eval_every=0",
        "train.progress=false",
        "train.tensorboard=false",
        "train.export=false",
        "rollout.prompts_per_step=2",
        "rollout.num_generations=2",
        "mesh.devices=1",
        "train.run_dir=run",
    ]
    env = {**os.environ, "XLA_FLAGS": xla_flags()}
    command = [sys.executable, "-m", "jgrpo.train", *overrides]
    with subprocess.Popen(
        command, cwd=user_folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    ) as run:
        output, _ = run.communicate(timeout=300)
    assert run.returncode == 0, output.decode()[-3000:]
    calls = [line.split() for line in (user_folder / "calls.txt").read_text().splitlines()]
    assert calls and all(ppid == str(run.pid) and pid != str(run.pid) for pid, ppid in calls)
