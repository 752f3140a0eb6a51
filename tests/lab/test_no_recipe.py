"""No recipe before its exercise: no file of the student edition, and nothing the CLI prints there, states an
exercise's algorithm beyond what the function must achieve, or offers a function that does its work.

Every file a student edition ships (HEAD without teaching/, as hicache_lab/lab/teach/edition.py rewrites it) is
read, prose and code, a notebook's cells with their committed outputs, for each exercise's recipe (`RECIPES`),
the code of the lab's answers and of teaching/solutions/, and the check's hints. Exempt are the files on the
keep-closed list (`CLOSED`: they hold the answers the lab runs) and, in notebook 06, what follows the cell that
checks an exercise (behind it: its answer is shown once it passes). Each check is shown to catch what was on the
path before (`WAS`)."""

from __future__ import annotations

import ast
import html
import inspect
import json
import re
import subprocess
import textwrap
from pathlib import Path

import pytest

from hicache_lab.__main__ import main
from hicache_lab.distributed.cache_sync import CacheSync
from hicache_lab.errors import ConfigError
from hicache_lab.lab.teach import exercise_cli
from hicache_lab.lab.teach.edition import CLOSED, LEFT_OUT, edits, student_edition, student_text
from hicache_lab.lab.teach.exercise import Verdict
from hicache_lab.lab.teach.mistakes import MISTAKES
from hicache_lab.mem_cache.hiradix_cache import HiRadixCache

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {  # exercise -> {what the text gives away: a pattern over the text (`plain`)}
    1: {
        "a receive from the previous stage, then a send": r"\brecv\b[^.;]{0,60}\bprevious stage\b[^.;]{0,80}\bi?send\b",
        "an isend of a clone": r"\bisend\b[^.;]{0,40}\bclone\b|\bclone\(\)[^.;]{0,40}\bisend\b",
        "the peer stage as pp_rank ± 1": r"(?:recv|isend)\(data\b[^)]{0,40}group_(?:src|dst)=self\.pp_rank\s*[-+]\s*1",
        "the send's handle kept in work_list": r"work_list\.append\(",
    },
    2: {
        "pop_acks, which did exercise 2's work": r"\bpop_acks\b",
        "the wait for the copy": r"finish_event\.synchronize\(\)",
        "the queue's head popped": r"ack_write_queue\.pop\(",
        "the node taken out of flight": r"ongoing_write_through\.pop\(",
        "a wait for the rank's own copy": r"\b(?:wait|synchroniz)\w*\b[^.;]{0,30}\b(?:its|this rank.s|their|your) "
        r"own copy",
    },
    3: {
        "the CP and TP groups, in code": r"self\.(?:groups\.)?attn_(cp|tp)_group\s*,\s*"
        r"self\.(?:groups\.)?attn_(?!\1)(?:cp|tp)_group(?!\s*=)",  # not an assignment of both
        "over attention-CP and attention-TP": r"\bover (?:the )?(?:attn|attention)-CP(?: groups?)?,? "
        r"(?:then|and|as well as) (?:the )?(?:attn|attention)-TP",
        "SGLang's answer beside the lab's, shown before it passes": r"side_by_side\([^)]*_create_sync_groups",
    },
}
CHECKED = {"pp_sync": 1, "writing_check": 2, "attn_groups": 3}  # notebook 06: check(SLOT=...) -> its exercise
WAS = {  # what was on the path, each caught by the check that now passes
    "SYNC.md's rule": "* No symmetric collective spans PP stages inside the scheduler loop. Only the one-way relay "
    "(blocking `recv`\n  from the previous stage, non-blocking `isend` of a clone to the next) crosses stages",
    "cache_controller.py's pop_acks": """
    def pop_acks(self, queue: list[HiCacheAck], what: str, count: int) -> list[HiCacheAck]:
        acks = []
        for _ in range(count):
            acks.append(queue.pop(0))
            acks[-1].finish_event.synchronize()
            self.verify(acks[-1], what)
        return acks
""",
}
NOTEBOOK_03_CELL = {  # notebook 03's code comparison, and what it printed (an excerpt, HTML-escaped)
    "cell_type": "code",
    "source": "ours = [prefetch_group_rank_sets, CacheSync._create_prefetch_sync_groups]\n"
    'display(HTML(side_by_side(ours, ("_create_prefetch_sync_groups", "_create_sync_groups"))))',
    "outputs": [
        {
            "data": {
                "text/html": "<pre>    if self.attn_cp_group is not None:\n"
                "        base_groups = [self.attn_cp_group, self.attn_tp_group]</pre>"
            }
        }
    ],
}
TABLE_WITH_HINTS = """| `send_aliases_data` | at once | `pp_sync.py:sends_data_itself` | send a tensor nobody else holds: data.clone() |
| `copy_not_waited` | no: the run shows it | `writing_check.py:no_wait` | wait for this rank's own copy before unlocking its nodes: ack.finish_event.synchronize() |
| `missing_group` | no: the run shows it | `attn_groups.py:attention_tp_only` | return the attention-CP group (CP peers split the sequence) as well as the attention-TP group (TP peers split the heads): self.groups.attn_cp_group, self.groups.attn_tp_group |"""  # noqa: E501  `exercise --table --hint` as a student edition printed it


