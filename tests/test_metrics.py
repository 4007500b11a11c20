"""MetricsWriter / read_metrics / ProgressBar (the plots: tests/test_plotting.py)."""

import json
import struct
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from jgrpo.metrics import MetricsWriter, ProgressBar, read_metrics


def tensorboard_events(run_dir: Path) -> list[event_pb2.Event]:
    """Every event in run_dir/tensorboard, file by file (TFRecord: length, crc, data, crc)."""
    events = []
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            record = data[offset + 12 : offset + 12 + length]
            events.append(event_pb2.Event.FromString(record))
            offset += 12 + length + 4
    return events


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of the scalar summaries written under run_dir/tensorboard."""
    scalars = {}
    for event in tensorboard_events(run_dir):
        for value in event.summary.value:
            scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def write_steps(run_dir, steps, **kwargs):
    with MetricsWriter(run_dir, **kwargs) as writer:
        for step in steps:
            writer.write(step, {"reward/mean": step / 10, "kl": 0.5 * step})


def test_lines_round_trip_exactly(tmp_path):
    logged = [
        {"reward/mean": 0.1, "kl": 1e-7, "loss": -3.25, "num_tokens": 1234},
        {"reward/mean": 2 / 3, "kl": 123456.789, "loss": 0.0, "num_tokens": 0},
    ]
    with MetricsWriter(tmp_path / "run", tensorboard=False) as writer:
        for step, metrics in enumerate(logged, start=1):
            writer.write(step, metrics)
    assert read_metrics(tmp_path / "run") == [
        {"step": step, **metrics} for step, metrics in enumerate(logged, start=1)
    ]
    assert not (tmp_path / "run" / "tensorboard").exists()


def test_numpy_and_jax_scalars_become_python_numbers(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.write(
            np.int64(3),
            {
                "np_f32": np.float32(0.5),
                "np_0d": np.array(2.25),
                "np_int": np.int32(7),
                "jax_f32": jnp.float32(1.5),
                "jax_int": jnp.array(4, jnp.int32),
                "jax_bool": jnp.array(True),
            },
        )
    line = (tmp_path / "metrics.jsonl").read_text()
    record = json.loads(line)
    assert record == {
        "step": 3,
        "np_f32": 0.5,
        "np_0d": 2.25,
        "np_int": 7,
        "jax_f32": 1.5,
        "jax_int": 4,
        "jax_bool": True,
    }
    assert type(record["np_int"]) is int and type(record["jax_f32"]) is float


def test_non_finite_written_as_null(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.write(1, {"loss": float("nan"), "kl": np.float32("inf"), "entropy": -jnp.inf})
        writer.write(2, {"loss": 1.0, "kl": 0.25, "entropy": 3.0})
    first_line = (tmp_path / "metrics.jsonl").read_text().splitlines()[0]
    assert "NaN" not in first_line and "Infinity" not in first_line
    assert json.loads(first_line) == {"step": 1, "loss": None, "kl": None, "entropy": None}
    # TensorBoard gets only the finite values.
    assert tensorboard_scalars(tmp_path) == {
        "loss": [(2, 1.0)],
        "kl": [(2, 0.25)],
        "entropy": [(2, 3.0)],
    }


def test_rejects_arrays_and_a_step_metric(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        with pytest.raises(ValueError, match="scalars"):
            writer.write(1, {"reward/mean": np.zeros(3)})
        with pytest.raises(ValueError, match="reserved"):
            writer.write(1, {"step": 1})


def test_line_is_on_disk_before_close(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.write(1, {"loss": 0.5})
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 0.5}]
    writer.close()


def test_resume_drops_later_steps_and_keeps_earlier_ones_exactly(tmp_path):
    write_steps(tmp_path, range(1, 8), tensorboard=False)  # killed after step 7
    before = (tmp_path / "metrics.jsonl").read_text().splitlines()

    # The last checkpoint was at step 4: steps 5.. run again.
    with MetricsWriter(tmp_path, resume_step=4, tensorboard=False) as writer:
        assert (tmp_path / "metrics.jsonl").read_text().splitlines() == before[:4]
        for step in range(5, 10):
            writer.write(step, {"reward/mean": -1.0, "kl": 0.0})

    records = read_metrics(tmp_path)
    assert [record["step"] for record in records] == list(range(1, 10))
    assert records[:4] == [json.loads(line) for line in before[:4]]
    assert all(record["reward/mean"] == -1.0 for record in records[4:])


def test_resume_skips_a_torn_last_line(tmp_path):
    write_steps(tmp_path, [1, 2], tensorboard=False)
    with (tmp_path / "metrics.jsonl").open("a") as file:
        file.write('{"step": 3, "reward/me')  # killed mid-write
    assert [record["step"] for record in read_metrics(tmp_path)] == [1, 2]
    MetricsWriter(tmp_path, resume_step=5, tensorboard=False).close()
    assert [record["step"] for record in read_metrics(tmp_path)] == [1, 2]


def test_resume_without_a_file_starts_empty(tmp_path):
    with MetricsWriter(tmp_path / "new", resume_step=3, tensorboard=False) as writer:
        writer.write(4, {"loss": 1.0})
    assert read_metrics(tmp_path / "new") == [{"step": 4, "loss": 1.0}]


def test_new_run_truncates(tmp_path):
    write_steps(tmp_path, range(1, 5), tensorboard=False)
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        assert (tmp_path / "metrics.jsonl").read_text() == ""
        writer.write(1, {"loss": 2.0})
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}]


def test_tensorboard_scalars(tmp_path):
    write_steps(tmp_path, [1, 2, 3])
    scalars = tensorboard_scalars(tmp_path)
    # TensorBoard stores float32.
    assert scalars["reward/mean"] == [(step, pytest.approx(step / 10)) for step in (1, 2, 3)]
    assert scalars["kl"] == [(1, 0.5), (2, 1.0), (3, 1.5)]


def test_tensorboard_purges_redone_steps(tmp_path):
    """A new run purges every earlier event; a resumed one purges the steps it re-does."""
    write_steps(tmp_path, [1, 2, 3])
    write_steps(tmp_path, [3], resume_step=2)
    starts = [
        event.step
        for event in tensorboard_events(tmp_path)
        if event.session_log.status == event_pb2.SessionLog.START
    ]
    assert starts == [0, 3]
    # Both event files survive the quick restart (tensorboardX names files by the second).
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2


def test_progress_bar_disabled_prints_nothing(capsys):
    bar = ProgressBar(10, enabled=False)
    bar.update(1, {"reward/mean": 0.5, "kl": 0.01})
    bar.close()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_progress_bar_shows_metrics(capsys):
    bar = ProgressBar(10, initial_step=2)
    bar.update(3, {"reward/mean": np.float32(0.123456), "kl": jnp.float32(0.00012345)})
    bar.update(4, {"reward/mean": 0.654321, "kl": 2.0, "eval/accuracy": 0.75, "loss": 9.0})
    bar.close()
    final = capsys.readouterr().err.split("\r")[-1]  # tqdm redraws the line after each "\r"
    assert "4/10" in final
    assert "reward=0.654" in final and "kl=2" in final and "eval_acc=0.75" in final
    assert "loss" not in final
