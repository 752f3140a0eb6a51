"""The student path (docs/lab_session.md) speaks one language: the glossary's words mean one thing wherever they are
used; and a student edition is what its command says it is. That nothing in it gives an exercise's answer away
before the exercise is tests/lab/test_no_recipe.py's."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]


GLOSSARY = ROOT / "docs" / "glossary.md"
ENTRY = re.compile(r"^\* \*\*(?P<term>[^*]+)\*\*: (?P<text>.+)$")
MEANINGS = [  # a wrong meaning once written on the path -> the meaning the glossary gives
    (r"(?:finished copy|copy that has finished) leaves", "an ack is queued when its copy starts"),
    (r"record (?:that |which )?a finished copy", "an ack is queued when its copy starts"),
    (r"parts of the same KV|shards of the same requests", "attention-CP peers hold the same KV"),
    (r"[Ll]egacy[^.]{0,40} agree[sd]? (?:on )?nothing", "legacy took a MIN over attention-TP within a stage"),
    (
        r"SGLang(?:'s HiCache)? agreed (?:only )?over (?:the |its )?(?:attention-)?TP",
        "SGLang's legacy group left the CP peers out only under DP attention (docs/fidelity.md, A3)",
    ),
]


def glossary() -> dict[str, str]:
    entries = {}
    for line in GLOSSARY.read_text().splitlines():
        if m := ENTRY.match(line):
            entries[m["term"]] = m["text"]
    return entries


def aliases() -> dict[str, str]:
    """Each word a glossary entry defines (lower case) -> the entry's term."""
    return {alias.strip().lower(): term for term in glossary() for alias in term.split(",")}


def documents() -> dict[str, str]:
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in [ROOT / "README.md", ROOT / "SYNC.md"]}
    texts |= {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "docs").glob("*.md") if p != GLOSSARY}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        texts[path.name] = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    return texts


def definitions(text: str) -> list[tuple[str, str]]:
    """(term, definition) of each bullet that defines a glossary word: `* **word**: ...` or `* **word** - ...`."""
    known, found = aliases(), []
    for m in re.finditer(r"^\* \*\*([^*]+)\*\*(?::| -| —) (.+(?:\n  .+)*)", text, re.M):
        words = {w.strip().lower().removesuffix("s") for w in re.split(r",|/| and ", m[1])}
        if any(w in known or w + "s" in known for w in words):
            found.append((m[1], " ".join(m[2].split())))
    return found


def test_a_term_defined_again_quotes_the_glossary():
    entries = {term.lower(): text for term, text in glossary().items()}
    assert len(entries) >= 20
    wrong = [
        f"{name}: **{term}**"
        for name, text in documents().items()
        for term, definition in definitions(text)
        if entries.get(term.lower()) != definition
    ]
    assert not wrong, f"defined otherwise than in docs/glossary.md (quote its entry word for word): {wrong}"


def test_no_text_gives_a_term_another_meaning():
    wrong = [
        f"{name}: {m.group(0)!r} (the glossary: {meaning})"
        for name, text in documents().items()
        for pattern, meaning in MEANINGS
        for m in [re.search(pattern, " ".join(text.split()))]
        if m
    ]
    assert not wrong, wrong


def test_the_checks_find_the_contradictions_they_were_written_for():
    """Each MEANINGS pattern catches the sentence that was on the path, and a paraphrased definition is caught."""
    was = [
        "A copy that has finished leaves an **ack**: its completion record",
        "the record a finished copy leaves (device → host: a *write* ack)",
        "they hold parts of the same KV and must take the same cache decisions",
        "Legacy (SGLang before the fix) agreed on nothing",
        "Before the CP fix SGLang agreed over attention-TP only",
    ]
    for (pattern, _), sentence in zip(MEANINGS, was, strict=True):
        assert re.search(pattern, sentence), pattern
    ack = next(t for t in glossary() if t == "Ack")
    assert definitions(f"* **{ack.lower()}**: the record a finished copy leaves\n") == [
        ("ack", "the record a finished copy leaves")
    ]


