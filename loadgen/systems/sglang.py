"""Systems driven the way SGLang drives a HiCache storage backend: FlatCake's backend (``flatcake``)
and SGLang's own file backend (``hicache-file``), each built by SGLang's ``StorageBackendFactory``.

SGLang's host KV pools cannot be built on a machine without a GPU (they import transformers and a
device pool), so ``HostPool`` reproduces their page layouts as SGLang 0.5.23 defines them (the node
agent's SGLang backend tests use it too, with small dimensions)
(``mem_cache/pool_host``: ``kv_buffer`` shapes, ``get_data_page``, ``set_from_flat_data_page``,
``get_dummy_flat_data_page``). The page moves are SGLang's: ``managers/cache_controller.py``
``_page_set_zero_copy``/``_page_get_zero_copy`` (``batch_set_v1``/``batch_get_v1`` into host-pool
slots, used for ``dynamic`` backends with ``interface_v1``) and ``_generic_page_set``/
``_generic_page_get`` (flat data pages through ``batch_set``/``batch_get``, used for ``file``), in
batches of ``STORAGE_BATCH_SIZE`` pages.

A restore's timed part is the storage call and the copy into the host pool (SGLang's work); turning
host pages back into the benchmark's ``[layers][pages][page_bytes]`` layout for checking is not timed.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flatcake.loadgen.systems.base import Array, RequestTiming, RestoreCounters, SystemSpec
from flatcake.loadgen.systems.flatcake import engine_config, medium_of
from flatcake.node_agent import AgentConfig, ConfigError, DramConfig, Hints, IOConfig, Key, spawn
from flatcake.node_agent.constants import SGLANG_BACKEND
from flatcake.node_agent.datapath.buffers import round_up

BATCH = 128  # sglang.srt.mem_cache.hicache_storage.STORAGE_BATCH_SIZE in 0.5.23
MHA_HEADS, MHA_HEAD_DIM = 2, 128  # an MHA page-layer of 2 (K, V) x heads x dim x 2 bytes per token


def _import_sglang() -> tuple[Any, Any]:
    try:
        import torch
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    except ImportError as exc:
        raise ConfigError(
            f"sglang: not importable ({exc}); the SGLang systems need the sglang extra: "
            "FLATCAKE_EXTRAS=sglang bin/flatcake ... (bin/test installs it)"
        ) from None
    return torch, StorageBackendFactory


LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class HostPool:
    """SGLang's host KV pool (``pool_host/mha.py``, ``pool_host/mla.py``) in one of its ``layout``s,
    token-indexed, pages at multiples of ``page_size``. ``kv_buffer`` shapes (T tokens, L layers, P pages):

    - MLA: ``layer_first`` (L, T, 1, dim); ``page_first`` (T, L, 1, dim); ``page_first_direct``
      (P, L, page_size, 1, dim);
    - MHA: ``layer_first`` (2, L, T, heads, head_dim); ``page_first`` (2, T, L, heads, head_dim);
      ``page_first_direct`` (2, P, L, page_size, heads, head_dim).

    ``for_spec`` sizes one from a system spec (bench peers); tests build small ones directly."""

    def __init__(self, *, pages: int, page_size: int, layers: int, mla: bool, layout: str = "page_first",
                 dtype: Any = None, mla_dim: int = 1, heads: int = MHA_HEADS,
                 head_dim: int = MHA_HEAD_DIM) -> None:  # fmt: skip
        if layout not in LAYOUTS:
            raise ConfigError(f"layout: {layout!r} must be one of {', '.join(LAYOUTS)}")
        torch, _ = _import_sglang()
        self.torch, self.layout, self.mla = torch, layout, mla
        self.page_size, self.layer_num = page_size, layers
        self.dtype = dtype if dtype is not None else torch.bfloat16
        t, inner = pages * page_size, ((1, mla_dim) if mla else (heads, head_dim))
        dims = {"layer_first": (layers, t), "page_first": (t, layers), "page_first_direct": (pages, layers, page_size)}
        shape = (*dims[layout], *inner) if mla else (2, *dims[layout], *inner)
        self.kv_buffer = torch.zeros(shape, dtype=self.dtype)
        # The layer axis of one (non-flat) data page: layer_first pages are (L, page, ...) after the K/V axis.
        self.layer_axis = (0 if layout == "layer_first" else 1) + (0 if mla else 1)
        sample = self.get_data_page(0, flat=False)
        self.raw_bytes = sample.numel() * sample.element_size() // layers  # one page-layer, unpadded

    @classmethod
    def for_spec(cls, spec: SystemSpec, pages: int, mla: bool) -> HostPool:
        """The bench's pool, ``page_first``: MLA one byte per element (``dim`` = bytes per token-layer),
        MHA bf16 with ``MHA_HEADS`` x ``MHA_HEAD_DIM``; the spec's page bytes must be its page-layer's."""
        torch, _ = _import_sglang()
        pool = cls(pages=pages, page_size=spec.page_tokens, layers=spec.layers, mla=mla,
                   dtype=torch.uint8 if mla else torch.bfloat16,
                   mla_dim=max(1, spec.page_bytes // spec.page_tokens))  # fmt: skip
        if round_up(pool.raw_bytes) != spec.page_bytes:
            raise ConfigError(
                f"page_bytes: {spec.page_bytes} is not this host pool's page-layer ({pool.raw_bytes} B, padded "
                f"{round_up(pool.raw_bytes)}); use a model preset or --page-layer-bytes that matches"
            )
        return pool

    def _slice(self, index: int) -> tuple[slice, ...]:
        if self.layout == "page_first_direct":  # a page is one entry of its own axis
            page = slice(index // self.page_size, index // self.page_size + 1)
            return (page,) if self.mla else (slice(None), page)
        tokens = slice(index, index + self.page_size)
        lead = (slice(None),) if self.layout == "layer_first" else ()
        return (*lead, tokens) if self.mla else (slice(None), *lead, tokens)

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        page = self.kv_buffer[self._slice(index)]
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, data_page: Any) -> None:
        target = self.kv_buffer[self._slice(index)]
        target.copy_(data_page.reshape(target.shape))

    def get_dummy_flat_data_page(self) -> Any:
        return self.torch.zeros(self.get_data_page(0).numel(), dtype=self.dtype)

    # ---- the benchmark's layer-major pages <-> host pages (not SGLang's work; untimed) ---------------
    def _layer_axis_view(self, slot: int) -> Any:
        """Page ``slot`` as ``[layers][raw bytes]`` (a copy)."""
        page = self.get_data_page(slot * self.page_size, flat=False)
        moved = page.movedim(self.layer_axis, 0).contiguous()
        return moved.view(self.torch.uint8).reshape(self.layer_num, -1)

    def write(self, slot: int, layers: Array) -> None:
        """Host page ``slot`` from a ``[layers][page_bytes]`` page (its first ``raw_bytes`` per layer)."""
        page = self.get_data_page(slot * self.page_size, flat=False)
        shape = list(page.shape)
        shape.insert(0, shape.pop(self.layer_axis))
        raw = self.torch.from_numpy(np.ascontiguousarray(layers[:, : self.raw_bytes]))
        page.copy_(raw.view(self.dtype).reshape(shape).movedim(0, self.layer_axis))

    def read(self, slot: int, dest: Array, column: int) -> None:
        dest[:, column, : self.raw_bytes] = self._layer_axis_view(slot).numpy()


class _SGLangSystem:
    """What both SGLang-driven systems share: the host pool, the storage config, batching, checking."""

    name = ""

    def __init__(self, directory: Path, spec: SystemSpec) -> None:
        self.torch, self.factory = _import_sglang()
        self.spec, self.directory, self.mla = spec, directory, spec.mla
        self.pool = HostPool.for_spec(spec, max(spec.session_pages, BATCH), spec.mla)
        self._counters = RestoreCounters()

    def storage_config(self, extra: dict[str, Any]) -> Any:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

        return HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=self.mla,
            enable_storage_metrics=False, is_page_first_layout=self.pool.layout != "layer_first",
            model_name="bench/model", extra_config=extra,
        )  # fmt: skip

    def _indices(self, slots: range) -> Any:
        return self.torch.arange(slots.start * self.spec.page_tokens, slots.stop * self.spec.page_tokens)

    def put(self, keys: Sequence[Key], kv: Array, hints: Hints) -> None:
        for j in range(len(keys)):  # the pages are in SGLang's host pool before it backs them up
            self.pool.write(j, kv[:, j])
        for lo in range(0, len(keys), BATCH):
            batch = [str(k) for k in keys[lo : lo + BATCH]]
            if not self.set_pages(batch, range(lo, lo + len(batch)), hints):
                raise RuntimeError(f"{self.name}: storing {len(batch)} pages failed")

    def restore(self, keys: Sequence[Key], dest: Array, dest_pages: Sequence[int] | None = None) -> int:
        started = time.perf_counter()
        got = 0
        for lo in range(0, len(keys), BATCH):
            batch = [str(k) for k in keys[lo : lo + BATCH]]
            hit = self.get_pages(batch, range(lo, lo + len(batch)))
            got += hit
            if hit < len(batch):
                break  # a prefix cache stops at the first miss
        # Whole requests: SGLang's storage -> host interface (batch_get_v1 per batch of pages) has no notion of
        # layers, so the first layer is usable when the last is (docs/benchmarks.md, `bench peers`).
        took = time.perf_counter() - started
        self._counters.requests.append(RequestTiming(took, took))
        for j in range(got):
            self.pool.read(j, dest, j if dest_pages is None else dest_pages[j])
        self._counters.bytes_requested += len(keys) * self.spec.page_span
        self._counters.missing += len(keys) - got
        return len(keys) - got

    def set_pages(self, keys: list[str], slots: range, hints: Hints) -> bool:
        raise NotImplementedError

    def get_pages(self, keys: list[str], slots: range) -> int:
        raise NotImplementedError

    def prepare(self) -> None:
        self._counters = RestoreCounters()

    def counters(self) -> RestoreCounters:
        return self._counters


class FlatCakeSGLangSystem(_SGLangSystem):
    """FlatCake as SGLang would run it: a node agent process, FlatCake's backend built by SGLang's
    factory (``dynamic``, ``interface_v1``, prefix keys passed), pages moved zero-copy into host slots."""

    name = "flatcake"

    def __init__(self, directory: Path, spec: SystemSpec) -> None:
        super().__init__(directory, spec)
        directory.mkdir(parents=True, exist_ok=True)
        dram = DramConfig(huge_pages=False, shm_dir=str(directory), name="bench-dram")
        config = dataclasses.replace(
            engine_config(spec, directory / "pool", dram, streams=IOConfig().streams),
            agent=AgentConfig(socket=str(directory / "agent.sock"), metrics_host="127.0.0.1", metrics_port=0),
        )
        self.agent = spawn(config, directory)
        try:
            extra = {**SGLANG_BACKEND, "socket": config.agent.socket}
            self.backend = self.factory.create_backend("dynamic", self.storage_config(extra), self.pool)
            self.backend.register_mem_pool_host(self.pool)
        except BaseException:
            self.agent.kill()
            raise
        self._prefix: dict[str, list[str]] = {}  # the keys before each stored page: SGLang's prefix_keys
        self._base: dict[str, int] = {}
        self._last = ""

    def set_pages(self, keys: list[str], slots: range, hints: Hints) -> bool:
        """What SGLang passes and nothing more: ``prefix_keys`` (the chain before the batch; the next
        batch of one write extends it, as ``cache_controller._page_backup`` does) and no request
        metadata."""
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

        if slots.start == 0:
            parent = str(hints.parent_key) if hints.parent_key is not None else None
            prefix = [*self._prefix.get(parent, []), parent] if parent is not None else []
        else:
            prefix = [*self._prefix[self._last], self._last]
        info = HiCacheStorageExtraInfo(prefix_keys=prefix)
        ok = all(self.backend.batch_set_v1(keys, self._indices(slots), info))
        for i, key in enumerate(keys):
            self._prefix[key] = prefix + keys[:i]
        self._last = keys[-1]
        return ok

    def arrive(self, keys: Sequence[Key], parent: Key | None) -> None:
        """A request arrives: SGLang's hit query (``cache_controller._storage_hit_query``) asks for the pages
        past its device-matched prefix, passing that prefix; this is where shared prompts show up."""
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

        prefix = [*self._prefix.get(str(parent), []), str(parent)] if parent is not None else []
        chain = [str(k) for k in keys]
        for lo in range(0, len(chain), BATCH):
            self.backend.batch_exists(chain[lo : lo + BATCH], HiCacheStorageExtraInfo(prefix_keys=prefix))
            prefix = prefix + chain[lo : lo + BATCH]

    def placement(self, keys: Sequence[Key]) -> list[str | None]:
        """The medium the agent placed each page on, asked of its index under the backend's key names."""
        catalog: Any = self.backend.engine.catalog  # the agent's (RemoteCatalog): lookup answers locations
        out: list[str | None] = []
        for key in keys:
            hit, gva, _ = catalog.lookup([str(key) + self.backend.suffix])
            out.append(medium_of(gva[0]) if hit else None)
        return out

    def get_pages(self, keys: list[str], slots: range) -> int:
        ok = self.backend.batch_get_v1(keys, self._indices(slots))
        return next((i for i, hit in enumerate(ok) if not hit), len(ok))

    def prepare(self) -> None:
        super().prepare()
        self._base = self.backend.engine.stats.snapshot()

    def counters(self) -> RestoreCounters:
        now = self.backend.engine.stats.snapshot()
        c = self._counters
        delta = {k: now.get(k, 0) - self._base.get(k, 0) for k in now}
        c.read_commands, c.bytes_read = delta.get("read_commands", 0), delta.get("read_bytes", 0)
        c.staging_peak_bytes = now.get("staging_peak_bytes", 0)
        c.dram_pages = delta.get("restore_pages_dram", 0)
        return c

    def pids(self) -> list[int]:
        return [self.agent.pid]

    def close(self) -> None:
        self.backend.engine.close()
        self.agent.terminate()
        self.agent.wait(30)


