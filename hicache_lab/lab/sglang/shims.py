"""What an older sglang release needs to import and move bytes beside the lab's CPU torch and newer transformers
(releases.py names which release takes which). Each shim bridges one difference of the environment, names it,
and replaces no decision of SGLang's: only bytes move in the functions stood in for. The torchvision placeholders
and 0.5.23's own CPU stand-ins are cpu.py's.
"""

from __future__ import annotations

import importlib
import sys
import types

from .cpu import DIRECT_COPIES, unpinned_alloc


def configs_registered_twice() -> None:
    """0.5.11 to 0.5.18 register model configs (`qwen3_asr`, ...) that the venv's newer transformers ships itself:
    `AutoConfig.register` raises `... is already used by a Transformers config`. Registered with `exist_ok`."""
    from transformers import AutoConfig

    register = AutoConfig.register
    if getattr(register, "exist_ok_shim", False):
        return

    def register_again(model_type, config, exist_ok=False):
        return register(model_type, config, exist_ok=True)

    register_again.exist_ok_shim = True
    AutoConfig.register = staticmethod(register_again)


class _CudaKernels(types.ModuleType):
    """`sgl_kernel.kvcacheio`: the host tier's copy kernels. Those of the `direct` io backend (all the lab asks
    of it) are cpu.py's indexed copies; any other kernel says so when it is called."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in DIRECT_COPIES:
            return DIRECT_COPIES[name]

        def cuda_only(*args, **kwargs):
            raise RuntimeError(f"sgl_kernel.kvcacheio.{name} is a CUDA kernel: use --hicache-io-backend direct")

        return cuda_only


def kernel_stand_ins() -> None:
    """0.5.10 to 0.5.12 import `sgl_kernel.kvcacheio` on any device but NPU, XPU or MPS, CPU included
    (`memory_pool_host.py`); sgl_kernel is a CUDA package, not installed here. Stood in for by `_CudaKernels`."""
    if "sgl_kernel.kvcacheio" in sys.modules:
        return
    package = types.ModuleType("sgl_kernel")
    package.__path__ = []
    package.kvcacheio = _CudaKernels("sgl_kernel.kvcacheio")
    sys.modules.update({"sgl_kernel": package, "sgl_kernel.kvcacheio": package.kvcacheio})


def direct_copy_global() -> None:
    """0.5.13 on guard that import on CUDA, so the `direct` backend's kernels are missing as it calls them: set as
    the globals of the module that holds the MHA host pool (`memory_pool_host`; `pool_host.mha` from 0.5.16), as
    cpu.py's indexed copies."""
    for name in ("sglang.srt.mem_cache.pool_host.mha", "sglang.srt.mem_cache.memory_pool_host"):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if not name.startswith(str(exc.name)):
                raise  # the module is there, and something it imports is not
            continue
        for kernel, copy in DIRECT_COPIES.items():
            setattr(module, kernel, copy)
        return


def unpinned_host_memory() -> None:
    """Every release pins its host pool with cudaHostRegister on any device it has no other way for
    (`ALLOC_MEMORY_FUNCS`), which a CPU torch has not: here the host pool stays pageable, as cpu.py's for 0.5.23."""
    module = importlib.import_module("sglang.srt.mem_cache.memory_pool_host")
    module.ALLOC_MEMORY_FUNCS["cpu"] = unpinned_alloc