def test_a_student_edition_leaves_out_the_answers_and_nothing_students_read_points_into_them(tmp_path):
    """The edition is HEAD without teaching/; the documents and notebooks students read (as they are now) run no
    wrong answer or solution of teaching/, which the edition does not hold."""
    from hicache_lab.errors import ConfigError
    from hicache_lab.lab.teach.edition import edits, make_edition

    edition = tmp_path / "edition"
    files = make_edition(edition)
    assert not (edition / "teaching").exists() and not [f for f in files if f.startswith("teaching/")]
    assert (edition / "notebooks" / "06_exercises.ipynb").is_file() and (edition / "Makefile").is_file()
    rewritten = [p for p, pairs in edits().items() for e in pairs if e["teachers"] in (edition / p).read_text()]
    assert not rewritten, f"the edition ships the teachers' text of {rewritten}"
    with pytest.raises(ConfigError, match="not an empty directory"):
        make_edition(edition)
    with pytest.raises(ConfigError, match="inside the repository"):
        make_edition(ROOT / "runs" / "edition")
    command = re.compile(r"teaching/(?:mistakes|solutions)/\w+\.py:\w+")
    read = [ROOT / "README.md", ROOT / "SYNC.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "notebooks").glob("*.ipynb")]
    pointing = [str(p.relative_to(ROOT)) for p in read if command.search(p.read_text())]
    assert not pointing, f"runs a wrong answer or solution a student edition does not hold: {pointing}"


def _edition_fails(args: list[str], capsys) -> tuple[int, str]:
    from hicache_lab.__main__ import main

    code = main(["student-edition", *args])
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return code, err


def test_a_student_edition_that_cannot_be_cut_says_why_in_one_line(tmp_path, monkeypatch, capsys):
    """A dangling link as the target, a read-only target, git refusing another user's checkout, no git: exit 2
    and one line saying what to change."""
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    code, err = _edition_fails([str(tmp_path / "link")], capsys)
    assert code == 2 and f"link is a symbolic link to {tmp_path / 'nowhere'}, which does not exist" in err
    with monkeypatch.context() as patch:
        patch.setattr("os.statvfs", lambda path: type("Statvfs", (), {"f_flag": os.ST_RDONLY})())
        code, err = _edition_fails([str(tmp_path / "ro")], capsys)
    assert code == 2 and "is not writable: cannot create a file in" in err and "read-only mount" in err
    with monkeypatch.context() as patch:
        patch.setenv("GIT_TEST_ASSUME_DIFFERENT_OWNER", "1")  # git's own switch: the checkout is another user's
        code, err = _edition_fails([str(tmp_path / "ed")], capsys)
    assert code == 2 and "detected dubious ownership" in err and "git config --global --add safe.directory" in err
    with monkeypatch.context() as patch:
        patch.setenv("PATH", str(tmp_path))
        code, err = _edition_fails([str(tmp_path / "ed")], capsys)
    assert code == 2 and "there is no git on PATH: install git" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]


def test_a_disk_that_fills_mid_edition_leaves_nothing_and_a_rerun_works(tmp_path, monkeypatch, capsys):
    import tarfile

    extract, count = tarfile.TarFile.makefile, []

    def fills_at_the_20th_file(self, member, target):
        if len(count) == 20:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        count.append(member.name)
        return extract(self, member, target)

    target = tmp_path / "new" / "ed"
    with monkeypatch.context() as patch:
        patch.setattr(tarfile.TarFile, "makefile", fills_at_the_20th_file)
        code, err = _edition_fails([str(target)], capsys)
    assert code == 1 and f"cannot write the student edition into {target} at " in err
    assert "No space left on device; what it wrote is removed" in err
    assert list(tmp_path.iterdir()) == []
    from hicache_lab.__main__ import main

    assert main(["student-edition", str(target)]) == 0 and (target / "Makefile").is_file()
