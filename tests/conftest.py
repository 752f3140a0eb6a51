"""Shared helpers: the lab's small world (lab/presets.py), which still overflows the device pool, so eviction
and load-back happen; and the guard that keeps the fast tier (`make check`) in one process."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from multiprocessing.process import BaseProcess

import pytest
import torch
import torch.distributed as dist

from hicache_lab.config import CacheConfig, LabConfig, RunConfig
from hicache_lab.distributed.cache_sync import CacheSync
from hicache_lab.distributed.parallel_state import RankLayout, build_groups
from hicache_lab.lab.presets import WORKLOAD, WORLD, config
from hicache_lab.mem_cache.build import KVShape, build_cache
from hicache_lab.mem_cache.hicache_storage import FileStorage
from hicache_lab.parallel_config import ParallelConfig

torch.set_num_threads(1)  # as a rank does: tiny tensors, shared cores


def _with(cfg: RunConfig, section: str, changes: dict) -> RunConfig:
    """`cfg` with `changes`: LabConfig's fields to `lab`, the others to `section`."""
    lab = {name: changes.pop(name) for name in list(changes) if name in LabConfig.__dataclass_fields__}
    cfg = cfg.with_lab(**lab)
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)})


def make_small_config(check_outputs: bool = True, **cache_overrides) -> RunConfig:
    """One rank, 2 layers, the small workload; CacheConfig (or LabConfig) fields by name on top."""
    cfg = config(WORKLOAD, "--num-layers 2 --collective-timeout 30", "--check-outputs" if check_outputs else "")
    return _with(cfg, "cache", cache_overrides)


@pytest.fixture(scope="session")
def small_config():
    """Factory: small_config(check_outputs=True, **cache_overrides) -> RunConfig."""
    return make_small_config


def make_world_config(tp=1, cp=1, pp=1, sync="fixed", **parallel_overrides) -> RunConfig:
    """The small world on several ranks: 3 layers (so stages hold different layer counts), host tier, oracle;
    ParallelConfig (or LabConfig) fields by name on top."""
    cfg = config(WORLD, f"--tp {tp} --cp {cp} --pp {pp} --sync {sync} --collective-timeout 20")
    return _with(cfg, "parallel", parallel_overrides)


@pytest.fixture(scope="session")
def world_config():
    """Factory: world_config(tp=, cp=, pp=, sync=, **parallel_overrides) -> RunConfig."""
    return make_world_config


@pytest.fixture(scope="module")
def groups():
    """The process groups of a world of one; the default group is destroyed only if this fixture made it."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield build_groups(RankLayout(1, 1, 1, 0), ParallelConfig())
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture
def file_cache(groups, tmp_path):
    """Factory: one rank's cache with the host tier over a file store in `tmp_path` (1 layer, 1 head of 2
    dims, fixed sync), CacheConfig fields on top."""

    def make(**fields):
        cfg = CacheConfig(enable_hierarchical_cache=True, storage_backend="file", **fields)
        sync = CacheSync(groups, ParallelConfig(), storage=True)
        return build_cache(cfg, KVShape(1, 1, 2), sync, backend=FileStorage(tmp_path, "test"))[1]

    return make


class ProcessGuard:
    """A test that starts a process of this Python (a rank, the CLI, torchrun, a kernel, a probe), in its own
    body or in a fixture set up for it, is marked `spawns` or `notebook` (pyproject.toml), so that `make check`
    (`-m "not spawns and not notebook and not slow"`) runs in this process alone: the test errors, naming what
    it started, if it is not."""

    def __init__(self):
        self.started: list[str] = []
        self.start, self.popen = BaseProcess.start, subprocess.Popen.__init__
        guard = self

        def start(process):
            guard.started.append(f"a {type(process).__name__} of {getattr(process, '_target', None)}")
            return guard.start(process)

        def popen(process, args, *rest, **kwargs):
            argv = [args] if isinstance(args, (str, bytes)) else list(args)
            if any(str(a).startswith(sys.executable) or "hicache_lab" in str(a) for a in argv[:3]):
                guard.started.append(" ".join(map(str, argv))[:120])
            return guard.popen(process, args, *rest, **kwargs)

        BaseProcess.start, subprocess.Popen.__init__ = start, popen

    def verdict(self, item) -> str | None:
        if not self.started or item.get_closest_marker("spawns") or item.get_closest_marker("notebook"):
            return None
        return f"this test starts processes ({'; '.join(self.started)}): mark it @pytest.mark.spawns"


GUARD = ProcessGuard()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    GUARD.started.clear()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if why := GUARD.verdict(item):
        pytest.fail(why, pytrace=False)
