"""SGLang's source beside the lab's: its own synchronization methods (notebooks 02 and 03, where sglang 0.5.23 is
installed: `make` installs it, and cpu.py lets it import beside a CPU torch).

SGLang moved HiCache between releases (`mem_cache/hiradix_cache.py`; in 0.5.23 `mem_cache/unified_radix_cache.py`),
so methods are looked up by name in every class of the modules that exist."""

from __future__ import annotations

import html
import importlib
import inspect

from .cpu import SGLANG_VERSION, prepare_imports, quiet_imports

SGLANG_MODULES = (
    "sglang.srt.mem_cache.hiradix_cache",
    "sglang.srt.mem_cache.unified_radix_cache",
    "sglang.srt.managers.cache_controller",
)


def sglang_methods(names: tuple[str, ...]) -> dict[str, str] | None:
    """{"module.Class.method": source} for every method called one of `names`; None without sglang 0.5.23."""
    try:
        prepare_imports()
    except RuntimeError:
        return None
    found = {}
    with quiet_imports():
        for module_name in SGLANG_MODULES:
            try:
                module = importlib.import_module(module_name)
            except Exception:  # a module of another release, or one needing a GPU at import
                continue
            for class_name, cls in inspect.getmembers(module, inspect.isclass):
                for name in names:
                    if cls.__module__ == module_name and name in vars(cls):
                        found[f"{module_name}.{class_name}.{name}"] = inspect.getsource(vars(cls)[name])
    return found


def side_by_side(ours: list, names: tuple[str, ...]) -> str:
    """HTML: the lab's functions on the left, SGLang's methods of those names on the right (or why not)."""
    left = "\n\n".join(inspect.getsource(fn) for fn in ours)
    theirs = sglang_methods(names)
    if theirs is None:
        right = f"sglang {SGLANG_VERSION} is not installed here: its source is skipped.\n(make installs it.)"
    else:
        right = "\n\n".join(f"# {where}\n{source}" for where, source in theirs.items()) or f"no method named {names}"
    pre = '<pre style="font-size:11px;font-family:monospace;white-space:pre">{}</pre>'
    cell = f'<td style="vertical-align:top;text-align:left">{pre}</td>'
    return (
        "<table><tr><th>hicache_lab</th><th>SGLang</th></tr><tr>"
        + cell.format(html.escape(left))
        + cell.format(html.escape(right))
        + "</tr></table>"
    )