class HiCacheFileSystem(_SGLangSystem):
    """SGLang's ``HiCacheFile`` (``--hicache-storage-backend file``): one file per page under a
    directory, written with buffered I/O and renamed into place; flat data pages through
    ``batch_set``/``batch_get``, as SGLang's cache controller moves them for this backend."""

    name = "hicache-file"

    def __init__(self, directory: Path, spec: SystemSpec) -> None:
        super().__init__(directory, spec)
        directory.mkdir(parents=True, exist_ok=True)
        extra = {"file_storage_path": str(directory)}
        self.backend = self.factory.create_backend("file", self.storage_config(extra), self.pool)
        self.backend.register_mem_pool_host(self.pool)

    def set_pages(self, keys: list[str], slots: range, hints: Hints) -> bool:
        data = [self.pool.get_data_page(s * self.spec.page_tokens) for s in slots]
        return bool(self.backend.batch_set(keys, data))

    def get_pages(self, keys: list[str], slots: range) -> int:
        dummy = [self.pool.get_dummy_flat_data_page() for _ in keys]
        pages = self.backend.batch_get(keys, dummy)
        count = 0
        for key_slot, page in zip(slots, pages or [], strict=False):
            if page is None:
                break
            self.pool.set_from_flat_data_page(key_slot * self.spec.page_tokens, page)
            count += 1
        self._counters.read_commands += count  # one open + read per page file
        self._counters.bytes_read += count * self.pool.raw_bytes * self.spec.layers
        return count

    def counters(self) -> RestoreCounters:
        # The dummy page and the flat page read into it are the staging SGLang holds per page in flight.
        self._counters.staging_peak_bytes = BATCH * self.pool.raw_bytes * self.spec.layers
        return self._counters

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class HiCacheFilePages:
    """SGLang's ``HiCacheFile`` as the tiered cache's L3 (``TieredStore(l3=...)``, the emulator's
    ``--l3 hicache-file``): one file per page under ``directory``, written with ``set`` (buffered
    ``tofile`` to a temporary name, renamed into place) and read with ``get`` (``readinto`` the page),
    the calls SGLang's cache controller makes for this backend one page at a time; ``exists`` is its
    ``batch_exists`` (a stat per page). ``drop_page_cache``: once a page file is written it is synced and
    dropped from the OS page cache (``POSIX_FADV_DONTNEED``), so reads hit the device as the other
    systems' O_DIRECT reads do, rather than memory beyond the DRAM budget; the sync runs on the
    caller's thread (SGLang's backup thread), off the request path."""

    def __init__(self, directory: Path, layers: int, page_bytes: int, drop_page_cache: bool = True) -> None:
        self.torch, _ = _import_sglang()
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

        directory.mkdir(parents=True, exist_ok=True)
        config = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
            enable_storage_metrics=False, is_page_first_layout=True, model_name="emulator/model",
            extra_config={"file_storage_path": str(directory)},
        )  # fmt: skip
        self.backend = HiCacheFile(config)
        self.page_span = layers * page_bytes
        self.drop_page_cache = drop_page_cache
        self.dropped = 0  # page files dropped from the page cache

    def set(self, key: Key, page: Array) -> bool:
        flat = self.torch.from_numpy(np.ascontiguousarray(page).reshape(-1))
        ok = bool(self.backend.set(str(key), flat))
        if ok and self.drop_page_cache:
            self._drop(str(key))
        return ok

    def _drop(self, key: str) -> None:
        # HiCacheFile's file name for a key (hicache_storage.py: file_path / f"{suffixed key}.bin").
        path = Path(self.backend.file_path) / f"{self.backend._get_suffixed_key(key)}.bin"
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # evicted by its own LRU already
            return
        try:
            os.fdatasync(fd)  # dirty pages are not dropped: write them first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            self.dropped += 1
        finally:
            os.close(fd)

    def exists(self, keys: Sequence[Key]) -> int:
        return int(self.backend.batch_exists([str(k) for k in keys]))

    def get(self, key: Key, into: Array) -> bool:
        got = self.backend.get(str(key), self.torch.from_numpy(into.reshape(-1)))
        return got is not None
