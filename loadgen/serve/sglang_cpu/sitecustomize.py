"""Runs SGLang 0.5.23 with HiCache on a CPU-only torch, leaving the installed wheels unmodified.

This folder goes on ``PYTHONPATH`` of the SGLang server process only (``loadgen/serve/server.py`` puts it
there). Python imports ``sitecustomize`` at every interpreter start, so the patches below also reach the
scheduler and detokenizer processes SGLang starts with multiprocessing *spawn* (they inherit
``PYTHONPATH``). Nothing is imported here eagerly: each patch runs right after its target module is
first imported (an import hook on ``sys.meta_path``), and first checks that what it replaces still
exists, raising a RuntimeError that names the symbol if a newer SGLang or torchvision moved it.

The folder also holds ``sgl_kernel/``: a pure-torch stand-in for the few ``sgl_kernel`` functions
SGLang imports on the CPU (the PyPI wheel is CUDA-only; its CPU ops exist only as a source build).

What breaks without them, in the order a launch meets it:

1. ``operator torchvision::nms does not exist``: PyPI's torchvision is linked against CUDA's torch, so
   its C ops never load, yet ``torchvision._meta_registrations`` registers fake kernels for them at
   import. SGLang imports torchvision for its image transforms only: that module is skipped.
2. ``Torch not compiled with CUDA enabled``: HiCache's host pool pins its buffer (``cudaHostRegister``,
   ``torch.empty(pin_memory=True)``) whatever the device. Pinning means nothing without a GPU: the
   host pool is built with ``pin_memory=False``.
3. ``name 'transfer_kv_...' is not defined``: on the CPU, ``pool_host/mha.py`` and ``mla.py`` import
   no device<->host transfer functions (only the CUDA, HIP and XPU branches do, from
   ``sgl_kernel.kvcacheio``). The ``--hicache-io-backend direct`` ones are bound from this folder's
   ``sgl_kernel/kvcacheio.py`` (torch indexing); the ``kernel`` ones to an error saying so.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

PREFIX = "[sglang_cpu]"
_VERBOSE = os.environ.get("SGLANG_CPU_COMPAT_QUIET", "") in ("", "0")


def _say(message: str) -> None:
    if _VERBOSE:
        print(f"{PREFIX} pid {os.getpid()}: {message}", file=sys.stderr, flush=True)


def _require(module: types.ModuleType, name: str) -> Any:
    """The attribute the patch replaces; a clear error when SGLang or torchvision moved it."""
    if not hasattr(module, name):
        raise RuntimeError(
            f"{PREFIX} {module.__name__}.{name} is gone: the CPU compatibility layer "
            f"(loadgen/serve/sglang_cpu) was written for SGLang 0.5.23 and needs updating"
        )
    return getattr(module, name)


# --- the patches, keyed by the module they act on ---------------------------------------------------


def _skip_torchvision_meta(module: types.ModuleType) -> None:
    """(1) Leave ``torchvision._meta_registrations`` empty: its fake kernels need the C ops."""
    _say("torchvision._meta_registrations skipped (torchvision's C ops are CUDA-linked)")


def _unpin_host_pool(module: types.ModuleType) -> None:
    """(2) ``HostKVCache(..., pin_memory=False)``: every host pool class passes it by keyword."""
    cls = _require(module, "HostKVCache")
    original = cls.__init__
    if getattr(original, "_sglang_cpu", False):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if "pin_memory" not in kwargs:
            raise RuntimeError(f"{PREFIX} HostKVCache.__init__ got pin_memory by position; update the patch")
        kwargs["pin_memory"] = False
        original(self, *args, **kwargs)

    __init__._sglang_cpu = True  # type: ignore[attr-defined]
    cls.__init__ = __init__
    _say(f"{module.__name__}.HostKVCache.__init__: pin_memory=False")


DIRECT = ("transfer_kv_direct", "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_all_layer_direct_lf_pf")
TRANSFERS = {  # what each host pool module imports from sgl_kernel.kvcacheio on CUDA
    "sglang.srt.mem_cache.pool_host.mha": (
        "transfer_kv_all_layer", "transfer_kv_all_layer_direct_lf_pf", "transfer_kv_all_layer_lf_pf",
        "transfer_kv_all_layer_lf_ph", "transfer_kv_all_layer_mla_lf_pf", "transfer_kv_direct",
        "transfer_kv_per_layer", "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_per_layer_mla",
        "transfer_kv_per_layer_mla_pf_lf", "transfer_kv_per_layer_pf_lf", "transfer_kv_per_layer_ph_lf",
    ),
    "sglang.srt.mem_cache.pool_host.mla": (
        "transfer_kv_all_layer_direct_lf_pf", "transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf",
        "transfer_kv_direct", "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_per_layer_mla",
        "transfer_kv_per_layer_mla_pf_lf",
    ),
}  # fmt: skip


def _kernel_io_only(name: str) -> Callable[..., None]:
    def call(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{PREFIX} {name} is a CUDA kernel; on the CPU use --hicache-io-backend direct")

    call.__name__ = name
    return call


def _bind_transfers(module: types.ModuleType) -> None:
    """(3) Bind the host pool's transfer functions: the direct ones from the stand-in's kvcacheio, the
    kernel ones to an error that says to use ``--hicache-io-backend direct``."""
    kvcacheio = importlib.import_module("sgl_kernel.kvcacheio")  # this folder's stand-in (or a real build)

    missing = [name for name in TRANSFERS[module.__name__] if not hasattr(module, name)]
    if not missing:  # SGLang imported them itself: a real sgl_kernel is in use, leave them
        return
    for name in missing:
        setattr(module, name, _require(kvcacheio, name) if name in DIRECT else _kernel_io_only(name))
    _say(f"{module.__name__}: transfer functions bound ({', '.join(n for n in missing if n in DIRECT)} in torch)")


PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "torchvision._meta_registrations": _skip_torchvision_meta,
    "sglang.srt.mem_cache.pool_host.base": _unpin_host_pool,
    "sglang.srt.mem_cache.pool_host.mha": _bind_transfers,
    "sglang.srt.mem_cache.pool_host.mla": _bind_transfers,
}
SKIP_BODY = {"torchvision._meta_registrations"}


# --- the import hook ----------------------------------------------------------------------------------


class _PatchingLoader(importlib.abc.Loader):
    """Runs the module as its own loader would, then the patch."""

    def __init__(self, inner: importlib.abc.Loader, patch: Callable[[types.ModuleType], None], run: bool) -> None:
        self.inner, self.patch, self.run = inner, patch, run

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        if self.run:
            self.inner.exec_module(module)
        self.patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self.inner, name)


class _PatchFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, patch, run=fullname not in SKIP_BODY)
                return spec
        return None  # not installed: nothing to patch (torchvision is optional to this layer)


if not any(isinstance(f, _PatchFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _PatchFinder())
