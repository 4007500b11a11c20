"""Several jax.distributed processes: two on localhost, 4 CPU devices each, train like one
process with 8 devices, normalise advantages over the whole batch, and their checkpoint
restores on another mesh."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file
from xla_flags import xla_flags

import jgrpo
from jgrpo import distributed
from jgrpo.checkpoint import Checkpointer
from jgrpo.config import DEMO_OVERRIDES, ConfigError, load_config
from jgrpo.metrics import read_metrics
from jgrpo.sharding import make_mesh, row_shardings
from jgrpo.train import Trainer, train

COMMON = [
    "task.max_operand=4",
    "task.eval_size=12",  # two eval chunks, the second padded
    "task.reward_workers=0",
    "rollout.prompts_per_step=8",
    "rollout.num_generations=4",
    "rollout.max_new_tokens=16",
    # the processes agree on the packed rows per group (one width: completion_buckets'
    # widths would multiply the update programs each process compiles)
    "algorithm.pack_completions=true",
    "rollout.max_prompt_length=8",
    "algorithm.beta=0.04",
    "algorithm.kl_in_reward=true",  # the reference pass reads back per-process rows
    "optim.lr=1e-3",
    "train.steps=2",
    "train.eval_every=2",
    "train.save_every=2",
    "train.tensorboard=false",
    "train.progress=false",
    "mesh.data=2",
    "mesh.fsdp=2",
    "mesh.tensor=2",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _tail(output: str, lines: int = 40) -> str:
    """The end of a process's output without the collective libraries' chatter."""
    kept = [line for line in output.splitlines() if "Gloo" not in line and "[SPMD]" not in line]
    return "\n".join(kept[-lines:])


def _run_processes(
    overrides: list[str], count: int = 2, devices: int = 4, *, check: bool = True
) -> list[tuple[int, str]]:
    """Runs `python -m jgrpo.train` as `count` processes of one run; (exit code, output) of each.

    An override may hold `{process}`, replaced by the process index."""
    distributed_settings = [
        "distributed.coordinator_address=localhost:{port}",
        "distributed.num_processes={count}",
        "distributed.process_id={process}",
    ]
    return _run_python(
        ["-m", "jgrpo.train", *overrides, *distributed_settings], count, devices, check=check
    )


def _run_python(
    arguments: list[str], count: int = 2, devices: int = 4, *, check: bool = True
) -> list[tuple[int, str]]:
    """Runs `python ARGUMENTS` as `count` processes on `devices` CPU devices each; (exit code,
    output) of each. An argument may hold `{process}`, `{count}` and `{port}` (the process
    index, the process count and a free port for jax.distributed's coordinator)."""
    port = _free_port()
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(devices),
        "JAX_PLATFORMS": "cpu",
    }
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                *(a.format(process=index, count=count, port=port) for a in arguments),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for index in range(count)
    ]
    try:
        outputs = [process.communicate(timeout=900)[0] for process in processes]
    finally:
        for process in processes:
            process.kill()
    results = [(p.returncode, output) for p, output in zip(processes, outputs, strict=True)]
    for index, (code, output) in enumerate(results):
        assert code == 0 or not check, f"process {index}:\n{_tail(output)}"
    return results


