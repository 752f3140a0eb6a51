"""`--sync-impl SLOT=MODULE:FUNCTION` puts your own `_pp_sync` / `writing_check` in every rank; the exercise
check fails a relay that forgets to pass the count on and passes the right one."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from hicache_lab.config import ParallelConfig
from hicache_lab.errors import ConfigError
from hicache_lab.lab.exercise import check

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


    def keep_to_yourself(self, data):
        pass  # every later stage keeps the zeros it polled for itself
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
        ParallelConfig(sync_impls=specs)


@pytest.mark.parametrize(
    ("spec", "message"),
    [("pp_sync=no_such_module_here:relay", "cannot import"), ("pp_sync=lab_relays:missing", "has no function")],
)
def test_cli_rejects_a_sync_impl_it_cannot_load_and_exits_2(tmp_path, spec, message):
    (tmp_path / "lab_relays.py").write_text(RELAYS)
    cmd = [sys.executable, "-m", "hicache_lab", "run", "--sync-impl", spec, "--out", str(tmp_path / "out")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "--sync-impl" in result.stderr and message in result.stderr


def test_exercise_check_fails_a_relay_that_keeps_the_count_and_passes_the_right_one(tmp_path, monkeypatch):
    (tmp_path / "student_relays.py").write_text(RELAYS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    wrong = check(("pp_sync=student_relays:keep_to_yourself",), tmp_path / "wrong", pps=(2,))
    assert not wrong.ok
    assert "stage 1 consumed 0 write acks" in str(wrong) and "FAILED" in str(wrong)
    right = check(("pp_sync=student_relays:relay",), tmp_path / "right", pps=(2, 3))
    assert right.ok, str(right)
