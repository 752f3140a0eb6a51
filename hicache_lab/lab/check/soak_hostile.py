"""`soak --hostile`: the hostile-input suite (exit code, message, no process left, no file touched), which is a
test suite of the repository's (tests/hostile/) rather than part of the package: found from the package's path in
a source checkout and loaded from there (`suite`), and refused, exit 2, where the package is installed without it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from ...errors import ConfigError

CHECKOUT = Path(__file__).resolve().parents[3]  # the repository, where the package runs from a source checkout


def add_hostile_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hostile",
        action="store_true",
        help="run every hostile-input case (tests/hostile/ of a source checkout) instead",
    )
    parser.add_argument("--table", action="store_true", help="with --hostile: print the README's table, run nothing")


def suite(checkout: Path) -> ModuleType:
    """tests/hostile/command.py of `checkout`, imported as `hostile.command` (as pytest imports it: tests/ has no
    __init__.py); a ConfigError where `checkout` lacks it."""
    where = checkout / "tests" / "hostile"
    if not (where / "command.py").is_file():
        raise ConfigError(
            f"soak --hostile runs the hostile-input suite of a source checkout, and {where} is not there (the "
            "package is installed without its tests): clone the repository and run it from there"
        )
    if "hostile" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "hostile", where / "__init__.py", submodule_search_locations=[str(where)]
        )
        sys.modules["hostile"] = package = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(package)
    return importlib.import_module("hostile.command")


def cmd_hostile(args: argparse.Namespace) -> int:
    """Every hostile-input case, or with `--table` their table (tests/hostile/command.py does either)."""
    return suite(CHECKOUT).cmd_hostile(args)
