"""What a student edition (edition.py) keeps from a student until an exercise has passed.

Three ways, one per kind of material:
* left out (`LEFT_OUT`): `teaching/`, the answers, the catalogue of wrong answers and the homework's answers;
* rewritten (`EDITS`): the reference documents keep their protocol in full for teachers and researchers, and the
  edition ships them with each exercise's recipe replaced by what the function must achieve and where the lab's
  own answer is (`for_students`);
* kept closed (`CLOSED`): the files that cannot leave, because the lab runs them, and that hold the answers; a
  student opens them once their functions pass.

Whether this checkout is a student edition is whether `teaching/` is here (`student_edition`): the CLI then gives
the students' table of mistakes only, and a hint one at a time, for the verdict a student got.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]  # the repository this package was installed from
LEFT_OUT = "teaching"
CLOSED = {  # path (a folder ends in /) -> what it holds that a student must not see before the exercises pass
    "hicache_lab/distributed/cache_sync.py": "the lab's relay and groups (CacheSync._pp_sync, CacheSync._attn_groups)",
    "hicache_lab/mem_cache/hiradix_cache.py": "the lab's consumption of acks (HiRadixCache.writing_check)",
    "hicache_lab/lab/teach/mistakes.py": "every kind of mistake's hint (`--hint` shows one, for the verdict you got)",
    "hicache_lab/lab/sglang/": "SGLang's own lines, which the lab patches at runtime",
    "bench/": "the relay, timed against a barrier and an all-reduce",
    "tests/": "the tests, which run right answers of their own",
}
EDITS = {  # path -> (the teachers' text, the students'), each teachers' text found exactly once
    "SYNC.md": (
        (
            "; the docstring\nof `cache_sync.py` says what each does)",
            "; `python -m hicache_lab zoo`\nbreaks each alone)",
        ),
        (
            "| MIN on PP rank 0 over attn-CP then attn-TP; relayed down PP (`_pp_sync`) through every stage; "
            "every rank enters it every step | attn-CP, attn-TP, PP |",
            "| MIN on PP rank 0 over the groups of `_attn_groups` (exercise 3), then passed one way to every "
            "later stage (`_pp_sync`, exercise 1); every rank enters it every step | `_attn_groups`' groups, PP |",
        ),
        (
            "| consume exactly the agreed count, `synchronize()`ing its own copy where not yet done |",
            "| consume exactly the agreed count, oldest first (`writing_check`, exercise 2) |",
        ),
        (
            "| MIN on PP rank 0 over attn-CP then attn-TP, relayed down PP; where one failed,",
            "| as 1; where one failed,",
        ),
    ),
}


def student_edition(root: Path = ROOT) -> bool:
    """This checkout is a student edition: it has no `teaching/`."""
    return not (root / LEFT_OUT).is_dir()


def closed(path: str) -> bool:
    """`path` (relative to the repository) is on the keep-closed list."""
    return any(path == where or (where.endswith("/") and path.startswith(where)) for where in CLOSED)


def student_text(path: str, text: str) -> str:
    """`text`, the teachers' `path`, as the student edition ships it (`EDITS`); a ConfigError where a document no
    longer holds a text EDITS replaces (the edition would ship the recipe: update EDITS with the document)."""
    for teachers, students in EDITS.get(path, ()):
        if text.count(teachers) != 1:
            raise ConfigError(
                f"{path} holds {text.count(teachers)} times, not once, the text the student edition replaces "
                f"({teachers[:60]!r}...): update EDITS in hicache_lab/lab/teach/closed.py with the document"
            )
        text = text.replace(teachers, students)
    return text


def for_students(out: Path) -> None:
    """Rewrite the documents of an edition written into `out` as students get them (`EDITS`)."""
    for path in EDITS:
        target = out / path
        target.write_text(student_text(path, target.read_text()))
