"""SGLang's own source beside the lab's (notebooks 02 and 06) is read from the installed sglang 0.5.23, which
imports beside the CPU torch through lab/sglang/cpu.py. Run in a fresh interpreter: importing sglang loads much
of its model code, which the rest of the suite should not share."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hicache_lab.lab.sglang.cpu import SGLANG_VERSION, sglang_version

pytestmark = pytest.mark.spawns

NAMES = ("_pp_sync", "_all_reduce", "writing_check", "loading_check", "_create_sync_groups")


def found_in_a_fresh_interpreter(names: tuple[str, ...]) -> dict[str, int]:
    code = (
        "import json, sys; from hicache_lab.lab.sglang.source import sglang_methods; "
        f"found = sglang_methods({names!r}); print(json.dumps({{k: len(v) for k, v in (found or {{}}).items()}}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Only CUDA" not in done.stderr, "the quantization warnings of sglang's import were not silenced"
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(
    sglang_version() != SGLANG_VERSION, reason=f"sglang {SGLANG_VERSION} is not installed (make installs it)"
)
def test_sglang_s_own_sync_methods_are_read_from_the_installed_release():
    found = found_in_a_fresh_interpreter(NAMES)
    unified = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
    for name in ("_pp_sync", "_all_reduce", "writing_check", "loading_check"):
        assert found.get(f"{unified}.{name}", 0) > 200, f"{unified}.{name} not found: {sorted(found)}"
    assert "sglang.srt.managers.cache_controller.HiCacheController._create_sync_groups" in found
