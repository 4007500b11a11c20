"""docs/config.md and docs/api.md are exactly what scripts/reference_docs.py writes now."""

import difflib
import importlib.util
import pathlib
import sys

import pytest

import jgrpo
from jgrpo import models

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIX = "run `python scripts/reference_docs.py` and commit the result"


@pytest.fixture(scope="module")
def generator():
    path = ROOT / "scripts" / "reference_docs.py"
    spec = importlib.util.spec_from_file_location("reference_docs", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generated(generator):
    return generator.generated()


def test_committed_files_are_current(generated):
    for path, text in generated.items():
        committed = (ROOT / path).read_text() if (ROOT / path).exists() else ""
        diff = difflib.unified_diff(
            committed.splitlines(), text.splitlines(), "committed", "generated", lineterm=""
        )
        shown = "\n".join(list(diff)[:30])
        assert committed == text, f"{path} is stale: {FIX}.\n{shown}"


def test_every_public_name_is_documented(generator, generated):
    api = generated[pathlib.Path("docs/api.md")]
    names = [f"jgrpo.{n}" for n in jgrpo.__all__] + [f"jgrpo.models.{n}" for n in models.__all__]
    for name in names:
        assert name in generator.documented_names(), f"add {name} to API in the generator"
        assert f"### `{name}`" in api, name
    committed = (ROOT / "docs" / "api.md").read_text()
    missing = [n for n in jgrpo.__all__ if f"jgrpo.{n}" not in committed]
    assert not missing, f"docs/api.md lacks {missing}: {FIX}."


def test_generated_text_is_deterministic(generator, generated):
    for path, text in generated.items():
        assert " at 0x" not in text and str(ROOT) not in text, path
    assert generator.generated() == generated


def test_check_names_the_stale_file_and_the_fix(
    generator, generated, tmp_path, monkeypatch, capsys
):
    for path, text in generated.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    monkeypatch.setattr(generator, "ROOT", tmp_path)
    assert generator.main(["--check"]) == 0
    (tmp_path / "docs" / "api.md").write_text("old\n")
    assert generator.main(["--check"]) == 1
    message = capsys.readouterr().err
    assert "docs/api.md is stale" in message and "python scripts/reference_docs.py" in message
    assert "config.md" not in message
