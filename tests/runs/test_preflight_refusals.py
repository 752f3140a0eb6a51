"""What the configuration alone cannot check is refused before any rank starts, naming what to change: this
machine's memory, directories that cannot be written, stale torchrun variables, Mooncake where it cannot run,
and the exhaustive check's work past its bound. A refusal that a fast class-10 hostile case checks through the
CLI (tests/hostile/test_hostile.py: exit code, message, no file touched) is not repeated here."""

from __future__ import annotations

import itertools
import os
import re
import socket
import time

import pytest

from hicache_lab.config import CacheConfig, RunConfig
from hicache_lab.entrypoints import preflight
from hicache_lab.entrypoints.preflight import check_writable_dir, memory_needed
from hicache_lab.errors import ConfigError


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--enable-hierarchical-cache", "--hicache-size", "0.00001"], "raise --hicache-size"),
        (["--enable-hierarchical-cache", "--hicache-storage-backend=file", "--hicache-storage-dir={file}"], "a file"),
    ],
)
def test_what_only_the_launcher_can_check_still_fails_before_any_rank_starts(args, message, tmp_path, capsys):
    from hicache_lab.__main__ import main

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert main(["run", *(a.format(file=a_file) for a in args)]) == 2
    assert message.format(file=a_file) in capsys.readouterr().err


