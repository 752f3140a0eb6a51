"""The documents say what is true now: every file of ours they name exists (and every `file.py:NAME`, the name in
it), every dotted `hicache_lab.…` path imports, and every package's docstring names each module and package in
it. A module moved or renamed fails here, with the document and the stale name."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted([*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md")])
# A path of ours: one of these prefixes (SGLang's paths in the docs, `mem_cache/…` and the like, have none of
# them), relative to the repository, to the package (`lab/…`) or to the lab's rooms (`figures/…`)
OURS = re.compile(
    r"(?<![\w/.-])((?:hicache_lab|lab|bench|tests|docs|notebooks|figures)/[\w/.-]*\w\.(?:py|md|ipynb|png))"
    r"(?::([A-Za-z_]\w*))?"
)
DOTTED = re.compile(r"`(hicache_lab(?:\.\w+)+)`")
MADE_BY_STUDENTS = re.compile(r"notebooks/my_\w+\.py")  # written during a session (.gitignore)


def _resolves(path: str) -> Path | None:
    for candidate in (ROOT / path, ROOT / "hicache_lab" / path, ROOT / "hicache_lab" / "lab" / path):
        if candidate.is_file():
            return candidate
    return None


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_file_of_ours_a_document_names_exists(document):
    stale = []
    for match in OURS.finditer(document.read_text()):
        path, name = match.groups()
        if MADE_BY_STUDENTS.fullmatch(path):
            continue
        found = _resolves(path)
        if found is None:
            stale.append(path)
        elif name and not re.search(rf"\b{name}\b", found.read_text()):
            stale.append(f"{path}:{name}")
    assert not stale, f"{document.name} names what is not there: {sorted(set(stale))}"


def _imports(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            if importlib.util.find_spec(".".join(parts[:cut])) is None:
                continue
        except ModuleNotFoundError:  # a parent that is no package
            continue
        obj = importlib.import_module(".".join(parts[:cut]))
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_dotted_path_a_document_names_imports(document):
    stale = sorted({m.group(1) for m in DOTTED.finditer(document.read_text()) if not _imports(m.group(1))})
    assert not stale, f"{document.name} names what does not import: {stale}"


PACKAGES = sorted((ROOT / "hicache_lab").rglob("__init__.py"))


@pytest.mark.parametrize("init", PACKAGES, ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_every_package_docstring_names_each_of_its_modules(init):
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    here = init.parent
    parts = [p.stem for p in here.glob("*.py") if p.stem != "__init__"]
    parts += [p.name for p in here.iterdir() if (p / "__init__.py").is_file()]
    omitted = sorted(part for part in parts if not re.search(rf"\b{re.escape(part)}\b", doc))
    assert not omitted, f"{here.relative_to(ROOT)}/__init__.py's docstring omits {omitted}"
