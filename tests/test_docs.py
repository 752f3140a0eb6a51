"""The documents say what is true now: every file of ours they name exists (and every `file.py:NAME`, the name in
it), every dotted `hicache_lab.…` path imports, every link to a document's heading finds it, the README's core size
is within 5% of the core's lines, every package's docstring names each module and package in it, and
docs/running.md names every flag of `run`. Reference text and docstrings carry no issue numbers, and docstrings no
hardware timings (BENCHMARKS.md holds those). Each document keeps to its budget of lines. A module moved or renamed,
or a document grown past its reader, fails here, with the document and what to change."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from hicache_lab.__main__ import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted([*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md")])
# A path of ours: one of these prefixes (SGLang's paths in the docs, `mem_cache/…` and the like, have none of
# them), relative to the repository, to the package (`lab/…`) or to the lab's rooms (`figures/…`)
OURS = re.compile(
    r"(?<![\w/.-])((?:hicache_lab|lab|bench|tests|docs|notebooks|figures)/[\w/.-]*\w\.(?:py|md|ipynb|png))"
    r"(?::([A-Za-z_]\w*))?"
)
DOTTED = re.compile(r"(?<![\w/.-])(hicache_lab(?:\.[A-Za-z_]\w*)+)")
MADE_BY_STUDENTS = re.compile(r"notebooks/my_\w+\.py")  # written during a session (.gitignore)
LINK = re.compile(r"\]\(([\w./-]+\.md)?#([\w-]+)\)")  # [text](file.md#heading) or [text](#heading)

# Lines each document may hold: a README that is a landing page, a manual beside it, reference text, results
BUDGETS = {
    "README.md": 200,
    "docs/running.md": 250,
    "docs/checks.md": 250,
    "docs/fidelity.md": 200,
    "docs/architecture.md": 350,
    "BENCHMARKS.md": 360,
}
# The core the README states the size of: the cache, its agreement, the scheduler and the model
CORE = ("hicache_lab/mem_cache", "hicache_lab/distributed", "hicache_lab/managers", "hicache_lab/model.py")
CORE_SIZE = re.compile(r"\ba ([\d,]+)-line core\b")
REFERENCE = [ROOT / "README.md", ROOT / "SYNC.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
ISSUE = re.compile(r"\bissue \d+|\(issue\b", re.I)  # our issue tracker's numbers; SGLang's #NNNNN are references
SGLANG_FLAGS = {"--tp-size", "--attn-cp-size", "--pp-size"}  # SGLang's, named beside the lab's equivalents
TIMING = re.compile(r"\bH[12]00\b|\d\s*(?:µs|us|GiB/s|GB/s|MiB/s)(?!\w)")


def _resolves(path: str) -> Path | None:
    for candidate in (ROOT / path, ROOT / "hicache_lab" / path, ROOT / "hicache_lab" / "lab" / path):
        if candidate.is_file():
            return candidate
    return None


def stale_files(text: str) -> list[str]:
    """The paths of ours `text` names that are not there, and the `file.py:NAME`s whose file lacks NAME."""
    stale = []
    for match in OURS.finditer(text):
        path, name = match.groups()
        if MADE_BY_STUDENTS.fullmatch(path):
            continue
        found = _resolves(path)
        if found is None:
            stale.append(path)
        elif name and not re.search(rf"\b{name}\b", found.read_text()):
            stale.append(f"{path}:{name}")
    return sorted(set(stale))


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_file_of_ours_a_document_names_exists(document):
    stale = stale_files(document.read_text())
    assert not stale, f"{document.name} names what is not there: {stale}"


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


def stale_dotted(text: str) -> list[str]:
    return sorted({m.group(1) for m in DOTTED.finditer(text) if not _imports(m.group(1))})


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_dotted_path_a_document_names_imports(document):
    stale = stale_dotted(document.read_text())
    assert not stale, f"{document.name} names what does not import: {stale}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def stale_links(document: Path) -> list[str]:
    """The links `[…](file.md#heading)` in `document` whose file is not there or has no such heading."""
    stale = []
    for match in LINK.finditer(document.read_text()):
        target = (document.parent / match.group(1)).resolve() if match.group(1) else document
        headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M) if target.is_file() else []
        if match.group(2) not in {slug(h) for h in headings}:
            stale.append(f"{match.group(1) or ''}#{match.group(2)}")
    return stale


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_link_to_a_heading_finds_it(document):
    stale = stale_links(document)
    assert not stale, f"{document.name} links to headings that are not there: {stale}"


def test_the_checks_find_what_has_gone_stale(tmp_path):
    """Each check fails on the kind of staleness it is for, and passes what is there."""
    assert stale_files("`hicache_lab/mem_cache/radix_tree.py:RadixTree`, `lab/check/zoo.py`") == []
    assert stale_files("`hicache_lab/mem_cache/gone.py`") == ["hicache_lab/mem_cache/gone.py"]
    assert stale_files("`mem_cache/x` and `hicache_lab/mem_cache/radix_tree.py:NoSuchName`") == [
        "hicache_lab/mem_cache/radix_tree.py:NoSuchName"
    ]
    assert stale_dotted("`hicache_lab.managers.step_trace.load_trace(DIR)`") == []
    assert stale_dotted("hicache_lab.lab.exercise.check(pp_sync=...)") == ["hicache_lab.lab.exercise.check"]
    (tmp_path / "a.md").write_text("# A title\n\n## Scheduling, as SGLang's\n\n[x](#a-title) [y](b.md#none)\n")
    (tmp_path / "b.md").write_text("[z](a.md#scheduling-as-sglangs) [w](a.md#scheduling)\n")
    assert stale_links(tmp_path / "a.md") == ["b.md#none"]
    assert stale_links(tmp_path / "b.md") == ["a.md#scheduling"]
    assert CORE_SIZE.search("written as a 5,060-line core (") and not CORE_SIZE.search("a 5,060-line corerun")
    assert ISSUE.search("since issue 27,") and ISSUE.search("(issue 14)") and not ISSUE.search("issues 68 sends")
    assert TIMING.search("on an H200") and TIMING.search("14 µs") and TIMING.search("50 GB/s")
    assert not TIMING.search("GB of host pool, `--hicache-size` in GB")


@pytest.mark.parametrize("name", BUDGETS)
def test_each_document_keeps_to_its_budget(name):
    lines = len((ROOT / name).read_text().splitlines())
    assert lines <= BUDGETS[name], f"{name} has {lines} lines, its budget {BUDGETS[name]}: move what its reader "
    "does not need to the document that serves it"


def core_lines() -> int:
    files = [p for part in CORE for p in ([ROOT / part] if part.endswith(".py") else (ROOT / part).rglob("*.py"))]
    return sum(len(p.read_text().splitlines()) for p in files)


def test_the_readme_states_the_core_size_within_five_percent():
    stated = CORE_SIZE.search((ROOT / "README.md").read_text())
    assert stated, "README.md states no 'a N-line core'"
    stated, measured = int(stated.group(1).replace(",", "")), core_lines()
    assert abs(stated - measured) <= 0.05 * measured, (
        f"README.md says a {stated:,}-line core; {' + '.join(CORE)} hold {measured:,} lines: write that"
    )


@pytest.mark.parametrize("document", REFERENCE, ids=lambda p: p.name)
def test_reference_text_names_no_issue_of_ours(document):
    found = [m.group(0) for m in ISSUE.finditer(document.read_text())]
    assert not found, f"{document.name} names our issues {found}: say what is true now, without its history"


def _docstrings(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        if isinstance(node, kinds) and (doc := ast.get_docstring(node)):
            yield getattr(node, "name", "the module"), doc


SOURCES = sorted((ROOT / "hicache_lab").rglob("*.py"))


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_docstrings_name_no_issue_and_no_hardware_timing(source):
    found = [
        f"{name}: {m.group(0)!r}"
        for name, doc in _docstrings(source)
        for m in [*ISSUE.finditer(doc), *TIMING.finditer(doc)]
    ]
    assert not found, f"{source.relative_to(ROOT)}: {found} (a docstring says what is true now; timings live in "
    "BENCHMARKS.md beside their command, machine and commit)"


def run_flags() -> set[str]:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    run = commands.choices["run"]
    return {o for action in run._actions for o in action.option_strings if o.startswith("--") and o != "--help"}


def test_running_md_flag_table_names_every_run_flag_and_no_other():
    text = (ROOT / "docs" / "running.md").read_text()
    table = text[text.index("| what | flags |") :].split("\n\n", 1)[0]
    named, flags = set(re.findall(r"--[a-z][\w-]*", table)), run_flags()
    assert not flags - named, f"docs/running.md's flag table lacks {sorted(flags - named)}"
    unknown = named - flags - SGLANG_FLAGS
    assert not unknown, f"docs/running.md's flag table names flags `run` does not have: {sorted(unknown)}"


PACKAGES = sorted((ROOT / "hicache_lab").rglob("__init__.py"))


@pytest.mark.parametrize("init", PACKAGES, ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_every_package_docstring_names_each_of_its_modules(init):
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    here = init.parent
    parts = [p.stem for p in here.glob("*.py") if p.stem != "__init__"]
    parts += [p.name for p in here.iterdir() if (p / "__init__.py").is_file()]
    omitted = sorted(part for part in parts if not re.search(rf"\b{re.escape(part)}\b", doc))
    assert not omitted, f"{here.relative_to(ROOT)}/__init__.py's docstring omits {omitted}"
