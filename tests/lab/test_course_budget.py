"""The 90-minute session fits by design: docs/lab_session.md gives each step of its path a budget in words to
read, figures and tables to decode, machine time, and minutes, and this measures each step from the files it
reads (not from the plan's say-so).

A step costs a minute per 120 words, a minute per figure or table, its machine time, and the minutes the plan
gives it for predicting, writing and thinking. Words are those of the markdown read (code and bars left out); a
figure is an image (a markdown one, or a cell's output), a table (markdown, or a cell's rendered one) or a
printout of four lines or more. Machine time is the cells' execution time in the notebook's committed metadata;
where the step runs something else (`make demo`, the exercise's checks) it is the plan's own figure. A step that
reads more words or figures, or runs longer, than its budget fails, and the plan's minutes add up to at most 80:
ten of the 90 are slack for a class."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
PLAN = "docs/lab_session.md"
WORDS_PER_MINUTE = 120
MOST_MINUTES = 80  # of the session's 90


@dataclass(frozen=True)
class Reading:
    """What a step reads of one file: from the first line (markdown: cell) matching `start` to the last before the
    first matching `stop` (regular expressions; None: from the top, to the end)."""

    path: str
    start: str | None = None
    stop: str | None = None


PATH = {  # step of the plan's table -> what it reads, and whether its machine time is the notebook's own
    1: (Reading("README.md", r"## What the demo shows", r"The chain behind that crash"), False),
    2: (Reading("notebooks/01_hicache_tour.ipynb", stop=r"## Deeper"), True),
    3: (Reading("notebooks/02_pp_queue_divergence.ipynb", stop=r"## Deeper"), True),
    4: (Reading("notebooks/06_exercises.ipynb", stop=r"### A design question"), False),
    5: (Reading("SYNC.md", stop=r"\| *(?![123] *\|)\w+ *\|"), False),  # the paragraph above the table, rows 1-3
    6: (Reading("notebooks/06_exercises.ipynb", r"### A design question", r"## Exercise 3"), False),
}


@dataclass
class Cost:
    words: int = 0
    figures: int = 0
    seconds: float = 0.0

    def minutes(self, thinking: float) -> float:
        return self.words / WORDS_PER_MINUTE + self.figures + self.seconds / 60 + thinking


def markdown_cost(text: str) -> Cost:
    lines = text.splitlines()
    tables = sum(
        1 for i, line in enumerate(lines) if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|"))
    )
    words = [token for token in text.split() if re.search(r"\w", token)]  # not a table's bars, a bullet's star
    return Cost(len(words), len(re.findall(r"!\[", text)) + tables)


def output_figures(output: dict) -> int:
    data = output.get("data", {})
    if any(kind.startswith("image/") for kind in data) or "text/html" in data:
        return 1
    text = output.get("text", "") or data.get("text/plain", "")
    return int(len(str(text).strip().splitlines()) >= 4)


def seconds(cell) -> float:
    e = cell.metadata.get("execution", {})
    if not e:
        return 0.0
    start, end = (
        datetime.fromisoformat(e[key].replace("Z", "+00:00")) for key in ("iopub.execute_input", "shell.execute_reply")
    )
    return (end - start).total_seconds()


def between(items: list, first_line, reading: Reading) -> list:
    """The items (cells, lines) from the first whose first line matches `start` to before the first matching
    `stop`; a marker that matches nothing is an error saying which."""
    marks = {}
    for key in ("start", "stop"):
        pattern = getattr(reading, key)
        if pattern is not None:
            found = [i for i, item in enumerate(items) if re.match(pattern, first_line(item))]
            assert found, f"{reading.path} has no line matching {key} {pattern!r}: fix PATH or the step in {PLAN}"
            marks[key] = found[0]
    return items[marks.get("start", 0) : marks.get("stop", len(items))]


def measure(root: Path, reading: Reading, timed: bool) -> Cost:
    path = root / reading.path
    if path.suffix != ".ipynb":
        lines = between(path.read_text().splitlines(), lambda line: line, reading)
        return markdown_cost("\n".join(lines))
    cells = between(nbformat.read(path, as_version=4).cells, lambda cell: cell.source.lstrip(), reading)
    cost = Cost()
    for cell in cells:
        if cell.cell_type == "markdown":
            part = markdown_cost(cell.source)
            cost.words, cost.figures = cost.words + part.words, cost.figures + part.figures
        elif cell.cell_type == "code":
            cost.figures += sum(output_figures(o) for o in cell.get("outputs", []))
            cost.seconds += seconds(cell) if timed else 0.0
    return cost


@dataclass(frozen=True)
class Budget:
    step: int
    name: str
    words: int
    figures: int
    seconds: int
    thinking: int
    minutes: int


def number(cell: str) -> int:
    found = re.search(r"\d[\d,]*", cell)
    return int(found.group(0).replace(",", "")) if found else 0


def plan(root: Path) -> list[Budget]:
    """The rows of the plan's table: | # | step | words | figures | machine | thinking | minutes | ... |."""
    lines = (root / PLAN).read_text().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| # | step | words | figures | machine |"))
    rows = []
    for line in lines[head + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows.append(Budget(number(cells[0]), cells[1], *(number(cell) for cell in cells[2:7])))
    return rows


COLUMNS = f"{'step':<36} {'words':>11} {'figures':>7} {'machine s':>9} {'thinking':>8} {'minutes':>11}"


def row(b: Budget, cost: Cost) -> str:
    """One step's measured cost / its budget, in the columns of COLUMNS."""
    name = f"{b.step} {b.name}"[:36]
    words, figures = f"{cost.words}/{b.words}", f"{cost.figures}/{b.figures}"
    machine, minutes = f"{cost.seconds:.0f}/{b.seconds}", f"{cost.minutes(b.thinking):.1f}/{b.minutes}"
    return f"{name:<36} {words:>11} {figures:>7} {machine:>9} {b.thinking:>8} {minutes:>11}"


def check(root: Path) -> tuple[str, list[str]]:
    """The table of each step's measured cost against its budget, and what exceeds a budget."""
    budgets = plan(root)
    steps = [b.step for b in budgets]
    assert steps == sorted(PATH), f"{PLAN}'s steps are {steps}, PATH's {sorted(PATH)}"
    table, over, total = [COLUMNS], [], 0.0
    for b in budgets:
        reading, timed = PATH[b.step]
        cost = measure(root, reading, timed)
        cost.seconds = cost.seconds if timed else b.seconds
        total += cost.minutes(b.thinking)
        table.append(row(b, cost))
        for what, measured, budget in (
            ("words", cost.words, b.words),
            ("figures", cost.figures, b.figures),
            ("machine seconds", cost.seconds, b.seconds),
        ):
            if measured > budget:
                over.append(f"step {b.step} reads {reading.path}: {measured:g} {what}, its budget {budget}")
        if Cost(b.words, b.figures, b.seconds).minutes(b.thinking) > b.minutes + 1e-9:  # 700 words: 5.83...
            over.append(f"step {b.step}: its budgets add up to more than its {b.minutes} minutes")
    planned = sum(b.minutes for b in budgets)
    table.append(f"{'total':<36} {'':>11} {'':>7} {'':>9} {'':>8} {f'{total:.1f}/{planned}':>11}")
    if planned > MOST_MINUTES:
        over.append(f"the plan's steps add up to {planned} minutes, more than {MOST_MINUTES}")
    return "\n".join(table), over


def on_the_path(root: Path) -> list[Path]:
    return sorted({root / reading.path for reading, _ in PATH.values() if reading.path.endswith(".ipynb")})


def test_every_step_of_the_session_fits_its_budget():
    notebooks = [nbformat.read(p, as_version=4) for p in on_the_path(ROOT)]
    if not any(o for nb in notebooks for c in nb.cells if c.cell_type == "code" for o in c.outputs):
        pytest.skip("a student edition: the path's notebooks have no outputs to measure (the teacher's copy has)")
    table, over = check(ROOT)
    print(table)
    assert not over, "\n".join([table, "over budget (move what exceeds past the step's stop point):", *over])


@pytest.mark.parametrize("step", [2, 3])
def test_a_paragraph_more_fails_a_full_step(step, tmp_path):
    """The twin: one paragraph of 80 words added before a notebook step's stop point takes it over budget."""
    for path in (PLAN, *{reading.path for reading, _ in PATH.values()}):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, tmp_path / path)
    reading = PATH[step][0]
    nb = nbformat.read(tmp_path / reading.path, as_version=4)
    stop = next(i for i, cell in enumerate(nb.cells) if re.match(reading.stop, cell.source.lstrip()))
    nb.cells.insert(stop, nbformat.v4.new_markdown_cell(" ".join(["word"] * 80)))
    nbformat.write(nb, tmp_path / reading.path)
    table, over = check(tmp_path)
    print(table, *over, sep="\n")
    assert any(line.startswith(f"step {step} reads {reading.path}") and "words" in line for line in over), over


def test_the_measure_counts_what_a_student_decodes():
    """Markdown words, tables and images; a cell's image, rendered table and long printout, not a short one."""
    assert markdown_cost("Two words\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n![x](y.png)") == Cost(7, 2)
    outputs = [
        {"output_type": "display_data", "data": {"image/png": "", "text/plain": "<Figure>"}},
        {"output_type": "execute_result", "data": {"text/html": "<table>", "text/plain": "a\nb\nc\nd"}},
        {"output_type": "stream", "text": "one\ntwo\nthree\nfour\n"},
        {"output_type": "stream", "text": "one line\n"},
    ]
    assert [output_figures(o) for o in outputs] == [1, 1, 1, 0]
