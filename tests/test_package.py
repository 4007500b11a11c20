"""The package as users meet it: public names, the README and library examples, the quickstart,
the layout."""

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
from xla_flags import xla_flags

import jgrpo

ROOT = pathlib.Path(__file__).resolve().parent.parent
PUBLIC = [
    "group_advantages",
    "group_statistics",
    "zero_signal_groups",
    "grpo_loss",
    "token_kl",
    "sequence_kl",
    "token_logprobs",
    "chunked_token_logprobs",
]


def test_conftest_forces_eight_cpu_devices():
    assert jax.device_count() == 8


def test_public_api_is_exported():
    for name in PUBLIC:
        assert callable(getattr(jgrpo, name)), name
        assert name in jgrpo.__all__


def test_pure_objective_does_not_import_flax():
    """Other JAX codebases import the objective without pulling in the model stack."""
    modules = "('flax', 'jgrpo.models')"
    code = f"import sys, jgrpo; print(sorted(m for m in {modules} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def python_block(first_line: str, page: str = "README.md") -> str:
    """The python block of `page` that starts with `first_line`."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S)
    (block,) = [b for b in blocks if b.startswith(first_line)]
    return block


def test_readme_custom_task_example_trains(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the example writes runs/zeros
    namespace = {}
    exec(compile(python_block("from jgrpo.config"), "README.md", "exec"), namespace)
    assert namespace["result"].steps_done == 2
    assert len((tmp_path / "runs" / "zeros" / "metrics.jsonl").read_text().splitlines()) == 2


def test_readme_objective_example_runs_and_its_comment_is_true():
    namespace = {}
    exec(compile(python_block("import jax\n"), "README.md", "exec"), namespace)
    np.testing.assert_allclose(
        namespace["advantages"], [-1.34, -0.45, 0.45, 1.34, -1.0, 1.0], atol=5e-3
    )
    assert np.isfinite(namespace["loss"])


def test_library_models_example_runs():
    namespace = {}
    block = python_block("import tempfile", "docs/library.md")
    exec(compile(block, "docs/library.md", "exec"), namespace)
    logits = np.asarray(namespace["logits"])
    assert logits.shape == (1, 4, 256)
    np.testing.assert_allclose(namespace["prefill_logits"], logits[:, :3], atol=1e-5)
    np.testing.assert_allclose(namespace["step_logits"], logits[:, 3:], atol=1e-5)
    assert namespace["reloaded"].layers.q_kernel[...].dtype == np.dtype("bfloat16")


def test_quickstart_script_runs():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "quickstart.py")],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert "advantages: [-1.34, -0.45, 0.45, 1.34, 0.0, 0.0, 0.0, 0.0]" in out.stdout
    assert "loss:" in out.stdout


def test_top_level_layout():
    for path in [
        "pyproject.toml",
        "README.md",
        "jgrpo",
        "models",
        "configs",
        "scripts",
        "tests",
        "colab",
        ".ci/run",
    ]:
        assert (ROOT / path).exists(), path


def test_a_models_package_of_the_users_own_neither_shadows_nor_is_shadowed(tmp_path):
    """The model code installs as `jgrpo.models`: the CLI run from a folder holding the user's
    own `models` package trains, and the user's package is the one `import models` finds."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("WHOSE = 'the user'\n")
    overrides = [
        "train.steps=1",
        "train.eval_every=0",
        "train.progress=false",
        "train.tensorboard=false",
        "rollout.prompts_per_step=2",
        "rollout.num_generations=2",
        "task.reward_workers=0",
        "mesh.devices=1",
        "train.run_dir=run",
    ]
    run = subprocess.run(
        [sys.executable, "-m", "jgrpo.train", *overrides],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "run" / "hf" / "config.json").exists()
    code = (
        "import jgrpo.models, models; print(models.WHOSE, jgrpo.models.preset('tiny').num_layers)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert out.stdout.split() == ["the", "user", "2"]


def run_bounded(command: list[str], cwd: pathlib.Path, timeout_s: float, stdin=None):
    """Runs `command` in a session of its own, killed with all its children after `timeout_s`,
    so a process that restarts its workers forever fails the test instead of hanging it."""
    env = {**os.environ, "XLA_FLAGS": xla_flags()}  # one device, as on a user's machine
    with subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as process:
        try:
            output, _ = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            raise AssertionError(f"{command} ran past {timeout_s} s:\n{output[-3000:]}") from None
    return process.returncode, output


def test_readme_custom_task_example_trains_as_a_script_file_and_from_stdin(tmp_path):
    """The example saved as a file, without a __main__ guard, reward workers on (the default):
    its reward function lives in __main__, which no worker can import without running the
    script, and train(), again; it runs in the training process. Both ways train once."""
    script = tmp_path / "example.py"
    script.write_text(python_block("from jgrpo.config"))
    metrics = tmp_path / "runs" / "zeros" / "metrics.jsonl"
    for command in ([sys.executable, str(script)], [sys.executable, "-"]):
        with script.open() as stdin:
            returncode, output = run_bounded(command, tmp_path, 300, stdin=stdin)
        assert returncode == 0, output[-3000:]
        assert "bootstrapping" not in output
        assert len(metrics.read_text().splitlines()) == 2
        shutil.rmtree(tmp_path / "runs")
