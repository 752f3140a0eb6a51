"""Budgets that serve ideas, checked on the source's syntax trees: a function is at most `FUNCTION_LINES` lines; a file
of code at most `FILE_LINES` of its room (a file of pure data may be longer); each room of the house at most
`ROOM_LINES`; a class stays in one file, so a class other classes inherit from has its own constructor and state,
or defines what its methods read (a contract), never a mixin whose methods call back into their host. The same
checks are shown to catch each kind of breach in a small package written for the purpose."""

from __future__ import annotations

import ast
from pathlib import Path

from test_layering import CORE, LAYERS, _module_name, _part, write

import hicache_lab

GROUND = (*LAYERS[: LAYERS.index("distributed")], "__main__")  # the ground: below the core, and the CLI
ROOMS = {"core": CORE, "ground": GROUND, "entrypoints": ("entrypoints",), "wing": ("lab", "api")}
ROOM_LINES = {"core": 5500, "ground": 1600, "entrypoints": 2250, "wing": 9000}
FILE_LINES = {"core": 500, "ground": 400}  # by room; any other file of code: MAX_LINES
MAX_LINES = 300
FUNCTION_LINES = 60
CHECKED = ("hicache_lab", "bench", "tests", "examples")  # the budgets' folders, from the repository's root


def is_data(tree: ast.Module) -> bool:
    """A module of pure data: a docstring, imports and assignments of values, no function or class."""
    kinds = (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign, ast.Expr)
    return all(isinstance(node, kinds) for node in tree.body) and not any(
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)) for node in ast.walk(tree)
    )


def _room_of(root: Path, path: Path) -> str | None:
    """The room (`ROOMS`) of a file of the package at `root`; None outside it."""
    if root not in path.parents:
        return None
    part = _part(root, _module_name(root, path))
    return next(room for room, parts in ROOMS.items() if part in parts)


def too_long(root: Path, folders: tuple[str, ...] = CHECKED) -> list[str]:
    """Every file of code under `root`'s `folders` over its room's budget (`FILE_LINES`, else MAX_LINES), and
    every function over FUNCTION_LINES."""
    found, package = [], root / "hicache_lab"
    for path in sorted(p for folder in folders for p in (root / folder).rglob("*.py")):
        text, where = path.read_text(), path.relative_to(root)
        tree = ast.parse(text)
        most = FILE_LINES.get(_room_of(package, path), MAX_LINES)
        if (lines := len(text.splitlines())) > most and not is_data(tree):
            found.append(f"{where}: {lines} lines of code (at most {most}; split it by idea)")
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in functions:
            if (length := node.end_lineno - node.lineno + 1) > FUNCTION_LINES:
                found.append(f"{where}:{node.lineno}: {node.name} is {length} lines (at most {FUNCTION_LINES})")
    return found


def room_lines(package: Path) -> dict[str, int]:
    """Lines of code in each room of the package."""
    lines = dict.fromkeys(ROOMS, 0)
    for path in package.rglob("*.py"):
        lines[_room_of(package, path)] += len(path.read_text().splitlines())
    return lines


def over_budget(package: Path, budgets: dict[str, int] = ROOM_LINES) -> list[str]:
    """Every room over its budget."""
    return [
        f"{room}: {lines} lines (at most {budgets[room]}: move what is not this room's idea, or make it smaller)"
        for room, lines in room_lines(package).items()
        if lines > budgets[room]
    ]


def mixins(root: Path) -> list[str]:
    """Every class of the package that another of its classes inherits from, that has no constructor of its own
    (`__init__`, or a dataclass's) and whose methods read attributes of `self` it does not define: a part of a
    class split off into another file, whose methods call back into their host."""
    classes, bases = {}, set()
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = (path, node)
                bases |= {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
    found = []
    for name in sorted(bases & set(classes)):
        path, node = classes[name]
        if not _has_constructor(node) and (borrowed := _borrowed(node)):
            where = f"{path.relative_to(root.parent)}:{node.lineno}"
            found.append(f"{where}: {name} is a mixin (its host's {', '.join(borrowed)}): fold it into its class")
    return found


def _has_constructor(node: ast.ClassDef) -> bool:
    inits = any(isinstance(n, ast.FunctionDef) and n.name == "__init__" for n in node.body)
    decorators = {getattr(d, "id", getattr(getattr(d, "func", None), "id", "")) for d in node.decorator_list}
    return inits or "dataclass" in decorators


def _borrowed(node: ast.ClassDef) -> list[str]:
    """The attributes of `self` the class's methods read that its body does not define (a bare annotation, which
    only declares the host's attribute, defines nothing)."""
    defined = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    defined |= {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    defined |= {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and n.value is not None}
    read = {
        n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
    }
    return sorted(a for a in read - defined if not a.startswith("__"))


def test_no_file_function_or_room_is_over_its_budget_and_no_class_is_split():
    package = Path(hicache_lab.__file__).parent
    assert too_long(package.parent) == []
    assert over_budget(package) == [], room_lines(package)
    assert mixins(package) == []


def test_the_budgets_catch_a_long_function_file_or_room_and_a_mixin(tmp_path):
    root = tmp_path / "hicache_lab"
    body = "    x = 1\n" * (FUNCTION_LINES - 1)
    files = {
        "__init__.py": "",
        "managers/__init__.py": "",
        "managers/fits.py": "def f():\n" + body + "x = 1\n" * 400,  # a core file may reach 500 lines
        "managers/long.py": "def h():\n    pass\n" + "x = 1\n" * (FILE_LINES["core"] - 1),
        "managers/table.py": "ROWS = [\n" + "    (1, 'a'),\n" * 600 + "]\n",  # data: it may be longer
        "lab/__init__.py": "",
        "lab/long.py": "def g():\n" + body + "    x = 2\n" + "x = 1\n" * MAX_LINES,
        "mem_cache/__init__.py": "",
        "mem_cache/tree.py": "class Tree(Evictable):\n    def __init__(self):\n        self.root = None\n",
        "mem_cache/evictable.py": "class Evictable:\n    def leaves(self):\n        return [self.root]\n",
        "mem_cache/contract.py": "class Base:\n    name = ''\n    def say(self):\n        return self.name\n",
        "mem_cache/kind.py": "class Kind(Base):\n    pass\n",
    }
    write(root, files)
    assert too_long(tmp_path, ("hicache_lab",)) == [
        f"hicache_lab/lab/long.py: {FUNCTION_LINES + MAX_LINES + 1} lines of code (at most {MAX_LINES}; split it "
        "by idea)",
        f"hicache_lab/lab/long.py:1: g is {FUNCTION_LINES + 1} lines (at most {FUNCTION_LINES})",
        f"hicache_lab/managers/long.py: {FILE_LINES['core'] + 1} lines of code (at most {FILE_LINES['core']}; split it "
        "by idea)",
    ]
    assert mixins(root) == [
        "hicache_lab/mem_cache/evictable.py:1: Evictable is a mixin (its host's root): fold it into its class"
    ]  # Base defines what its methods read: a contract, not a mixin
    lines = room_lines(root)
    assert over_budget(root, {**ROOM_LINES, "core": lines["core"] - 1}) == [
        f"core: {lines['core']} lines (at most {lines['core'] - 1}: move what is not this room's idea, or make it "
        "smaller)"
    ]
