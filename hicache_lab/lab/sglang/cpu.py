"""What it takes to import sglang 0.5.23's cache modules beside a CPU build of torch: the one place the lab
stands in for something of SGLang's environment. Nothing of SGLang's is copied; what is replaced is named here.

* `torchvision`. The cache modules reach it through `sglang.srt.configs` (multimodal processors), and
  `transformers` imports `torchvision.io` once it finds the package. The registry's torchvision wheels are built
  against CUDA torch and do not load beside the CPU one, and nothing on the cache path uses them. So where no
  real torchvision imports, `torchvision` and its submodules are served by placeholders: any attribute is an
  inert stand-in.
* Six functions of SGLang's host tier that need CUDA (`install_cpu_replacements`, for lab/sglang/cache.py):
  host memory is pinned with cudaHostRegister (here it stays pageable), the storage read's scratch page is
  pinned too (`MHATokenToKVPoolHost.get_dummy_flat_data_page`: here pageable), the direct io backend's three
  copy kernels are sgl_kernel ops imported only on CUDA/ROCm (`transfer_kv_direct` for `layer_first`, and for
  `page_first_direct` `transfer_kv_all_layer_direct_lf_pf` and `transfer_kv_per_layer_direct_pf_lf`: here
  indexed copies), and `torch.cpu.Stream` has no `synchronize` (reached only on an error path, where its
  absence would hide the real exception). Only bytes move in them: no decision of SGLang's is replaced. Each
  replacement fails loudly if the name it replaces has moved: an upgrade of sglang breaks here, visibly.

The Makefile installs sglang itself with `--no-deps` (its own requirements pin a CUDA torch) and its pure-Python
dependencies from requirements-sglang-cpu.txt.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import sys
import types
import warnings

import torch

SGLANG_VERSION = "0.5.23"


class _StandIn:
    """Whatever a placeholder module is asked for: callable, subscriptable, a base class, never useful."""

    def __getattr__(self, name: str) -> _StandIn:
        return self

    def __call__(self, *args, **kwargs) -> _StandIn:
        return self

    def __iter__(self):
        return iter(())

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name: str) -> _StandIn:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandIn()


class _TorchvisionPlaceholders(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec) -> types.ModuleType:
        return _PlaceholderModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__version__ = "0.0.0+placeholder"


def sglang_version() -> str | None:
    """The installed sglang's version, None where it is not installed (nothing is imported to find out)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def prepare_imports(version: str = SGLANG_VERSION) -> None:
    """Let sglang's cache modules import here: torchvision placeholders where no real torchvision loads.
    Raises RuntimeError, saying what to install, where the sglang this process imports is missing or not
    `version` (an older release comes first on sys.path: releases.activate)."""
    found = sglang_version()
    if found != version:
        installed = f"sglang {found} is installed" if found else "sglang is not installed"
        how = "make installs it" if version == SGLANG_VERSION else f"make releases RELEASES={version} installs it"
        raise RuntimeError(f"{installed}; the lab reads sglang {version}: {how}")
    if any(isinstance(f, _TorchvisionPlaceholders) for f in sys.meta_path):
        return
    try:
        importlib.import_module("torchvision")
    except Exception:  # missing, or a wheel built against another torch
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.meta_path.append(_TorchvisionPlaceholders())


@contextlib.contextmanager
def quiet_imports():
    """Import sglang's modules without the warnings of modules met on the way, harmless here: quantization
    kernels that only CUDA supports, and tqdm finding no Jupyter widgets."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Only CUDA", category=UserWarning)
        warnings.filterwarnings("ignore", message="IProgress not found")
        warnings.filterwarnings("ignore", message="Triton is not supported")  # older releases' fla kernels
        yield


# -- the six functions of SGLang's host tier that need CUDA, replaced for CPU --------------------------


def unpinned_alloc(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    """`ALLOC_MEMORY_FUNCS["cpu"]`: SGLang pins host memory with cudaHostRegister; here it stays pageable."""
    return torch.zeros(dims, dtype=dtype, device=device)


def _unpinned_dummy_page(self) -> torch.Tensor:
    """`MHATokenToKVPoolHost.get_dummy_flat_data_page`: the page a storage read fills for a page it does not
    keep, pinned there; here pageable (torch pins only beside an accelerator)."""
    shape = (2, self.layer_num, self.page_size, self.head_num, self.head_dim)
    return torch.zeros(shape, dtype=self.dtype, device=self.device).flatten()


def _transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """`pool_host.mha.transfer_kv_direct` (an sgl_kernel op imported only on CUDA/ROCm): a copy per layer."""
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices] = src[src_indices]


def _all_layers_to_pages(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """`transfer_kv_all_layer_direct_lf_pf`: every layer's K then V rows (`src_ptrs`, per layer `[slots, heads,
    dim]`) into the `page_first_direct` host buffers K and V (`[pages, layers, page_size, heads, dim]`)."""
    layers = len(src_ptrs) // 2
    pages, offsets = dst_indices // page_size, dst_indices % page_size
    for half, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            dst[pages, layer, offsets] = src_ptrs[half * layers + layer][src_indices]


def _pages_to_one_layer(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
    """`transfer_kv_per_layer_direct_pf_lf`: one layer's K and V from the `page_first_direct` host buffers into
    the device layer's rows."""
    pages, offsets = src_indices // page_size, src_indices % page_size
    for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
        dst[dst_indices] = src[pages, layer_id, offsets]


# the direct io backend's kernels by sgl_kernel's names (older releases import them: shims.py)
DIRECT_COPIES = {
    "transfer_kv_direct": _transfer_kv_direct,
    "transfer_kv_all_layer_direct_lf_pf": _all_layers_to_pages,
    "transfer_kv_per_layer_direct_pf_lf": _pages_to_one_layer,
}


def _no_stream_to_wait_for(self) -> None:
    """`torch.cpu.Stream.synchronize`: missing from torch's CPU stream; SGLang's transfer engine calls it on its
    error path, where its absence would hide the real exception. CPU copies are synchronous: nothing to wait for."""


def install_cpu_replacements() -> None:
    """Let sglang's host tier run on CPU (after `prepare_imports`). Raises RuntimeError naming what moved if a
    replaced name is no longer where sglang 0.5.23 keeps it: an upgrade must fail here, loudly."""
    common = importlib.import_module("sglang.srt.mem_cache.pool_host.common")
    mha = importlib.import_module("sglang.srt.mem_cache.pool_host.mha")
    missing = [
        name
        for name, present in (
            ("pool_host.common.ALLOC_MEMORY_FUNCS", hasattr(common, "ALLOC_MEMORY_FUNCS")),
            ("pool_host.mha.MHATokenToKVPoolHost", hasattr(mha, "MHATokenToKVPoolHost")),
            (
                "MHATokenToKVPoolHost.get_dummy_flat_data_page",
                hasattr(getattr(mha, "MHATokenToKVPoolHost", None), "get_dummy_flat_data_page"),
            ),
            ("torch.cpu.Stream", hasattr(torch.cpu, "Stream")),
        )
        if not present
    ]
    if missing:
        raise RuntimeError(f"sglang {sglang_version()} moved {missing}: lab/sglang/cpu.py follows {SGLANG_VERSION}")
    common.ALLOC_MEMORY_FUNCS["cpu"] = unpinned_alloc
    mha.MHATokenToKVPoolHost.get_dummy_flat_data_page = _unpinned_dummy_page
    for name, copy in DIRECT_COPIES.items():  # module globals only where CUDA imported them
        setattr(mha, name, copy)
    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = _no_stream_to_wait_for
