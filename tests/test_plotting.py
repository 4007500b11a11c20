"""jgrpo.plotting.plot_metrics, and scripts/plot_metrics.py (its command line) end to end."""

import math
import runpy
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from jgrpo.metrics import MetricsWriter, read_metrics
from jgrpo.plotting import panels, plot_metrics

SCRIPT = Path(__file__).parent.parent / "scripts" / "plot_metrics.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, steps: int = 20) -> None:
    with MetricsWriter(run_dir, tensorboard=False) as writer:
        for step in range(1, steps + 1):
            metrics = {
                "reward/mean": step / 20,
                "reward/std": 0.1,
                "reward/correct/mean": step / 40,
                "reward/correct/std": 0.2,
                "reward/format/mean": 1.0,
                "kl": 0.01 * step,
                "loss": math.nan if step == 5 else -0.1,
                "completion_len/mean": 100.0 + step,
                "clip_frac/low": 0.0,
                "clip_frac/high": 0.02,
            }
            if step % 5 == 0:
                metrics |= {"eval/reward": step / 25, "eval/accuracy": step / 30}
            writer.write(step, metrics)


def test_plot_metrics_returns_a_figure_with_one_panel_per_logged_group(tmp_path):
    write_run(tmp_path)
    fig = plot_metrics(tmp_path)
    assert isinstance(fig, Figure)
    shown = [ax for ax in fig.axes if ax.get_visible()]
    titles = [ax.get_title() for ax in shown]
    assert titles == [
        "reward",
        "reward per function",
        "eval",
        "KL to reference",
        "loss",
        "completion length (mean)",
        "clipped ratio (fraction)",
    ]
    reward_line = shown[0].get_lines()[0]
    assert list(reward_line.get_xdata()) == list(range(1, 21))
    assert reward_line.get_ydata()[-1] == pytest.approx(1.0)
    # Eval was logged every 5 steps: 4 points per curve. The NaN loss stays a gap (NaN).
    assert [len(line.get_xdata()) for line in shown[2].get_lines()] == [4, 4]
    assert math.isnan(shown[4].get_lines()[0].get_ydata()[4])
    assert not (tmp_path / "metrics.png").exists()  # written only when asked


def test_plot_metrics_takes_records_and_writes_a_png(tmp_path):
    write_run(tmp_path)
    out = tmp_path / "curves.png"
    fig = plot_metrics(read_metrics(tmp_path), out=out)
    assert len([ax for ax in fig.axes if ax.get_visible()]) == 7
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 10_000


def test_panels_follow_the_logged_keys():
    records = [
        {"step": 1, "reward/mean": 0.5, "reward/std": 0.1, "reward/b/mean": 1}
        | {"reward/a/mean": 0, "reward/a/std": 0, "clip_frac/low": 0, "clip_frac/dual": 0}
    ]
    assert panels(records) == [
        ("reward", ["reward/mean"]),
        ("reward per function", ["reward/a/mean", "reward/b/mean"]),
        ("clipped ratio (fraction)", ["clip_frac/low", "clip_frac/dual"]),
    ]


def test_plot_metrics_errors_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        plot_metrics(tmp_path / "missing")
    MetricsWriter(tmp_path, tensorboard=False).close()
    with pytest.raises(ValueError, match="empty"):
        plot_metrics(tmp_path)
    with pytest.raises(ValueError, match="none of the known metrics"):
        plot_metrics([{"step": 1, "something/else": 1.0}])


def test_the_script_writes_png(tmp_path, capsys):
    write_run(tmp_path)
    main = runpy.run_path(str(SCRIPT))["main"]
    out = main([str(tmp_path)])
    assert out == tmp_path / "metrics.png"
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 10_000
    assert f"wrote {out}" in capsys.readouterr().out

    custom = tmp_path / "elsewhere.png"
    assert main([str(tmp_path), "--out", str(custom)]) == custom
    assert custom.read_bytes()[:8] == PNG_MAGIC


def test_the_script_errors_clearly(tmp_path):
    main = runpy.run_path(str(SCRIPT))["main"]
    with pytest.raises(SystemExit, match="no metrics file"):
        main([str(tmp_path / "missing")])
    MetricsWriter(tmp_path, tensorboard=False).close()
    with pytest.raises(SystemExit, match="empty"):
        main([str(tmp_path)])
