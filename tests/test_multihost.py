"""Several jax.distributed processes: two on localhost, 4 CPU devices each, train like one
process with 8 devices, and their checkpoint restores on another mesh."""

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
    port = _free_port()
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(devices),
        "JAX_PLATFORMS": "cpu",
    }
    common = [
        *overrides,
        f"distributed.coordinator_address=localhost:{port}",
        f"distributed.num_processes={count}",
    ]
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jgrpo.train",
                *(o.format(process=index) for o in common),
                f"distributed.process_id={index}",
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
