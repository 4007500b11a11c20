"""Every command the docs show is run, at tiny scale, so the docs cannot rot.

Commands come from the ```bash blocks and the inline `python ...` spans of README.md, docs/*.md
and colab/README.md. Each one is checked by the rule for its program:
- `python -m jgrpo.train|plan|generate ...` runs in this process with the documented arguments
  plus the `smoke` settings (a tiny model from scratch, 2 steps) and a throwaway run directory;
- `python scripts/*.py ...` runs as a subprocess with its size flags shrunk;
- set-up lines (venv, pip, pytest) must be what .ci/run itself does;
- the few commands that need several processes or the full demo name the test that runs them.
A command no rule knows fails the test, so a new doc command needs a rule here. The python
blocks of the docs pages (not the API signatures of objective.md and api.md) are executed too.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile
import tomllib

import pytest
from tiny_hf import save_char_checkpoint
from xla_flags import xla_flags

from jgrpo import plan as plan_module
from jgrpo import train as train_module
from jgrpo.config import SMOKE_OVERRIDES, load_config
from jgrpo.generation import main as generate_main
from jgrpo.metrics import read_metrics

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *(ROOT / "colab").glob("*.md")]
PYTHON_PAGES = ["docs/recipes.md", "docs/training.md", "docs/troubleshooting.md"]
CI = (ROOT / ".ci" / "run").read_text()

# Commands run in full by another test (name it, so a renamed test fails here).
ELSEWHERE = {
    "python -m jgrpo.train": "tests/test_train.py::test_the_demo_learns_addition_from_scratch",
    "python scripts/quickstart.py": "tests/test_package.py::test_quickstart_script_runs",
    "python scripts/reference_docs.py": (
        "tests/test_reference_docs.py::test_committed_files_are_current"
    ),
    "multi-process": (
        "tests/test_multihost.py::test_two_processes_train_like_one_and_restore_on_another_mesh"
    ),
}
# Tiny runs that another test already makes, with more assertions (keyed like _check_train).
RUNS_ELSEWHERE = {
    ("train", "configs/gsm8k-qwen2.5-0.5b.yaml"): (
        "tests/test_recipes.py::test_gsm8k_recipe_runs_on_local_rows"
    ),
    ("train", "configs/json-extraction-qwen2.5-0.5b.yaml"): (
        "tests/test_recipes.py::test_json_extraction_recipe_logs_every_reward_component"
    ),
    ("train", "configs/tool-demo.yaml"): (
        "tests/test_recipes.py::test_the_multi_turn_demo_recipe_runs_episodes"
    ),
    ("train", "configs/gsm8k-tools-qwen2.5-0.5b.yaml"): (
        "tests/test_recipes.py::test_the_gsm8k_tools_recipe_runs_episodes_with_the_python_tool"
    ),
    ("train", "configs/gsm8k-gemma3-1b.yaml"): (
        "tests/test_recipes.py::test_the_gemma3_recipe_trains_and_exports_a_gemma3_checkpoint"
    ),
    ("train", "configs/gsm8k-qwen3-30b-a3b.yaml"): (
        "tests/test_recipes.py::test_the_qwen3_moe_recipe_trains_a_mixture_of_experts"
    ),
    # the demo's settings on fsdp=4 x tensor=2, as scaling.md's command runs them
    ("train", None, "sharded"): (
        "tests/test_sharding.py::test_training_on_a_mesh_matches_one_device_and_keeps_the_placement"
    ),
    ("plan", "configs/gsm8k-qwen3-30b-a3b.yaml"): (
        "tests/test_moe.py::test_the_plan_counts_every_experts_weights"
    ),
}
# Inline mentions of a program whose full commands are shown elsewhere in the docs.
MENTIONS = {"python -m jgrpo.generate"}
# Size flags of the benchmark scripts: tiny shapes, one repeat.
TINY_FLAGS = {
    "--preset": "tiny",
    "--repeats": "1",
    "--steps": "1",
    "--warmup-steps": "1",
    "--batch": "1",
    "--length": "8",
    "--prompts": "2",
    "--generations": "2",
    "--new-tokens": "4",
    "--prompt-length": "8",
    "--prefill-length": "8",
    "--rows-per-device": "2",
    "--prompt-tokens": "8",
    "--devices": "1,2",
    "--model": "tiny",
    "--workdir": "compare",
    "--calls": "1",
}
# Flags naming the peers' own environments (benchmark.py compare): jgrpo alone runs here.
PEER_FLAGS = ("--trl-python", "--tunix-python")
# Placeholders in the docs' commands and what stands in for them.
PLACEHOLDERS = {"CONFIG": "configs/demo.yaml", "RUN_DIR": "runs/tiny", "OUT_DIR": "exported"}


def _continued(lines: list[str]) -> list[str]:
    """Joins backslash continuations, and `for ... done` loops into one command."""
    commands, current = [], ""
    for line in lines:
        stripped = line.strip()
        if not stripped or (stripped.startswith("#") and not current):
            continue
        current = f"{current} {stripped}" if current else stripped
        if current.endswith("\\"):
            current = current[:-1].rstrip()
        elif not (current.startswith("for ") and "done" not in current):
            commands.append(re.sub(r"\s+#\s.*$", "", current).strip())  # trailing comment
            current = ""
    return commands


def doc_commands() -> dict[str, str]:
    """Every command shown in the docs -> the page it was first seen on."""
    found: dict[str, str] = {}
    for page in PAGES:
        text = page.read_text()
        name = str(page.relative_to(ROOT))
        commands = [
            command
            for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
            for command in _continued(block.splitlines())
        ]
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        commands += re.findall(r"`(python3? (?:-m |scripts/)[^`\s]+[^`]*)`", prose)
        for command in commands:
            # Usage lines: [optional] parts and "..." are left out, line breaks are spaces.
            command = re.sub(r"\s*\[[^\]]*\]|\s+\.\.\.(?=\s|$)", "", command)
            found.setdefault(" ".join(command.split()), name)
    return found


def _test_exists(node: str) -> None:
    path, name = node.split("::")
    module = importlib.import_module(pathlib.Path(path).stem)
    assert callable(getattr(module, name, None)), f"{node} does not exist any more"


def _set_flags(args: list[str], flags: dict[str, str]) -> list[str]:
    """The documented flags with the given ones replaced or added."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        else:
            out.append(arg)
    for flag, value in flags.items():
        out += [flag, value]
    return out


