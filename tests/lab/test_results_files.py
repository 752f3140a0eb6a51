"""What `soak` and `figures` write, in this process: by default nothing committed (bench/results, figures/);
the soak's hand-written notes kept, an older CSV refused rather than appended to misaligned, an async batch
depth in its draw; a figures directory that cannot be written refused before any run."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from hicache_lab.errors import ConfigError
from hicache_lab.lab.check.soak import add_soak_flags, check_soak_args, draw_case
from hicache_lab.lab.check.soak_results import read_rows, write_table
from hicache_lab.lab.figures.regenerate import add_figures_flags, cmd_figures
from hicache_lab.lab.presets import BENCH_RESULTS


def soak_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_soak_flags(parser)
    return parser.parse_args(list(argv))


def figures_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_figures_flags(parser)
    return parser.parse_args(list(argv))


def test_the_draw_runs_pipelines_with_an_async_batch_depth():
    cases = [draw_case(1, i, 4) for i in range(200)]
    depths = {c.depth for c in cases if c.pp > 1}
    assert depths == {0, 1, 2} and {c.depth for c in cases if c.pp == 1} == {0}
    deep = next(c for c in cases if c.depth == 2)
    assert deep.args("fixed")[deep.args("fixed").index("--pp-async-batch-depth") + 1] == "2"


def test_by_default_nothing_committed_is_written():
    args = soak_args()
    assert not Path(args.results).is_relative_to(BENCH_RESULTS) and Path(args.out).parts[0] == "runs"
    assert Path(figures_args().out).parts[0] == "runs"


def test_quick_figures_never_replace_the_committed_ones(tmp_path):
    with pytest.raises(ConfigError, match="--quick --out figures: the README describes the full workload"):
        cmd_figures(figures_args("--quick", "--out", "figures", "--runs", str(tmp_path)))


def test_an_unwritable_figures_directory_is_refused_before_any_run(tmp_path):
    (tmp_path / "taken").write_text("a file, not a directory")
    with pytest.raises(ConfigError, match="figures --out"):
        cmd_figures(figures_args("--quick", "--out", str(tmp_path / "taken" / "figs"), "--runs", str(tmp_path)))


def test_a_limit_no_run_can_meet_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="--limit-s 2: .*healthy runs as hangs"):
        check_soak_args(soak_args("--limit-s", "2", "--out", str(tmp_path), "--results", str(tmp_path)))


def test_the_tables_are_rewritten_and_the_notes_kept(tmp_path):
    md = tmp_path / "soak.md"
    md.write_text("# Soak: 1 runs\n\nold table\n\n## Notes\n\nCases 0-9 ran on 16 CPUs.\n")
    row = {"mode": "fixed", "ranks": "2", "fault": "", "fault_fired": "False", "paused": "", "chunks": "3"}
    row |= {"retractions": "0", "diverged": "False", "crashed": "False", "hung": "True", "mismatched": "False"}
    write_table(md, [row, row], ["fixed"], "`soak ...`")
    text = md.read_text()
    assert text.startswith("# Soak: 2 runs") and "old table" not in text and "| fixed | 2 | 0 | 0 | 2 |" in text
    assert text.endswith("## Notes\n\nCases 0-9 ran on 16 CPUs.\n")


def test_a_csv_of_other_columns_is_refused(tmp_path):
    old = tmp_path / "soak.csv"
    old.write_text("case,mode\n0,fixed\n")
    with pytest.raises(ConfigError, match="another version of the soak .*columns missing: depth"):
        read_rows(old, ["case", "mode", "depth"])
    assert read_rows(tmp_path / "none.csv", ["case"]) == []