def closed(path: str) -> bool:
    """`path` (from the repository's root) is on the keep-closed list, or in a folder that is."""
    return any(path == where or where.endswith("/") and path.startswith(where) for where in CLOSED)


def plain(text: str) -> str:
    """`text` as read: HTML entities decoded, no markdown marks, one kind of quote, words one space apart."""
    return " ".join(html.unescape(text).replace("`", "").replace("*", "").replace("'", '"').split())


def code_lines(lines) -> list[str]:
    lines = (line.split("#")[0].strip() for line in lines)
    return [line for line in lines if len(line) >= 40 and not line.startswith(("import", "from", '"""', "def "))]


def answers() -> dict[int, list[str]]:
    """Each exercise's answer as code, line by line: the lab's own and teaching/solutions/ (a teachers' checkout)."""
    lab = {1: CacheSync._pp_sync, 2: HiRadixCache.writing_check, 3: CacheSync._attn_groups}
    found = {}
    for exercise, function in lab.items():
        body = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0].body[1:]  # not the docstring
        found[exercise] = code_lines(line for stmt in body for line in ast.unparse(stmt).splitlines())
    for slot, exercise in CHECKED.items():
        solution = ROOT / LEFT_OUT / "solutions" / f"{slot}.py"
        found[exercise] += code_lines(solution.read_text().splitlines()) if solution.is_file() else []
    return {exercise: [plain(line) for line in lines] for exercise, lines in found.items()}


ANSWERS = answers()
HINTS = {kind: plain(m.fix) for kind, m in MISTAKES.items()}


def recipes(text: str) -> list[tuple[int, str]]:
    """(exercise, what) for each recipe, answer line or hint `text` holds."""
    flat = plain(text)
    found = [(n, what) for n, pats in RECIPES.items() for what, pat in pats.items() if re.search(pat, flat, re.I)]
    found += [(n, f"the answer's line {line!r}") for n, lines in ANSWERS.items() for line in lines if line in flat]
    return found + [(0, f"the hint of {kind}") for kind, fix in HINTS.items() if fix in flat]


def notebook_recipes(cells: list[dict], after_checks: bool = False) -> list[str]:
    """What the cells hold; with `after_checks` (notebook 06), an exercise's recipe counts only before the cell
    that checks it."""
    found = []
    checked_at = {}
    for i, cell in enumerate(cells):
        source = "".join(cell["source"])
        outputs = [json.dumps(o.get("data", {})) + str(o.get("text", "")) for o in cell.get("outputs", [])]
        for n, what in recipes("\n".join([source, *outputs]).replace("\\n", "\n").replace('\\"', '"')):
            if not (after_checks and n in checked_at and i > checked_at[n]):
                found.append(f"cell {i}: exercise {n or 'any'}, {what}")
        for slot, n in CHECKED.items():
            if re.search(rf"check\([^)]*\b{slot}=", source) and n not in checked_at:
                checked_at[n] = i
    return found


