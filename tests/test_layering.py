"""The package's layers (docs/architecture.md), checked on the source's syntax trees: each part imports only from
the parts below it, the core never imports `entrypoints/` or `lab/`, only the two ways in, `api` and `__main__`,
import `lab/`, the lab's rooms import only from the rooms below them (`WING`), there is no import cycle, no import
of the package's own modules hides inside a function (where it would dodge a cycle), and the core never reads the
lab's section of the configuration (`cfg.lab`). The same check is shown to catch each kind of violation in a small
package written for the purpose; the budgets are test_budgets.py's."""

from __future__ import annotations

import ast
from pathlib import Path

import hicache_lab

LAYERS = (  # bottom up
    "__init__",
    "errors",
    "jsonl",
    "mooncake_trace",
    "workload_files",
    "parallel_config",
    "config",
    "provenance",
    "args",
    "distributed",
    "mem_cache",
    "model",
    "managers",
    "entrypoints",
    "lab",
    "api",
    "__main__",
)


LAB_USERS = ("lab", "api", "__main__")  # the parts that may import lab/: the wing itself and the two ways in
WING = ("__init__", "plugins", "presets", "sglang", "check", "teach", "figures", "binders")  # lab/'s rooms, bottom up
CORE = ("distributed", "mem_cache", "model", "managers")


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(root: Path, module: str) -> str:
    """The layer a module belongs to: its subpackage, or the top-level module itself."""
    rest = module.split(".")[1:]
    if not rest:
        return "__init__"
    return rest[0]


def _imports(root: Path, path: Path) -> list[tuple[str, bool, int]]:
    """(imported module of the package, whether at module level, line) for every import in `path`."""
    module = _module_name(root, path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [f"{target}.{alias.name}" for alias in node.names]  # a module, or a name in one
        for target in targets:
            if target == root.name or target.startswith(root.name + "."):
                found.append((target, id(node) in top, node.lineno))
    return found


def _room(module: str) -> str | None:
    """The lab room a module belongs to (None outside lab/)."""
    parts = module.split(".")[1:]
    return (parts[1] if len(parts) > 1 else "__init__") if parts[:1] == ["lab"] else None


def violations(root: Path) -> list[str]:
    """Every breach of the layering rules in the package at `root`."""
    found, graph = [], {}
    modules = {_module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    for module, path in modules.items():
        mine = _part(root, module)
        graph[module] = set()
        if mine in CORE:
            found += [f"{path.relative_to(root.parent)}:{n}: the core reads cfg.lab" for n in _lab_reads(path)]
        for target, at_top, line in _imports(root, path):
            if target not in modules:  # `from .module import name`: the module is one up
                target = target.rpartition(".")[0]
            theirs = _part(root, target)
            where = f"{path.relative_to(root.parent)}:{line}"
            if not at_top:
                found.append(f"{where}: import of {target} inside a function")
            if LAYERS.index(theirs) > LAYERS.index(mine):
                found.append(f"{where}: {mine} imports {target}, a layer above it")
            if theirs == "lab" and mine not in LAB_USERS:
                found.append(f"{where}: {mine} imports lab tooling ({target})")
            if mine == theirs == "lab" and WING.index(_room(target)) > WING.index(_room(module)):
                found.append(f"{where}: lab room {_room(module)} imports {target}, a room above it")
            if target in modules and target != module and at_top:
                graph[module].add(target)
    found += [f"import cycle: {' -> '.join(cycle)}" for cycle in _cycles(graph)]
    return found


def _lab_reads(path: Path) -> list[int]:
    """The line of every read of an attribute `lab` (the configuration's lab section) in `path`."""
    tree = ast.parse(path.read_text())
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "lab"]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_every_part_imports_only_from_below():
    root = Path(hicache_lab.__file__).parent
    assert violations(root) == []
    modules = [_module_name(root, p) for p in root.rglob("*.py")]
    assert {_part(root, m) for m in modules} <= set(LAYERS)
    assert {_room(m) for m in modules} - {None} <= set(WING)


def test_the_check_catches_an_upward_import_a_cycle_and_a_hidden_import(tmp_path):
    root = tmp_path / "hicache_lab"
    files = {
        "__init__.py": "",
        "errors.py": "",
        "config.py": "def f():\n    from .errors import ConfigError\n",
        "mem_cache/__init__.py": "",
        "mem_cache/a.py": "from ..entrypoints import b\n",
        "entrypoints/__init__.py": "",
        "entrypoints/b.py": "from ..mem_cache import a\nfrom ..lab import tour\n",
        "lab/__init__.py": "",
        "lab/tour.py": "",
        "lab/check/__init__.py": "",
        "lab/check/zoo.py": "from ..figures import draw\n",
        "lab/figures/__init__.py": "",
        "lab/figures/draw.py": "",
        "managers/__init__.py": "",
        "managers/loop.py": "def f(cfg):\n    return cfg.lab.fault\n",
        "api.py": "from .lab import tour\n",  # a way in: it may
    }
    write(root, files)
    found = violations(root)
    assert any("config.py:2: import of hicache_lab.errors inside a function" in v for v in found), found
    assert any("mem_cache imports hicache_lab.entrypoints.b, a layer above it" in v for v in found), found
    assert any("entrypoints imports lab tooling" in v for v in found), found
    assert any(v.startswith("import cycle:") and "hicache_lab.mem_cache.a" in v for v in found), found
    assert any("lab room check imports hicache_lab.lab.figures.draw, a room above it" in v for v in found), found
    assert any("hicache_lab/managers/loop.py:2: the core reads cfg.lab" in v for v in found), found
    assert not any("api.py" in v for v in found), found


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
