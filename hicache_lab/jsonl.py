"""JSON input, checked: `read_jsonl` gives every line of a file as an object, and `read_json` a whole file's
value, or a ConfigError naming the flag that gave the file, the line and what is wrong with it; `is_integer` and
`is_number` check a field's value as JSON means it. Mooncake traces, conversation files, replayed requests,
bench_multiturn logs and recorded cache operations are read through it."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .errors import ConfigError


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite(text: str) -> float:
    if not math.isfinite(value := float(text)):
        raise ValueError(f"{text} is beyond a double")
    return value


def _file(path: str, flag: str) -> Path:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{flag} {path}: no such file" if not file.exists() else f"{flag} {path}: not a file")
    return file


def _decode(raw: bytes, where: str, needs: str, whole: bool = False) -> object:
    """JSON text as a value, or a ConfigError at `where` (in a `whole` file, at its line); NaN, Infinity and
    numbers beyond a double are refused too (Python's json takes them)."""
    try:
        return json.loads(raw.decode(), parse_constant=_no_constant, parse_float=_finite)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    except RecursionError as e:
        raise ConfigError(f"{where}: nested too deeply to be a record") from e
    except ValueError as e:  # json.JSONDecodeError, or a constant or float refused above
        reason = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
        at = f" at line {e.lineno}" if isinstance(e, json.JSONDecodeError) and whole else ""
        raise ConfigError(f"{where}: not JSON ({reason}{at}); the file needs {needs}") from e


def read_jsonl(path: str, flag: str) -> list[tuple[int, dict]]:
    """(line number, object) for every non-blank line; a ConfigError naming `flag` and the line otherwise."""
    rows = []
    with _file(path, flag).open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            row = _decode(raw, f"{flag} {path}:{number}", "one object per line")
            if not isinstance(row, dict):
                raise ConfigError(f"{flag} {path}:{number}: expected a JSON object, got {type(row).__name__}")
            rows.append((number, row))
    if not rows:
        raise ConfigError(f"{flag} {path}: the file holds no lines")
    return rows


def read_json(path: str, flag: str) -> object:
    """The value of a whole JSON file; a ConfigError naming `flag` and what is wrong otherwise."""
    return _decode(_file(path, flag).read_bytes(), f"{flag} {path}", "one JSON value", whole=True)


def is_integer(value: object) -> bool:
    """A JSON integer: Python's bool is an int, JSON's true is not."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
