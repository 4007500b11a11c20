"""The Colab notebooks, executed top to bottom by a Jupyter kernel in their tiny mode.

Each notebook reads JGRPO_NOTEBOOK_TINY=1 and shrinks every size; the real-model notebook then
uses a tiny local checkpoint (JGRPO_NOTEBOOK_MODEL) and the local GSM8K rows of tests/data
(JGRPO_NOTEBOOK_DATA) instead of its downloads. A cell that raises fails the test; the tests
then check what the notebooks printed and wrote.
"""

import asyncio
import json
import os
import re
import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from tiny_hf import save_char_checkpoint

ROOT = Path(__file__).resolve().parent.parent
COLAB = ROOT / "colab"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The layout the notebooks expect (colab/ beside configs/), outside the repository so
    their runs/ folders land in a temporary directory, and a tiny HF checkpoint."""
    root = tmp_path_factory.mktemp("notebooks")
    (root / "colab").mkdir()
    shutil.copytree(ROOT / "configs", root / "configs")
    # A checkpoint the real-model notebook loads through model.path exactly like the real one:
    # a tiny random model whose vocabulary is a character tokenizer with a chat template.
    save_char_checkpoint(root / "tiny-checkpoint")
    return root


# Two kernels at a time (the machine has two cores): custom_loss after quickstart, whose
# compiled programs it reuses through the compilation cache, then gsm8k_qwen with its LoRA
# switch on, alongside gsm8k_qwen as committed.
LANES = [["quickstart.ipynb", "custom_loss.ipynb", "gsm8k_qwen.ipynb:lora"], ["gsm8k_qwen.ipynb"]]
# NAME:VARIANT runs NAME with one line of its code changed, as a user edits it.
VARIANTS = {"lora": ("USE_LORA = False", "USE_LORA = True")}


@pytest.fixture(scope="module")
def executed(workspace) -> dict[str, nbformat.NotebookNode | Exception]:
    """Each notebook run top to bottom (or the error a cell raised), with colab/ of the
    workspace as its directory. The kernels inherit this environment: the notebooks' tiny
    mode, and one CPU device as on a Colab CPU runtime (not the tests' 8; the compilation
    cache is kept)."""
    results = {}

    async def run(names):
        for name in names:
            file, _, variant = name.partition(":")
            notebook = nbformat.read(COLAB / file, as_version=4)
            if variant:
                line, edited = VARIANTS[variant]
                (cell,) = [cell for cell in notebook.cells if line in cell.source]
                cell.source = cell.source.replace(line, edited)
            client = NotebookClient(
                notebook,
                timeout=600,
                kernel_name="python3",
                resources={"metadata": {"path": str(workspace / "colab")}},
            )
            try:
                await client.async_execute()
                results[name] = notebook
            except Exception as error:  # noqa: BLE001 (reported by the notebook's test)
                results[name] = error

    async def run_all():
        await asyncio.gather(*(run(names) for names in LANES))

    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("XLA_FLAGS", flags.strip())
        env.setenv("JGRPO_NOTEBOOK_TINY", "1")
        env.setenv("JGRPO_NOTEBOOK_MODEL", str(workspace / "tiny-checkpoint"))
        env.setenv("JGRPO_NOTEBOOK_DATA", str(ROOT / "tests" / "data" / "gsm8k"))
        asyncio.run(run_all())
    return results


def executed_notebook(executed, name: str) -> nbformat.NotebookNode:
    result = executed[name]
    if isinstance(result, Exception):
        raise result
    return result


def stdout(notebook) -> str:
    return "".join(
        output["text"]
        for cell in notebook.cells
        for output in cell.get("outputs", [])
        if output["output_type"] == "stream" and output["name"] == "stdout"
    )


def images(notebook) -> int:
    return sum(
        "image/png" in output.get("data", {})
        for cell in notebook.cells
        for output in cell.get("outputs", [])
    )


def printed(pattern: str, text: str) -> list[float]:
    values = [float(value) for value in re.findall(pattern, text)]
    assert values, f"{pattern!r} not in the output:\n{text}"
    return values


def metric_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_committed_notebooks_are_valid_and_without_outputs():
    names = sorted(path.name for path in COLAB.glob("*.ipynb"))
    assert names == ["custom_loss.ipynb", "gsm8k_qwen.ipynb", "quickstart.ipynb"]
    for name in names:
        notebook = nbformat.read(COLAB / name, as_version=4)
        nbformat.validate(notebook)
        assert notebook.nbformat == 4
        for cell in notebook.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, name
        first_code = next(cell for cell in notebook.cells if cell.cell_type == "code")
        assert 'TINY = os.environ.get("JGRPO_NOTEBOOK_TINY") == "1"' in first_code.source


def test_quickstart(workspace, executed):
    notebook = executed_notebook(executed, "quickstart.ipynb")
    text = stdout(notebook)
    run_dir = workspace / "colab" / "runs" / "quickstart"
    lines = metric_lines(run_dir)
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    assert [line["step"] for line in lines if "eval/accuracy" in line] == [2, 4]
    (before,) = printed(r"accuracy before: ([\d.]+)", text)
    (after,) = printed(r"accuracy after: ([\d.]+)", text)
    assert 0 <= before <= 1 and 0 <= after <= 1
    assert after == round(lines[-1]["eval/accuracy"], 2)  # the trained parameters, again
    assert len(re.findall(r"'\d\+\d=' +-> ", text)) == 10  # 5 samples before, 5 after
    assert (run_dir / "metrics.png").read_bytes()[:8] == PNG_MAGIC
    assert images(notebook) == 1  # the figure shows in the notebook
    assert (run_dir / "hf" / "config.json").exists()


def test_custom_loss(workspace, executed):
    notebook = executed_notebook(executed, "custom_loss.ipynb")
    text = stdout(notebook)
    # Part 1, the user's own loop: the reward goes up from its random level (1 / V = 0.1).
    ((first, last),) = [
        tuple(map(float, pair))
        for pair in re.findall(r"first step ([\d.]+), last step ([\d.]+)", text)
    ]
    assert first < 0.2 and last > 0.5, (first, last)
    # Part 2, the user's reward function through jgrpo.train.train.
    lines = metric_lines(workspace / "colab" / "runs" / "count_up")
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    assert all("reward/counts_up/mean" in line for line in lines)
    ((before, after),) = re.findall(r"accuracy before: ([\d.]+)  after: ([\d.]+)", text)
    assert 0 <= float(before) <= 1 and float(after) == round(lines[-1]["eval/accuracy"], 2)
    assert len(re.findall(r"'\d=' -> '.*' reward", text)) == 3
    assert images(notebook) == 2


def test_gsm8k_qwen(workspace, executed):
    notebook = executed_notebook(executed, "gsm8k_qwen.ipynb")
    text = stdout(notebook)
    # The download cell took the local checkpoint instead.
    model_cell = next(cell for cell in notebook.cells if "snapshot_download(" in cell.source)
    (result,) = [o for o in model_cell.outputs if o["output_type"] == "execute_result"]
    assert result["data"]["text/plain"] == repr(str(workspace / "tiny-checkpoint"))
    (before,) = printed(r"accuracy before: ([\d.]+)  reward", text)
    ((before_again, after),) = re.findall(r"accuracy before: ([\d.]+)  after: ([\d.]+)", text)
    assert float(before_again) == before
    assert 0 <= before <= 1 and 0 <= float(after) <= 1
    run_dir = workspace / "colab" / "runs" / "gsm8k-qwen"
    lines = metric_lines(run_dir)
    assert [line["step"] for line in lines] == [1, 2]
    assert {"reward/correct/mean", "reward/format/mean", "reward/overlong/mean"} <= lines[-1].keys()
    assert float(after) == round(lines[-1]["eval/accuracy"], 3)
    assert (run_dir / "metrics.png").read_bytes()[:8] == PNG_MAGIC and images(notebook) == 1
    assert (run_dir / "hf" / "config.json").exists()


def test_gsm8k_qwen_with_lora(workspace, executed):
    """USE_LORA = True: the same cells train LoRA adapters (rank 16) in their own run
    directory, and the export holds the merged model and the PEFT adapter."""
    notebook = executed_notebook(executed, "gsm8k_qwen.ipynb:lora")
    text = stdout(notebook)
    ((before, after),) = re.findall(r"accuracy before: ([\d.]+)  after: ([\d.]+)", text)
    assert 0 <= float(before) <= 1 and 0 <= float(after) <= 1
    run_dir = workspace / "colab" / "runs" / "gsm8k-qwen-lora"
    lines = metric_lines(run_dir)
    assert [line["step"] for line in lines] == [1, 2]
    adapter = json.loads((run_dir / "hf_adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 16 and adapter["lora_alpha"] == 32
    assert (run_dir / "hf" / "config.json").exists()