def _split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


def _tiny_training(overrides: list[str], run_dir: str, config: str | None = None) -> list[str]:
    """The documented overrides, shrunk: smoke first, the doc's keys, then what keeps it tiny
    (GSM8K from the local rows when the doc gives no data path)."""
    mesh = any(o.startswith("mesh.") for o in overrides)
    local_rows = "gsm8k" in str(config) and not any(o.startswith("task.path=") for o in overrides)
    return [
        *SMOKE_OVERRIDES,
        *(o for o in overrides if o != "smoke"),
        "model.path=null",
        "model.preset=tiny",
        "rollout.max_new_tokens=8",
        "train.steps=2",
        "train.eval_every=2",
        "train.save_every=2",
        "train.progress=false",
        f"train.run_dir={run_dir}",
        *(["mesh.devices=-1"] if mesh else []),
        *(["task.path=tests/data/gsm8k"] if local_rows else []),
        # One token per character: the demo's prompts are 5, GSM8K's chat prompts under 512.
        f"rollout.max_prompt_length={8 if config in (None, 'configs/demo.yaml') else 512}",
        f"rollout.prompts_per_step={8 if mesh else 2}",
    ]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A scratch directory where the docs' relative paths resolve: configs/ and tests/ from the
    repository, my_problems.jsonl (recipes), and a finished tiny run in runs/tiny."""
    for name in ("configs", "tests", "scripts"):
        (tmp_path / name).symlink_to(ROOT / name)
    rows = (ROOT / "tests" / "data" / "gsm8k" / "train.jsonl").read_text()
    (tmp_path / "my_problems.jsonl").write_text(rows)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _tiny_run(workdir) -> pathlib.Path:
    run_dir = workdir / "runs" / "tiny"
    code = train_module.main(["configs/demo.yaml", *_tiny_training([], str(run_dir))])
    assert code == 0
    return run_dir


def _train_args(args: list[str]) -> tuple[str | None, list[str], list[str]]:
    """(config path, overrides, --budget-gib flag) of a train or plan command line."""
    budget: list[str] = []
    if "--budget-gib" in args:
        at = args.index("--budget-gib")
        budget, args = args[at : at + 2], args[:at] + args[at + 2 :]
    path, overrides = train_module.parse_args(args)
    return path, [o.replace("$i", "0") for o in overrides], budget


def _run_key(overrides: list[str]) -> tuple[str, ...]:
    """What changes what a tiny run exercises (the data, the rewards, a mesh of several
    devices); commands that differ only in sizes or the learning rate share one tiny run."""
    task = [o for o in overrides if o.startswith("task.") and o != "task.path=tests/data/gsm8k"]
    sharded = any(o.startswith("mesh.") and o.split("=")[1] not in ("1", "-1") for o in overrides)
    return (*sorted(task), *(["sharded"] if sharded else []))


def _check_train(args: list[str], workdir, capsys, run: bool) -> tuple | None:
    if args == ["--help"]:
        if run:
            assert train_module.main(args) == 0
            assert "rollout.num_generations" in capsys.readouterr().out
        return ("train --help",)
    if not args:
        return _test_exists(ELSEWHERE["python -m jgrpo.train"])
    path, overrides, _ = _train_args(args)
    load_config(path, overrides)  # the command as written: keys and values are valid
    if any(o.startswith("distributed.") for o in overrides):
        return _test_exists(ELSEWHERE["multi-process"])  # several processes: test_multihost
    run_dir = workdir / "run"
    if path == "configs/demo.yaml":
        # Each demo command resumes a run: troubleshooting.md says a rerun continues from the
        # last checkpoint with the new overrides applied (e.g. a lower lr after a NaN).
        if run:
            assert train_module.main([path, *_tiny_training([], str(run_dir), path)]) == 0
            tiny = [*_tiny_training(overrides, str(run_dir), path), "train.steps=3"]
            assert train_module.main([path, *tiny]) == 0
            lines = read_metrics(run_dir)
            assert [line["step"] for line in lines] == [1, 2, 3]
            optim = load_config(path, tiny).optim  # the override's lr, on its schedule:
            decay = (1 + math.cos(math.pi * 2 / 3)) / 2 if optim.schedule == "cosine" else 1.0
            assert lines[-1]["lr"] == pytest.approx(optim.lr * decay)  # step 3 of 3
        return ("train resumes", path, *sorted(overrides))
    key = ("train", path, *_run_key(overrides))
    if path is not None:  # the demo's run covers sharding; a recipe's covers its data
        key = tuple(k for k in key if k != "sharded")
    if key in RUNS_ELSEWHERE:
        return _test_exists(RUNS_ELSEWHERE[key])
    if run:
        argv = [path] if path else []
        assert train_module.main([*argv, *_tiny_training(overrides, str(run_dir), path)]) == 0
        assert [line["step"] for line in read_metrics(run_dir)] == [1, 2]
    return key


def _check_plan(args: list[str], workdir, capsys, run: bool) -> tuple:
    path, overrides, budget = _train_args(args)
    load_config(path, overrides)
    # One plan per config: tests/test_plan.py plans sharded meshes.
    key = ("plan", path, *(k for k in _run_key(overrides) if k != "sharded"))
    if key in RUNS_ELSEWHERE:
        return _test_exists(RUNS_ELSEWHERE[key])
    if run:
        tiny = _tiny_training(overrides, str(workdir / "run"), path)
        assert plan_module.main([*([path] if path else []), *tiny, *budget]) == 0
        assert "peak" in capsys.readouterr().out
    return key


def _check_generate(args: list[str], workdir, capsys, run: bool) -> tuple:
    if not run:
        return ("generate",)
    checkpoint = save_char_checkpoint(workdir / "checkpoint")
    generate_main(_set_flags(args, {"--model": str(checkpoint), "--max-new-tokens": "4"}))
    out = capsys.readouterr().out
    prompts = args.count("--prompt")
    generations = (
        int(args[args.index("--num-generations") + 1]) if "--num-generations" in args else 1
    )
    assert out.count("=== prompt") == prompts
    assert out.count("--- generation") == prompts * generations
    return ("generate",)


def _check_script(script: str, args: list[str], workdir, run: bool) -> tuple | None:
    if f"python {script}" in ELSEWHERE:
        return _test_exists(ELSEWHERE[f"python {script}"])
    args = [PLACEHOLDERS.get(a, a) for a in args]
    source = ROOT / script
    if script == "scripts/benchmark.py" and args[0] != "step":
        source = ROOT / "scripts" / f"benchmark_{args[0]}.py"  # the mode's own script
    known = set(re.findall(r'"(--[a-z0-9-]+)"', source.read_text()))
    unknown = {a for a in args if a.startswith("--")} - known
    assert not unknown, f"{script} has no flag {unknown}"
    key = ("script", script, *args[:1])  # one tiny run per script and mode
    if not run:
        return key
    if script.startswith("scripts/benchmark"):
        for flag in PEER_FLAGS:
            if flag in args:
                del args[args.index(flag) : args.index(flag) + 2]
        args = _set_flags(args, {f: v for f, v in TINY_FLAGS.items() if f in known})
        if "memory" in args:  # trains the config: keep it tiny
            args += [o for o in _tiny_training([], "unused") if "run_dir" not in o]
    if "runs/tiny" in args:
        _tiny_run(workdir)
    env = {**os.environ, "XLA_FLAGS": xla_flags()}  # one device, as users run
    result = subprocess.run(
        [sys.executable, script, *args], capture_output=True, text=True, cwd=workdir, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    if "plot_metrics" in script:
        assert (workdir / "runs" / "tiny" / "metrics.png").stat().st_size > 0
    if "export_checkpoint" in script:
        assert json.loads((workdir / "exported" / "config.json").read_text())["vocab_size"] > 0
    return key


def _check_peer_setup(words: list[str]) -> None:
    """A peer's own environment for `benchmark.py compare`: never the project's, and the one
    torch whose CPU wheel CI uses (any other torch pulls a CUDA build)."""
    if words[:3] == ["python3", "-m", "venv"]:
        return
    assert words[0].endswith("/bin/pip") and words[1] == "install", words
    assert "torch==2.13.0" in words, words
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for package in words[2:]:
        name = re.split(r"[=<>]", package)[0]
        assert name not in (".", "jgrpo"), "a peer environment must not hold jgrpo"
        if name not in ("torch", "transformers"):  # peers' own packages: never ours
            assert not any(d.startswith(name) for d in dependencies["dependencies"]), name


def _check_setup(command: str) -> None:
    """`python3 -m venv ... && pip install ... && python -m ...`: what .ci/run does."""
    for part in (p.strip() for p in command.split("&&")):
        words = shlex.split(part)
        if "/peers/" in part:
            _check_peer_setup(words)
        elif part.startswith("python3 -m venv") or part.startswith(". "):
            assert "-m venv" in CI and "activate" in CI
        elif words[:3] == ["pip", "install", "-e"]:  # the package; CI adds the test extra
            assert words[3] in (".", ".[test]") and 'pip install --quiet -e ".[test]"' in CI
        elif words[:2] == ["pip", "install"]:
            assert f"pip install --quiet {' '.join(words[2:])}" in CI, part
        elif words[:3] == ["python", "-m", "pytest"]:
            assert part in CI, f"{part!r} is not the test command .ci/run runs"
        elif part == "python -m jgrpo.train":
            _test_exists(ELSEWHERE[part])
        else:
            raise AssertionError(f"no rule for the set-up step {part!r}")


def check_command(command: str, workdir, capsys, run: bool = False) -> tuple | None:
    """Checks what can be checked at once (the config as written, the set-up steps, the
    tests named for it); with `run`, runs the command at tiny scale. Returns the key of its
    tiny run (None: nothing to run here), so that equal tiny runs happen once."""
    if "&&" in command and ("venv" in command or "pip install" in command):
        return _check_setup(command)
    if command in MENTIONS:
        return None
    if command.startswith("for "):  # several processes on one machine
        inner = re.search(r"do (.*?)& done", command).group(1)
        return check_command(inner.strip(), workdir, capsys, run)
    if command.startswith("gcloud "):  # the command every worker of a TPU slice runs
        inner = re.search(r'--command="(?:cd \S+ && )?(.*)"', command).group(1)
        return check_command(inner, workdir, capsys, run)
    env, words = _split_env(shlex.split(command))
    if "XLA_FLAGS" in env and "distributed." not in command:  # conftest gives the same 8
        assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    if words[:3] == ["python", "-m", "jgrpo.train"]:
        return _check_train(words[3:], workdir, capsys, run)
    if words[:3] == ["python", "-m", "jgrpo.plan"]:
        return _check_plan(words[3:], workdir, capsys, run)
    if words[:3] == ["python", "-m", "jgrpo.generate"]:
        return _check_generate(words[3:], workdir, capsys, run)
    if words[:3] == ["python", "-m", "pytest"]:
        assert command in CI, f"{command!r} is not the test command .ci/run runs"
        return None
    if words[0] == "python" and words[1].startswith("scripts/"):
        return _check_script(words[1], words[2:], workdir, run)
    raise AssertionError(f"no rule runs the documented command {command!r}: add one here")


COMMANDS = doc_commands()


def _tiny_runs() -> dict[tuple, str]:
    """One documented command per distinct tiny run."""
    runs: dict[tuple, str] = {}
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as scratch:
        for name in ("configs", "tests", "scripts"):
            (pathlib.Path(scratch) / name).symlink_to(ROOT / name)
        os.chdir(scratch)
        try:
            for command in sorted(COMMANDS):
                try:
                    key = check_command(command, pathlib.Path(scratch), None)
                except Exception:  # reported by test_documented_command_is_valid
                    continue
                if key is not None:
                    runs.setdefault(key, command)
        finally:
            os.chdir(here)
    return runs


@pytest.mark.parametrize("command", sorted(COMMANDS), ids=lambda c: c[:80])
def test_documented_command_is_valid(command, workdir, capsys):
    """The config as written loads, set-up steps are CI's, named tests exist, a rule knows it."""
    check_command(command, workdir, capsys)


@pytest.mark.parametrize("command", sorted(_tiny_runs().values()), ids=lambda c: c[:80])
def test_documented_command_runs(command, workdir, capsys):
    check_command(command, workdir, capsys, run=True)


def test_the_docs_show_the_commands_users_need():
    """The extraction finds what it should (a broken regex must not make the test vacuous)."""
    assert "python -m jgrpo.train --help" in COMMANDS
    assert "python -m jgrpo.train configs/json-extraction-qwen2.5-0.5b.yaml smoke" in COMMANDS
    assert any(c.startswith("gcloud compute tpus tpu-vm ssh") for c in COMMANDS)
    assert any(c.startswith("for i in 0 1; do") for c in COMMANDS)
    assert len(COMMANDS) >= 25


def _python_blocks() -> list[tuple[str, int]]:
    return [
        (page, index)
        for page in PYTHON_PAGES
        for index, _ in enumerate(
            re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S)
        )
    ]


@pytest.mark.parametrize("page,index", _python_blocks())
def test_documented_python_block_runs(page, index, workdir):
    block = re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S)[index]
    exec(compile(block, f"{page} block {index}", "exec"), {"__name__": "docs"})