@pytest.mark.spawns  # mooncake_missing probes the import in a process of its own
def test_mooncake_where_it_cannot_run_is_refused_before_any_rank_starts(tmp_path, capsys):
    """Where Mooncake cannot run (its package or the system library libibverbs1 missing), a run on it is refused
    naming what to install; where it can, the same flags pass the check that refuses them."""
    from hicache_lab.__main__ import main
    from hicache_lab.mem_cache.mooncake_store import mooncake_missing

    flags = ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake"]
    if why := mooncake_missing():
        assert main(["run", *flags, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert "--hicache-storage-backend mooncake: `import mooncake.store` fails here" in err, err
        assert "libibverbs1" in err and "pip install mooncake-transfer-engine-non-cuda" in err and why in err
        assert not (tmp_path / "out").exists()  # refused before the run claimed its directory
    else:
        cfg = RunConfig(cache=CacheConfig(enable_hierarchical_cache=True, storage_backend="mooncake"))
        preflight.preflight(cfg, tmp_path / "out")


# -- this machine: memory, writable directories, the environment --------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-total-tokens", str(10**12)], "for device KV pools: lower --max-total-tokens"),
        (["--num-layers", str(10**7)], "for device KV pools: lower --max-total-tokens or --num-layers"),
        (["--enable-hierarchical-cache", "--hicache-ratio", "1e12"], "for host KV pools: lower --hicache-ratio"),
        (["--enable-hierarchical-cache", "--hicache-size", "1e6"], "for host KV pools: lower --hicache-size"),
        (["--vocab-size", str(10**9), "--num-clients", "1"], "for model weights: lower --vocab-size"),
        (
            ["--chunked-prefill-size", "-1", "--request-length", "200000", "--max-total-tokens", "300000"],
            "for attention of one prefill: lower --chunked-prefill-size",
        ),  # fmt: skip
    ],
)
def test_a_world_larger_than_this_machine_is_refused_naming_the_flag(args, message, tmp_path, capsys):
    from hicache_lab.__main__ import main

    assert main(["run", "--num-rounds", "1", *args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "more than this machine's" in err and message in err
    assert not (tmp_path / "out").exists()


def test_a_host_pool_sized_in_bytes_too_small_names_the_size_alone(tmp_path, capsys):
    """Beside --hicache-size the ratio sizes nothing: the advice names the size (and says the ratio is idle)."""
    from hicache_lab.__main__ import main

    flags = ["--enable-hierarchical-cache", "--hicache-size", "0.001", "--hicache-ratio", "5"]
    assert main(["run", *flags, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "raise --hicache-size past 0.00944 GB (--hicache-ratio 5 does nothing beside it)" in err, err
    assert "or --hicache-ratio" not in err


def test_a_mooncake_master_where_nothing_listens_is_refused_at_once():
    """Mooncake's client would retry for minutes inside C++, deaf to signals: nothing listening is refused first."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        with pytest.raises(ConfigError, match=f"--mooncake-master 127.0.0.1:{port}: nothing accepts connections"):
            preflight.check_listens(f"127.0.0.1:{port}")
        s.listen()
        preflight.check_listens(f"127.0.0.1:{port}")


def test_a_gloo_interface_that_cannot_connect_is_refused_naming_the_variable(monkeypatch):
    preflight.check_gloo_interface("lo")  # loopback has 127.0.0.1
    with pytest.raises(
        ConfigError, match="GLOO_SOCKET_IFNAME=lo,nonexistent0: 'nonexistent0' is not a network interface"
    ):
        preflight.check_gloo_interface("lo,nonexistent0")
    monkeypatch.setattr(preflight, "_has_address", lambda name: name != "lo")  # an interface that is down
    with pytest.raises(ConfigError, match="'lo' has no address, .*unset GLOO_SOCKET_IFNAME, or name an interface"):
        preflight.check_gloo_interface("lo")


def test_the_memory_check_is_against_this_machine(monkeypatch, tmp_path):
    cfg = RunConfig()
    assert sum(n for n, _, _ in memory_needed(cfg).values()) < 1e9  # the default world fits any machine
    preflight.preflight(cfg, tmp_path / "out")
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 25_000}  # a machine of 100 MB
    monkeypatch.setattr(preflight.os, "sysconf", lambda name: pages[name])
    with pytest.raises(ConfigError, match="more than this machine's 0.102 GB of memory; the most, 0.3 GB, for rank"):
        preflight.preflight(cfg, tmp_path / "out")


def test_an_output_directory_that_cannot_be_written_is_refused(tmp_path, monkeypatch):
    check_writable_dir(tmp_path / "new" / "deeper", "--out")  # the nearest existing directory is writable
    assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == []  # and nothing was left there
    with pytest.raises(ConfigError, match="--out /proc/x/y is not writable: cannot create a file in /proc"):
        check_writable_dir("/proc/x/y", "--out")  # even root cannot
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match="afile is a file, not a directory"):
        check_writable_dir(tmp_path / "afile" / "out", "--out")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # another user's directory
    with pytest.raises(ConfigError, match=r"--out runs/latest is not writable \(relative to the working directory "):
        check_writable_dir("runs/latest", "--out")


@pytest.mark.parametrize(
    ("environ", "answer"),
    [
        ({}, False),
        ({"RANK": "0", "WORLD_SIZE": "1"}, False),
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, True),
        ({"RANK": "0"}, "WORLD_SIZE is missing"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK is not an integer in 0..1"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE is not a positive integer"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE is not a positive integer"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, "MASTER_ADDR is missing"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "99999"}, "MASTER_PORT is not a port"),
    ],
)
def test_stale_torchrun_variables_are_refused_naming_them(environ, answer):
    from hicache_lab.entrypoints.torchrun import started_by_torchrun

    if isinstance(answer, bool):
        assert started_by_torchrun(environ) is answer
    else:
        with pytest.raises(ConfigError, match=f"{answer}.*unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT"):
            started_by_torchrun(environ)


# -- exhaustive: the work is counted before anything is enumerated ------------------------------------------------


def test_exhaustive_timings_are_found_copy_by_copy_as_the_product_found_them():
    from hicache_lab.lab.check.exhaustive import completion_steps, count_timings, timings

    for copies in range(5):
        for max_delay in range(5):
            brute: dict = {}  # the former enumeration: every delay tuple, first one per timing
            for delays in itertools.product(range(max_delay + 1), repeat=copies):
                brute.setdefault(completion_steps(delays), delays)
            assert timings(copies, max_delay) == list(brute.values())
            assert count_timings(copies, max_delay) == len(brute)


@pytest.mark.parametrize(
    ("stages", "copies", "max_delay", "message"),
    [
        (2, 50, 50, "--stages 2 --copies 50 --max-delay 50 asks for at least"),  # 51**50 delays to enumerate
        (3, 10**9, 1, "stage-steps, at most 150,000"),  # few timings, a billion steps each
        (2, 1, 10**12, "asks for at least 1e+24 schedules"),
        (2, 3, -1, "a delay of at least 0 steps"),
    ],
)
def test_exhaustive_refuses_work_past_its_bound_before_enumerating(stages, copies, max_delay, message):
    from hicache_lab.lab.check.exhaustive import check_work

    started = time.monotonic()
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_work(stages, copies, max_delay, ["fixed", "legacy"])
    assert time.monotonic() - started < 10  # refused up front: enumerating the first three would take hours
    assert check_work(2, 3, 3, ["fixed", "legacy"]) == 529 * 2 * 7 * 2  # the README's run stays allowed


# -- flags that can do nothing here: warned of at start and listed in the summary ---------------------------------

ST = "--enable-hierarchical-cache --hicache-storage-backend file --storage-prefetch-threshold 16"
IDLE = "(one rank has no one to agree with)"


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (f"{ST} --prefetch-timeout-base 0 --prefetch-timeout-per-ki-token 0",
         ["--prefetch-timeout-base 0 does nothing under --latency virtual, where the timeout policy counts steps: "
          "--storage-prefetch-timeout-steps", "--prefetch-timeout-per-ki-token 0 does nothing under --latency"]),
        (f"{ST} --latency real --storage-prefetch-timeout-steps 9",
         ["--storage-prefetch-timeout-steps 9 does nothing under --latency real, where the timeout policy waits"]),
        (f"{ST} --hicache-storage-prefetch-policy best_effort --storage-prefetch-timeout-steps 9",
         ["--storage-prefetch-timeout-steps 9 does nothing without --hicache-storage-prefetch-policy timeout"]),
        ("--enable-hierarchical-cache --hicache-size 0.01 --hicache-ratio 5",
         ["--hicache-ratio 5 does nothing beside --hicache-size, which sizes the host pool instead"]),
        (f"{ST} --hicache-storage-writers one --tp 2", ["--hicache-storage-writers one does nothing without --cp 2"]),
        ("--sync legacy --disable-fix pp_relay --disable-fix cp_groups",
         [f"--sync legacy does nothing without two ranks or more {IDLE}",
          f"--disable-fix pp_relay,cp_groups does nothing without two ranks or more {IDLE}"]),
        ("--tp 2 --disable-fix pp_relay --disable-fix cp_groups --enable-fix multi_hop_relay --pp 2",
         ["--enable-fix multi_hop_relay does nothing without --pp 3 or more",
          "--disable-fix cp_groups does nothing without --cp 2 or more"]),
        ("--num-clients 4 --num-rounds 3 --enable-hierarchical-cache --pp 2 --consensus-check 100000",
         ["--consensus-check 100000 does nothing past step 0 (where every rank agrees): unless it stalls, this run "
          "takes fewer than 1176 steps"]),
    ],
)  # fmt: skip
def test_a_flag_that_can_do_nothing_here_is_warned_of_saying_why(flags, said):
    """Each warning names the flag, its value and why it cannot act here (for --consensus-check, a bound on the
    run's steps); the flags that act warn of nothing."""
    from hicache_lab.lab.presets import config

    idle = preflight.idle_flags(config(flags))
    assert len(idle) == len(said) and all(words in line for words, line in zip(said, idle, strict=True)), idle


def test_the_same_flags_where_they_act_warn_of_nothing():
    from hicache_lab.lab.presets import config

    for flags in (
        f"{ST} --latency real --prefetch-timeout-base 0 --prefetch-timeout-per-ki-token 0",
        f"{ST} --storage-prefetch-timeout-steps 9 --hicache-storage-writers one --cp 2",
        "--pp 3 --sync legacy --disable-fix cp_groups --enable-fix multi_hop_relay --cp 2 --consensus-check 50",
        "--enable-hierarchical-cache --hicache-size 0.01 --pp 2 --consensus-check 100000 --latency real",
    ):
        assert preflight.idle_flags(config(flags)) == [], flags