def shipped() -> dict[str, str]:
    """Every text file a student edition would ship, as it ships it (committed or not: what is here)."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, timeout=60)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout, so no list of its files: {listed.stderr.decode().strip()}")
    texts = {}
    for path in listed.stdout.decode().split("\0"):
        if path and not path.startswith(f"{LEFT_OUT}/") and (ROOT / path).is_file():
            try:
                texts[path] = student_text(path, (ROOT / path).read_text())
            except UnicodeDecodeError:  # an image
                continue
    return texts


def leaks(path: str, text: str) -> list[str]:
    if path.endswith(".ipynb"):
        return notebook_recipes(json.loads(text)["cells"], after_checks=path == "notebooks/06_exercises.ipynb")
    return [f"exercise {n or 'any'}, {what}" for n, what in recipes(text)]


@pytest.fixture(scope="module")
def edition() -> dict[str, str]:
    return shipped()


def test_no_file_of_the_student_edition_holds_a_recipe(edition):
    assert len(edition) > 200 and "SYNC.md" in edition and "notebooks/03_cp_prefetch_sync.ipynb" in edition
    found = {path: leaks(path, text) for path, text in edition.items() if not closed(path)}
    found = {path: what for path, what in found.items() if what}
    assert not found, f"a recipe before its exercise (rewrite it, or move it to {LEFT_OUT}/): {found}"


def test_the_closed_files_are_the_ones_holding_the_answers(edition):
    """Each entry of the keep-closed list names files that are there and hold a recipe (nothing closed for
    nothing)."""
    for where in CLOSED:
        held = [path for path, text in edition.items() if closed(path) and path.startswith(where) and leaks(path, text)]
        assert held, f"{where} is on the keep-closed list but holds no recipe"


def student_cli(args: list[str], capsys) -> tuple[int, str]:
    """`python -m hicache_lab exercise ARGS`: its exit code, and what it printed."""
    try:
        code = main(["exercise", *args])
    except SystemExit as done:  # --help
        code = done.code
    out = capsys.readouterr()
    return code, out.out + out.err


def test_the_cli_in_a_student_edition_prints_no_recipe_and_a_hint_only_for_the_verdict(monkeypatch, capsys):
    """`exercise --help`, `--table` and `--table --hint` there print no recipe and no fix; a verdict with --hint
    adds its own kind's fix and no other."""
    monkeypatch.setattr(exercise_cli, "student_edition", lambda: True)
    for args, exit_code in ((["--help"], 0), (["--table"], 0), (["--table", "--hint"], 2)):
        code, said = student_cli(args, capsys)
        assert code == exit_code and said.strip(), args
        assert not recipes(said), f"exercise {' '.join(args)} in a student edition: {recipes(said)}"
    for kind in MISTAKES:
        said = str(Verdict(ok=False, lines=["WRONG"], mistake=kind, show_hint=True))
        assert [what for _, what in recipes(said) if what.startswith("the hint")] == [f"the hint of {kind}"]


def test_each_check_catches_what_was_on_the_path():
    assert (1, "a receive from the previous stage, then a send") in recipes(WAS["SYNC.md's rule"])
    assert (1, "an isend of a clone") in recipes(WAS["SYNC.md's rule"])
    assert (2, "pop_acks, which did exercise 2's work") in recipes(WAS["cache_controller.py's pop_acks"])
    cell = notebook_recipes([NOTEBOOK_03_CELL])
    assert any("SGLang's answer beside" in c for c in cell) and any("CP and TP groups" in c for c in cell), cell
    table = recipes(TABLE_WITH_HINTS)
    assert {"the wait for the copy", "the CP and TP groups, in code"} <= {w for _, w in table}, table


def test_notebook_06_may_show_an_answer_only_behind_its_check():
    ask = {"cell_type": "code", "source": 'check(writing_check="my.py:writing_check")', "outputs": []}
    answer = {"cell_type": "markdown", "source": "every rank waits: `ack.finish_event.synchronize()`"}
    assert notebook_recipes([ask, answer], after_checks=True) == []
    assert notebook_recipes([answer, ask], after_checks=True)


@pytest.mark.skipif(student_edition(), reason="a student edition: its files are the students' already")
def test_the_edition_rewrites_each_recipe_it_replaces_and_refuses_a_document_that_moved_on():
    """The teachers' SYNC.md and docs/sglang_names.md hold recipes, which the edition's do not."""
    assert edits()
    for path in edits():
        teachers = (ROOT / path).read_text()
        assert leaks(path, teachers) and not leaks(path, student_text(path, teachers)), path
    with pytest.raises(ConfigError, match=r"SYNC.md holds 0 times, not once, .* update teaching/student_edition.json"):
        student_text("SYNC.md", "a SYNC.md rewritten since")
