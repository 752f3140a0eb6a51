"""SGLang's releases as a rank's cache: `--cache-impl sglang==X` runs release X's own HiCache in every rank.

Each release the lab runs is installed beside the venv, `--no-deps`, in a directory of its own
(`.releases/sglang-X`, or under `$HICACHE_LAB_RELEASES`: `make releases`), and a rank that runs it puts that
directory first on `sys.path` before anything imports sglang: a process holds one release (two sglang packages
cannot share one). sglang 0.5.23, the lab's reference, is the venv's own (`--cache-impl sglang`).

A release is driven through the adapter of its API generation (`hiradix.py`: `HiRadixCache(params,
server_args)`, 0.5.10 to 0.5.18; cache.py and rank_cache.py: `UnifiedRadixCache` and `init_hicache`, 0.5.22 and
0.5.23) after the import shims it needs (shims.py): what each bridges is named there. 0.5.19 to 0.5.21, a
`UnifiedRadixCache` without 0.5.22's `path_device_indices` and `checkpoint`, have no adapter yet. What a release
changed in how ranks agree, and the PR, is its `landed` (read from its code: docs/fidelity.md, "SGLang's
releases in the lab's worlds").
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import shims
from .cpu import prepare_imports, quiet_imports

REFERENCE = "0.5.23"  # `--cache-impl sglang`: the venv's sglang, the release the lab's own code follows


@dataclass(frozen=True)
class Release:
    version: str
    generation: str  # "hiradix" (HiRadixCache, hiradix.py) or "unified" (UnifiedRadixCache, cache.py)
    label: str  # what landed, in a few words (the release matrix's column)
    landed: str  # what changed in this release in how ranks agree, with its PR ("" where nothing did)
    shims: tuple[Callable[[], None], ...] = ()  # run in this order, after sys.path and before sglang imports
    pins: tuple[str, ...] = ("einops==0.8.2",)  # what it imports beyond the venv: installed beside it, --no-deps


OLD_KERNELS = (shims.kernel_stand_ins, shims.unpinned_host_memory)  # 0.5.10-0.5.12 import sgl_kernel on CPU
GUARDED = (shims.configs_registered_twice, shims.direct_copy_global, shims.unpinned_host_memory)  # 0.5.13 on
XGRAMMAR = ("einops==0.8.2", "xgrammar==0.2.1")  # 0.5.16 on: server_args reaches xgrammar (function calling)
RELEASES = {
    r.version: r
    for r in (
        Release(
            "0.5.10",
            "hiradix",
            "before the fixes",
            "before the fixes: write acks MIN over the TP group (CP peers in it unless DP attention), load acks "
            "not agreed, no PP relay, an early return",
            OLD_KERNELS,
        ),
        Release(
            "0.5.11",
            "hiradix",
            "#20460 CP groups",
            "#20460: the attention-CP and attention-TP groups agree (CP peers always)",
            (shims.configs_registered_twice, *OLD_KERNELS),
        ),
        Release(
            "0.5.12",
            "hiradix",
            "nothing across ranks",
            "nothing across ranks: the last release without the PP relay",
            (shims.configs_registered_twice, *OLD_KERNELS),
        ),
        Release(
            "0.5.13",
            "hiradix",
            "#27285 PP relay, polled sends",
            "#27285: PP rank 0's counts relayed down the pipeline, load acks agreed; relay sends reaped by polling "
            "(#28902's leak)",
            GUARDED,
        ),
        Release(
            "0.5.14",
            "hiradix",
            "no early return",
            "the early return in writing_check removed (every rank calls the collective every step)",
            GUARDED,
        ),
        Release("0.5.15", "hiradix", "#28916 sends drained", "#28916: relay sends drained at every check", GUARDED),
        Release("0.5.16", "hiradix", "nothing across ranks", "nothing across ranks", GUARDED, XGRAMMAR),
        Release("0.5.17", "hiradix", "nothing across ranks", "nothing across ranks", GUARDED, XGRAMMAR),
        Release(
            "0.5.18",
            "hiradix",
            "nothing across ranks",
            "nothing across ranks (the last HiRadixCache release)",
            GUARDED,
            XGRAMMAR,
        ),
        Release(
            "0.5.22",
            "unified",
            "UnifiedRadixCache",
            "UnifiedRadixCache (from 0.5.19), with 0.5.23's API: the PP group in the prefetch groups (#27010)",
            pins=(),
        ),
        Release(
            REFERENCE,
            "unified",
            "the reference",
            "the reference: the lab's own code follows it",
            pins=(),
        ),
    )
}


def parse(impl: str) -> str | None:
    """The release `--cache-impl` names: None for the lab's cache, "0.5.23" for `sglang`, X for `sglang==X`.
    Raises ValueError, naming the releases, for a release the lab has no adapter for."""
    if impl == "lab":
        return None
    if impl == "sglang":
        return REFERENCE
    version = impl.removeprefix("sglang==")
    if version == impl or version not in RELEASES:
        raise ValueError(
            f"--cache-impl {impl}: choose lab, sglang (sglang {REFERENCE}), or sglang==X for a release the lab "
            f"runs: {', '.join(RELEASES)}"
        )
    return version


def generation(impl: str) -> str | None:
    """The API generation of `--cache-impl impl`'s release ("hiradix", "unified"), None for the lab's cache."""
    version = parse(impl)
    return RELEASES[version].generation if version is not None else None


def releases_root() -> Path:
    """Where releases are installed: $HICACHE_LAB_RELEASES, else `.releases` beside the lab's source tree."""
    configured = os.environ.get("HICACHE_LAB_RELEASES")
    return Path(configured) if configured else Path(__file__).resolve().parents[3] / ".releases"


