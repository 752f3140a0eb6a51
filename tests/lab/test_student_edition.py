"""Predictions that are real: a student edition ships the session's notebooks without their outputs (the
teacher's copy keeps them) as a git repository of one commit, and no text above a prediction gives its answer."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import nbformat
import pytest

from hicache_lab.lab.teach.edition import AUTHOR, CLEARED, make_edition

ROOT = Path(__file__).resolve().parents[2]
TEACHERS = (ROOT / "teaching").is_dir()  # not a student edition
PROMPT = re.compile(r"predict, then run|write down your answers", re.I)
CHECKED = "<summary>Your predictions, checked"


def git(where: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, check=True).stdout.strip()


def outputs(nb) -> list[dict]:
    return [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]


def test_a_student_edition_is_one_commit_with_the_paths_notebooks_cleared(tmp_path, monkeypatch):
    """Committed by the edition's own author where no git identity is configured (no HOME, no global or system
    config, no identity in the environment)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "no-gitconfig"))
    for name in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL", "EMAIL"):
        monkeypatch.delenv(name, raising=False)
    edition = tmp_path / "edition"
    files = make_edition(edition)
    assert git(edition, "rev-list", "--count", "HEAD") == "1"
    assert git(edition, "status", "--porcelain") == "", "the edition as written is its commit"
    assert len(git(edition, "ls-files").splitlines()) == len(files)
    name, email = (setting.split("=", 1)[1] for setting in AUTHOR[1::2])
    assert git(edition, "log", "--format=%an <%ae>") == f"{name} <{email}>"
    for path in CLEARED:
        nb = nbformat.read(edition / path, as_version=4)
        code = [cell for cell in nb.cells if cell.cell_type == "code"]
        assert code and not outputs(nb), f"{path} ships with outputs"
        assert all(cell.execution_count is None and "execution" not in cell.metadata for cell in code), path
        assert "IN_CLASS = False" not in nb.cells[1].source, f"{path} is not set for class"
        if TEACHERS:
            assert outputs(nbformat.read(ROOT / path, as_version=4)), f"the teacher's {path} keeps its outputs"
    assert "IN_CLASS = True" in nbformat.read(edition / CLEARED[1], as_version=4).cells[1].source


def answers_above_predictions(nb) -> list[str]:
    """What markdown above a prediction tells of its answer: an error the notebook's runs print, above its first
    prediction; a percentage a prediction's checked answer quotes, above that prediction."""
    printed = "\n".join(str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", "")) for o in outputs(nb))
    errors = {m.strip() for m in re.findall(r"\b\w+Error: ([^\n(]+)", printed)}
    prompts = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "markdown" and PROMPT.search(cell.source)]
    told = []
    for i in prompts:
        above = "\n".join(c.source for c in nb.cells[:i] if c.cell_type == "markdown")
        checked = next((c.source for c in nb.cells[i:] if CHECKED in c.source), "").split(CHECKED, 1)[-1]
        answers = set(re.findall(r"\d+\.\d+%", checked)) | (errors if i == prompts[0] else set())
        told += [f"cell {i}: {a!r}" for a in answers if re.search(re.sub(r"\d+", r"\\d+", re.escape(a)), above)]
    return told


@pytest.mark.skipif(not TEACHERS, reason="a student edition: its notebooks print nothing until they are run")
@pytest.mark.parametrize("path", CLEARED)
def test_no_text_above_a_prediction_gives_its_answer(path):
    assert not answers_above_predictions(nbformat.read(ROOT / path, as_version=4))


def test_the_crash_named_before_the_prediction_is_found():
    """The twin: notebook 02's first paragraph as it was, naming the crashes prediction 3 asks about."""
    nb = nbformat.read(ROOT / CLEARED[1], as_version=4)
    nb.cells[0].source += (
        "\n\nThe lab's PP=2 run below ends in `shape '[17, -1, 16]' is invalid for input of size 2624`; the PP=3 run, "
        "as `mat1 and mat2 shapes cannot be multiplied`."
    )
    prompt = next(i for i, cell in enumerate(nb.cells) if PROMPT.search(cell.source))
    nb.cells[prompt + 1].outputs = [
        {
            "output_type": "stream",
            "name": "stdout",
            "text": "RuntimeError: shape '[17, -1, 16]' is invalid for "
            "input of size 2624\nRuntimeError: mat1 and mat2 shapes cannot be multiplied (34x0 and 64x64)\n",
        }
    ]
    told = answers_above_predictions(nb)
    assert any("is invalid for input of size" in t for t in told) and any("mat1 and mat2" in t for t in told), told
