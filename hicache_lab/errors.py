"""The lab's own errors, each with a message that says what to change, and the checks that raise a
`ConfigError` (`require`, `require_choice`, `require_numbers`, `require_seed`) for the config dataclasses."""

from __future__ import annotations

import math
import numbers
from dataclasses import fields


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the flag to change."""


class PoolExhaustedError(RuntimeError):
    """A pool has no room left even after eviction."""


class CopyChecksumError(RuntimeError):
    """A host copy's destination does not hold what its source held: the copy was torn or misplaced."""


class ConsensusError(RuntimeError):
    """Ranks hold different values of a quantity that must be identical on all of them."""


class AllocationError(RuntimeError):
    """A rank cannot allocate slots for a copy its peers agreed to start."""


class StallError(RuntimeError):
    """Requests wait, nothing runs, and the copies in flight are never acknowledged: the run cannot progress."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def require_choice(value: str, choices: tuple[str, ...], flag: str) -> None:
    require(value in choices, f"unknown {flag} {value!r}: use one of {', '.join(choices)}")


def require_numbers(section: object) -> None:
    """Every `int` field holds an integer (not a bool) and every `float` field a finite number. The flags' types
    ensure it on the command line (args.py); this refuses a config built in Python, by field name
    (nan passes every `>=` check below)."""
    for f in fields(section):
        value, name = getattr(section, f.name), f"{type(section).__name__}.{f.name}"
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if f.type == "int" and not (number and isinstance(value, numbers.Integral)):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        if f.type == "float" and not (number and math.isfinite(value)):
            raise ConfigError(f"{name} must be a finite number, got {value!r}")


def require_seed(value: int, flag: str) -> None:
    require(0 <= value < 2**63, f"{flag} {value} must be in 0..2**63-1 (numpy's and torch's generators take those)")