def release_dir(version: str) -> Path:
    return releases_root() / f"sglang-{version}"


def installed_version(version: str) -> str | None:
    """The sglang version installed in `version`'s directory (the venv's, for the reference), or None."""
    paths = sys.path if version == REFERENCE else [str(release_dir(version))]
    if version != REFERENCE and not Path(paths[0]).is_dir():
        return None
    found = next(iter(importlib.metadata.distributions(name="sglang", path=paths)), None)
    return found.version if found is not None else None


def pin_dir(pin: str) -> Path:
    """Where a release's pinned import is installed, shared by the releases that pin it."""
    return releases_root() / "pins" / pin.replace("==", "-")


def missing(version: str) -> str | None:
    """Why release `version` cannot run here, saying how to install it; None where it can."""
    found = installed_version(version)
    absent = [pin for pin in RELEASES[version].pins if not pin_dir(pin).is_dir()]
    if found == version and not absent:
        return None
    where = "the venv" if version == REFERENCE else str(release_dir(version))
    what = f"sglang {found} is in {where}" if found else f"sglang {version} is not installed in {where}"
    if found == version:
        what = f"sglang {version}'s pinned imports {', '.join(absent)} are not installed in {pin_dir('').parent}"
    how = "make installs it" if version == REFERENCE else f"make releases RELEASES={version} installs it"
    return f"{what}: {how}"


def installed() -> list[str]:
    """The releases that can run here, oldest first."""
    return [version for version in RELEASES if missing(version) is None]


def activate(version: str) -> Release:
    """Make this process import release `version`'s sglang (its directory first on sys.path), and run its import
    shims. RuntimeError where it cannot: not installed, or another sglang imported already."""
    release = RELEASES[version]
    reason = missing(version)
    if reason is not None:
        raise RuntimeError(reason)
    if version != REFERENCE:
        directory = str(release_dir(version))
        loaded = sys.modules.get("sglang")
        if loaded is not None and not str(loaded.__file__).startswith(directory):
            raise RuntimeError(f"this process imported sglang from {loaded.__file__}: one release per process")
        if directory not in sys.path:
            sys.path[:0] = [directory, *(str(pin_dir(pin)) for pin in release.pins)]
    prepare_imports(version)
    with quiet_imports():
        for shim in release.shims:
            shim()
    return release


def install(version: str) -> None:
    """Install release `version` and its pins, each with `pip install --no-deps --target`, into a scratch
    directory renamed into place when whole: a directory present is complete. CalledProcessError if pip fails."""
    targets = [(f"sglang=={version}", release_dir(version)), *((p, pin_dir(p)) for p in RELEASES[version].pins)]
    for spec, target in targets:
        if target.is_dir():
            continue
        scratch = target.with_name(f"{target.name}.partial")
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.parent.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(scratch), spec]
        subprocess.run(pip, check=True)
        scratch.rename(target)


def main(argv: list[str]) -> int:
    """`python -m hicache_lab.lab.sglang.releases [--best-effort] X ...` (`make releases`): install releases.
    With --best-effort a release pip cannot install is said and skipped (its runs are refused, its tests skip)."""
    best_effort = "--best-effort" in argv
    versions = [v for v in argv if v != "--best-effort"]
    if unknown := [v for v in versions if v not in RELEASES or v == REFERENCE]:
        print(f"the lab runs releases {', '.join(v for v in RELEASES if v != REFERENCE)}, not {', '.join(unknown)}")
        return 2
    failed = []
    for version in versions:
        try:
            install(version)
        except subprocess.CalledProcessError as exc:
            failed.append(version)
            print(f"sglang {version} is not installable here (pip exit {exc.returncode}): its runs are refused")
    return 1 if failed and not best_effort else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
