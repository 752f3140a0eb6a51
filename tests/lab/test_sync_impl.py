"""`--sync-impl SLOT=MODULE:FUNCTION` puts your own `_pp_sync` / `writing_check` / `_attn_groups` in every rank
(the exercise's check: test_exercise.py). Your code is bounded: a call that
raises anything (`sys.exit` included) or never returns, and an import that exits, stop the run with an error that
names the `--sync-impl`, in a world of one rank too (with no peer to time out). The launcher never imports your
code (a child process does), and runs even one rank in a process of its own: code that ends its process, or
leaves a thread running, is named, never a hang or an exit 0 without a word."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import textwrap
import time

import pytest

from hicache_lab.config import RunConfig
from hicache_lab.errors import ConfigError
from hicache_lab.lab.binders import run
from hicache_lab.lab.teach.sync_impl import SYNC_IMPLS, SyncImplError, call_bounded, resolve
from hicache_lab.managers.step_trace import read_trace

RELAYS = textwrap.dedent(
    """
    import torch.distributed as dist


    def relay(self, data):
        if self.pp_size <= 1:
            return
        group = self.groups.pp_cache_group
        if self.pp_rank > 0:
            dist.recv(data, group_src=self.pp_rank - 1, group=group, tag=2)
        if self.pp_rank + 1 < self.pp_size:
            self.work_list.append(dist.isend(data.clone(), group_dst=self.pp_rank + 1, group=group, tag=2))
    """
)
MISBEHAVING = textwrap.dedent(
    """
    import sys
    import time


    def leave(self, *args):
        sys.exit(0)


    def interrupt(self, *args):
        raise KeyboardInterrupt


    def fail(self, *args):
        raise ValueError("no relay today")


    def sleep(self, *args):
        time.sleep(3600)
    """
)


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (("relay=m:f",), "--sync-impl slot"),
        (("pp_sync=m",), "SLOT=MODULE:FUNCTION"),
        (("pp_sync=m:f", "pp_sync=m:g"), "slot twice"),
    ],
)
def test_malformed_sync_impl_names_the_flag(specs, message):
    with pytest.raises(ConfigError, match=message):
        SYNC_IMPLS.check(RunConfig().with_lab(sync_impls=specs))  # the grammar, before any import


@pytest.mark.parametrize(
    ("spec", "message"),
    [("pp_sync=no_such_module_here:relay", "cannot import"), ("pp_sync=lab_relays:missing", "has no function")],
)
@pytest.mark.spawns
def test_cli_rejects_a_sync_impl_it_cannot_load_and_exits_2(tmp_path, spec, message):
    (tmp_path / "lab_relays.py").write_text(RELAYS)
    cmd = [sys.executable, "-m", "hicache_lab", "run", "--sync-impl", spec, "--out", str(tmp_path / "out")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "--sync-impl" in result.stderr and message in result.stderr


@pytest.fixture
def misbehaving(tmp_path, monkeypatch):
    """The working directory holds `misbehaving.py` (MISBEHAVING), importable as a --sync-impl module."""
    (tmp_path / "misbehaving.py").write_text(MISBEHAVING)
    (tmp_path / "exits_at_import.py").write_text("import sys\n\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("writing_check=misbehaving:leave", "called sys.exit(0): it must return"),
        ("pp_sync=misbehaving:interrupt", "raised KeyboardInterrupt"),
        ("pp_sync=misbehaving:fail", "raised ValueError: no relay today"),
    ],
)
@pytest.mark.spawns
def test_a_sync_impl_that_raises_or_exits_stops_the_run_naming_it(small_config, misbehaving, spec, said):
    cfg = small_config(enable_hierarchical_cache=True)
    cfg = cfg.with_lab(sync_impls=(spec,))
    summary = run(cfg, misbehaving / "out", verbose=False)  # one rank, in a process of its own
    assert summary["crashed"] and not summary["completed"]
    assert f"SyncImplError: --sync-impl {spec} {said}" in summary["error"]


@pytest.mark.spawns
def test_code_that_ends_its_process_or_leaves_a_thread_is_named(small_config, misbehaving):
    """`os._exit(0)` at import is refused before any rank starts (the launcher lives on to say so); in a call it
    is a crash naming the exit, never a run that ends with exit 0 and nothing said; a non-daemon thread left
    running ends with its rank and is noted, never a run that does not end."""
    (misbehaving / "ends.py").write_text(
        "import os, threading, time\n\ndef now(self, *args):\n    os._exit(0)\n\n"
        "def thread(self, count):\n    threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()\n"
        "    from hicache_lab.mem_cache.hiradix_cache import HiRadixCache\n"
        "    return HiRadixCache.writing_check(self, count)\n"
    )
    (misbehaving / "ends_at_import.py").write_text("import os\n\ndef f(self, data):\n    pass\n\nos._exit(0)\n")
    cfg = small_config(enable_hierarchical_cache=True)

    def with_impl(spec):
        return cfg.with_lab(sync_impls=(spec,))

    with pytest.raises(ConfigError, match="importing it ended the process .exit code 0."):
        run(with_impl("pp_sync=ends_at_import:f"), misbehaving / "out", verbose=False)
    summary = run(with_impl("writing_check=ends:now"), misbehaving / "out", verbose=False)
    assert summary["crashed"] and "rank 0 exited with code 0 (code the rank ran ended its process" in summary["error"]
    summary = run(with_impl("writing_check=ends:thread"), misbehaving / "out", verbose=False)
    assert summary["completed"] and summary["left_behind"]  # one thread for each call
    assert all(re.fullmatch(r"thread 'Thread-\d+ \(sleep\)' of rank 0", left) for left in summary["left_behind"])


@pytest.mark.spawns
def test_a_sync_impl_that_never_returns_fails_after_twice_the_collective_timeout(misbehaving):
    """A world of one rank has no peer whose collective would time out: the bound is the only way out."""
    cmd = [sys.executable, "-m", "hicache_lab", "run", "--enable-hierarchical-cache", "--num-rounds", "2"]
    cmd += ["--collective-timeout", "1", "--sync-impl", "pp_sync=misbehaving:sleep", "--out", "out"]
    started = time.monotonic()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=misbehaving)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "--sync-impl pp_sync=misbehaving:sleep did not return within 2 s (2 x --collective-timeout 1)" in (
        result.stdout
    )
    assert time.monotonic() - started < 60


def test_an_import_that_exits_is_a_configuration_error(misbehaving):  # resolve: what each rank and the child run
    with pytest.raises(ConfigError, match="cannot import 'exits_at_import': its import called sys.exit"):
        resolve(("pp_sync=exits_at_import:f",))


def test_call_bounded_returns_the_value_or_names_what_did_not_return():
    assert call_bounded("adding", 5, "a test", lambda a, b: a + b, 2, 3) == 5
    started = time.monotonic()
    with pytest.raises(SyncImplError, match=r"sleeping did not return within 0.2 s \(a test\)"):
        call_bounded("sleeping", 0.2, "a test", time.sleep, 30)
    assert time.monotonic() - started < 5, "the caller does not wait for the stuck call"


@pytest.mark.spawns
def test_a_right_relay_of_your_own_is_counted_as_the_labs_is(world_config, tmp_path):
    """The step trace counts the relay's sends in `work_list` itself, whoever issued them: a correct relay
    of the student's sends one a step, none left from an earlier step (the lab's own counter saw none of
    them, and called the one held 'from earlier steps')."""
    (tmp_path / "lab_relays.py").write_text(RELAYS)
    cfg = world_config(pp=2, sync_impls=(f"pp_sync={tmp_path / 'lab_relays.py'}:relay",))
    cfg = dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, num_rounds=3))
    summary = run(cfg, tmp_path / "out", verbose=False)
    assert summary["completed"] and not summary["diverged"], summary["error"]
    assert summary["scheduling"]["max_older_relay_sends"] == 0
    assert {row["relay_sent"] for row in read_trace(tmp_path / "out") if row["rank"] == 0} == {1}