@pytest.mark.slow
def test_two_processes_train_like_one_and_restore_on_another_mesh(tmp_path):
    multi, single = tmp_path / "multi", tmp_path / "single"
    _run_processes([*COMMON, f"train.run_dir={multi}"])
    # `python -m jgrpo.train` without a CONFIG starts from the demo's settings: so does this.
    reference = train(load_config(None, [*DEMO_OVERRIDES, *COMMON, f"train.run_dir={single}"]))

    # Process 0 wrote the metrics of every process's rows: the same as one process's.
    ours, theirs = read_metrics(multi), read_metrics(single)
    assert [line["step"] for line in ours] == [1, 2]
    for a, b in zip(ours, theirs, strict=True):
        for key in ("reward/mean", "completion_len/mean", "frac_zero_std", "eval/accuracy"):
            assert a.get(key) == b.get(key), key  # the same completions, the same scores
        for key in ("reward/std", "reward/kl_penalty/mean", "loss", "grad_norm", "advantage/std"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert "eval/reward" in ours[-1]

    # The export (gathered from both processes' shards) holds the same weights.
    exported = load_file(next(pathlib.Path(multi, "hf").glob("*.safetensors")))
    expected = load_file(next(pathlib.Path(single, "hf").glob("*.safetensors")))
    assert exported.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(exported[name], expected[name], atol=1e-6, err_msg=name)

    # The two-process checkpoint restores into a 1 x 4 x 2 mesh of this one process (the
    # trainer resumes through this same call; test_sharding resumes a run on another mesh).
    other_mesh = [*COMMON, "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"]
    trainer = Trainer(load_config(None, other_mesh))
    target = trainer.initial_state(trainer.initial_params())
    with Checkpointer(multi / "checkpoints") as checkpointer:
        restored, meta = checkpointer.restore(target)
    assert meta["step"] == 2
    for got, want, sharding in zip(
        jax.tree.leaves(restored.params),
        jax.tree.leaves(reference.state.params),
        jax.tree.leaves(trainer.param_shardings),
        strict=True,
    ):
        assert got.sharding == sharding
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


# One process of a jax.distributed run: a Trainer's advantages of its rows of a fixed batch.
ADVANTAGES_OF_ONE_PROCESS = """
import json, pathlib, sys, types

import numpy as np

from jgrpo import distributed

directory, port, process = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
distributed.initialize(
    coordinator_address=f"localhost:{port}", num_processes=2, process_id=process
)
from jgrpo.config import load_config  # noqa: E402
from jgrpo.train import Trainer  # noqa: E402

trainer = Trainer(load_config(None, sys.argv[4:]))
batch = np.load(directory / "batch.npz")
first, stop = trainer.block.bounds(len(batch["rewards"]))
rows = types.SimpleNamespace(  # Trainer.advantages reads these two fields
    rewards=batch["rewards"][first:stop], valid=batch["valid"][first:stop]
)
advantages = trainer.advantages(rows)
(directory / f"process{process}.json").write_text(
    json.dumps({"rows": [first, stop], "advantages": advantages.tolist()})
)
"""


def test_batch_scaled_advantages_use_every_process_rows(tmp_path):
    """algorithm.scale=batch on two processes: each gets its rows' advantages of the whole
    batch, equal to one process's computation over all rows. The two halves' rewards spread
    differently (0/1 against 0/10), so a std from one process's rows would differ."""
    rng = np.random.default_rng(0)
    rewards = np.concatenate(
        [rng.integers(0, 2, 16), 10 * rng.integers(0, 2, 16)]  # rows 0-15, rows 16-31
    ).astype(np.float32)
    valid = np.ones(32, bool)
    valid[[3, 20]] = False  # unscored completions enter no statistic
    np.savez(tmp_path / "batch.npz", rewards=rewards, valid=valid)
    script = tmp_path / "advantages.py"
    script.write_text(ADVANTAGES_OF_ONE_PROCESS)
    settings = [*COMMON, "algorithm.scale=batch", "algorithm.std_ddof=1"]  # 8 x 4 = 32 rows
    _run_python([str(script), str(tmp_path), "{port}", "{process}", *settings])

    expected = jgrpo.group_advantages(
        rewards, np.arange(32) // 4, 8, valid=valid, scale="batch", std_ddof=1
    )
    blocks = [json.loads((tmp_path / f"process{p}.json").read_text()) for p in range(2)]
    assert sorted(tuple(block["rows"]) for block in blocks) == [(0, 16), (16, 32)]
    for block in blocks:
        first, stop = block["rows"]
        np.testing.assert_allclose(
            block["advantages"], np.asarray(expected)[first:stop], rtol=1e-6, atol=1e-7
        )
    one_half = jgrpo.group_advantages(
        rewards[:16], np.arange(16) // 4, 4, valid=valid[:16], scale="batch", std_ddof=1
    )
    assert np.abs(np.asarray(one_half) - np.asarray(expected)[:16]).max() > 0.5  # it matters


def test_a_run_directory_that_is_not_shared_stops_every_process(tmp_path):
    results = _run_processes([*COMMON, f"train.run_dir={tmp_path}/host{{process}}"], check=False)
    for code, output in results:
        assert code != 0
        assert "is not the same directory on every host" in output, _tail(output)


def test_one_process_holds_every_row():
    """With one process, the row block is the whole batch and gathering changes nothing."""
    mesh = make_mesh((2, 2, 2))
    rows, matrix = row_shardings(mesh)
    block = distributed.RowBlock(rows)
    assert (block.parts, block.first, block.stop) == (4, 0, 4)
    assert block.bounds(8) == (0, 8)
    values = np.arange(16, dtype=np.int32).reshape(8, 2)
    array = block.to_global(values, matrix)
    assert array.sharding == matrix and array.shape == (8, 2)
    np.testing.assert_array_equal(block.local(array), values)
    np.testing.assert_array_equal(block.gather(values[:, 0]), values[:, 0])
    assert distributed.agree_any(True) and not distributed.agree_all(False)
    assert distributed.agree_max(3) == 3 and distributed.agree_max_each([3, 1]) == [3, 1]
    with pytest.raises(ValueError, match="equal parts"):
        block.bounds(6)


def test_initialize_after_jax_started():
    """In a running process (a test, a notebook) auto mode stays single-process; asking for
    more is an error that says why."""
    assert distributed.initialize("auto") is False
    assert distributed.initialize("never") is False
    with pytest.raises(distributed.DistributedError, match="before JAX uses any device"):
        distributed.initialize("always")
    with pytest.raises(distributed.DistributedError, match="before JAX uses any device"):
        distributed.initialize(num_processes=2, process_id=0)
    with pytest.raises(distributed.DistributedError, match="distributed.initialize"):
        distributed.initialize("sometimes")


@pytest.mark.parametrize(
    "override, message",
    [
        ("distributed.initialize=true", "distributed.initialize must be str"),
        ("distributed.initialize=sometimes", "distributed.initialize must be one of"),
        ("distributed.num_processes=0", "distributed.num_processes must be >= 1"),
        ("distributed.process_id=2", r"distributed.process_id must be in .* = \[0, 2\)"),
    ],
)
def test_distributed_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["distributed.num_processes=2", override])
