"""SGLang HiCache storage backend on FlatCake: the node agent's catalog, this process's bytes.

Load it in SGLang with::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "flatcake",
        "module_path": "flatcake.node_agent.sglang", "class_name": "FlatCakeStorage",
        "socket": "/run/flatcake/agent.sock", "interface_v1": true}'

SGLang builds it as ``FlatCakeStorage(storage_config, kwargs)`` and then calls
``register_mem_pool_host(host_pool)``; that is when the model's geometry is known and the backend
connects to the agent (whose pool must have the same layers and page bytes). Pages move between
SGLang's host pool and FlatCake as ``[layers][pages][page_bytes]`` buffers: each layer of a page is
one contiguous range, whatever the host pool's layout (``layer_first``, ``page_first``, ...).

Keys are SGLang's chained SHA-256 page hashes. MHA shards heads across TP ranks, so each rank
stores its own bytes under ``hash@tp{rank}of{size}``; MLA's latent cache is the same on every rank,
so ranks share one key and only the storage writer (rank 0) writes. ``extra_info.prefix_keys``
names the pages before a batch: its last one is the parent, binding new pages to their session's
scope.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from flatcake.errors import ConfigError, FlatCakeError
from flatcake.node_agent.datapath.buffers import aligned_empty, round_up
from flatcake.node_agent.datapath.engine import Engine
from flatcake.node_agent.policy.placement import Hints
from flatcake.node_agent.service.client import connect

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/run/flatcake/agent.sock"

# Which axis of a host pool's (non-flat) data page is the layer axis, by attention kind and layout,
# as SGLang 0.5.23 lays its host pools out (pool_host/mha.py, pool_host/mla.py, get_data_page).
LAYER_AXIS: dict[tuple[bool, str], int] = {
    (False, "layer_first"): 1,  # (2, L, page, heads, dim)
    (False, "page_first"): 2,  # (2, page, L, heads, dim)
    (False, "page_first_direct"): 2,  # (2, 1, L, page, heads, dim)
    (False, "page_head"): 4,  # (2, 1, heads, page, L, dim)
    (True, "layer_first"): 0,  # (L, page, 1, dim)
    (True, "page_first"): 1,  # (page, L, 1, dim)
    (True, "page_first_direct"): 1,  # (1, L, page, 1, dim)
}
# What a storage call may meet in normal operation, answered as a miss (or a failed set) so that SGLang
# recomputes: a full pool, a page reclaimed meanwhile, a failed write, an agent that went away. Anything
# else (a wrong shape, a bad argument) is a bug and propagates rather than hiding as a miss.
STORAGE_FAULTS = (FlatCakeError, ConnectionError, TimeoutError)
HINT_FIELDS = ("prefix_refcount", "turn", "prev_reply_tokens", "context_tokens", "reply_tokens")


class FlatCakeStorage(HiCacheStorage):  # type: ignore[misc]
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        extra = storage_config.extra_config or {}
        self.socket = str(extra.get("socket", DEFAULT_SOCKET))
        self.is_mla = bool(storage_config.is_mla_model)
        c = storage_config
        suffix = "" if self.is_mla else f"@tp{c.tp_rank}of{c.tp_size}"
        if c.pp_size > 1:
            suffix += f"@pp{c.pp_rank}of{c.pp_size}"
        if c.attn_cp_size > 1:
            suffix += f"@cp{c.attn_cp_rank}of{c.attn_cp_size}"
        self.suffix = suffix
        self.writer = bool(getattr(c, "is_storage_writer", not self.is_mla or c.tp_rank == 0))
        self.engine: Engine | None = None

    # ---- wiring ----------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        key = (self.is_mla, str(pool.layout))
        if key not in LAYER_AXIS:
            raise ValueError(f"host pool layout {pool.layout!r} ({'MLA' if self.is_mla else 'MHA'}) is not supported; "
                             f"use one of {sorted(k[1] for k in LAYER_AXIS if k[0] == self.is_mla)}")  # fmt: skip
        self.axis = LAYER_AXIS[key]
        sample = pool.get_data_page(0, flat=False)
        self.page_shape = tuple(sample.shape)
        self.dtype = sample.dtype
        self.page_tokens = int(pool.page_size)
        self.layers = int(sample.shape[self.axis])
        self.raw_bytes = sample.numel() * sample.element_size() // self.layers
        self.page_bytes = round_up(self.raw_bytes)
        self.engine = connect(self.socket, layers=self.layers, page_bytes=self.page_bytes)
        log.info("FlatCake storage: %d layers x %d bytes per page (padded to %d), keys%s", self.layers,
                 self.raw_bytes, self.page_bytes, self.suffix or " shared by all ranks")  # fmt: skip

    def _engine(self) -> Engine:
        if self.engine is None:
            raise RuntimeError("FlatCakeStorage: register_mem_pool_host has not been called")
        return self.engine

    def _keys(self, keys: list[str]) -> list[str]:
        return [k + self.suffix for k in keys]

    def _hints(self, n: int, extra_info: HiCacheStorageExtraInfo | None) -> Hints:
        prefix = (extra_info.prefix_keys or []) if extra_info is not None else []
        fields: dict[str, Any] = {"turn": 2 if prefix else 1, "context_tokens": (len(prefix) + n) * self.page_tokens}
        passed = (extra_info.extra_info or {}) if extra_info is not None else {}
        fields.update({k: passed[k] for k in HINT_FIELDS if k in passed})
        fields["parent_key"] = prefix[-1] + self.suffix if prefix else None
        try:
            return Hints.from_dict(fields)
        except ValueError as exc:  # hints a request passed: its data, not our bug; the put fails, named
            raise ConfigError(f"extra_info.extra_info: {exc}") from None

    # ---- page conversion -------------------------------------------------------------------------
    def _layer_major(self, page: torch.Tensor) -> npt.NDArray[np.uint8]:
        """A host-pool page (natural shape) as ``[layers][raw_bytes]``."""
        moved = page.reshape(self.page_shape).movedim(self.axis, 0).contiguous()
        out: npt.NDArray[np.uint8] = moved.view(torch.uint8).reshape(self.layers, self.raw_bytes).numpy()
        return out

    def _natural_flat(self, layers: npt.NDArray[np.uint8]) -> torch.Tensor:
        """``[layers][page_bytes]`` back to the host pool's flat page order."""
        moved_shape = list(self.page_shape)
        moved_shape.insert(0, moved_shape.pop(self.axis))
        t = torch.from_numpy(np.ascontiguousarray(layers[:, : self.raw_bytes])).view(self.dtype).reshape(moved_shape)
        return t.movedim(0, self.axis).flatten()

    def _pack(self, pages: list[torch.Tensor]) -> npt.NDArray[np.uint8]:
        kv = aligned_empty((self.layers, len(pages), self.page_bytes))
        for j, page in enumerate(pages):
            kv[:, j, : self.raw_bytes] = self._layer_major(page)
        return kv

    def _put(self, keys: list[str], pages: list[torch.Tensor], extra_info: HiCacheStorageExtraInfo | None) -> bool:
        if not self.writer:
            return True  # MLA: rank 0 stores the shared pages
        try:
            self._engine().put(self._keys(keys), self._pack(pages), self._hints(len(keys), extra_info))
            return True
        except STORAGE_FAULTS as exc:
            log.warning("FlatCake storage: put of %d pages failed: %s", len(keys), exc)
            return False

    def _get(self, keys: list[str]) -> tuple[npt.NDArray[np.uint8], list[bool]]:
        """Restore the stored prefix of ``keys``; ok[i] says whether page i's bytes arrived."""
        engine = self._engine()
        names = self._keys(keys)
        dest = np.empty((self.layers, max(len(keys), 1), self.page_bytes), np.uint8)
        try:
            hit = engine.exists(names)
            if hit == 0:
                return dest, [False] * len(keys)
            with engine.get(names[:hit], dest) as restore:
                missing = restore.run()
        except STORAGE_FAULTS as exc:
            log.warning("FlatCake storage: get of %d pages failed: %s", len(keys), exc)
            return dest, [False] * len(keys)
        return dest, [i < hit and i not in missing for i in range(len(keys))]

    # ---- zero-copy v1 interface (extra_config interface_v1) ----------------------------------------
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:  # fmt: skip
        pool = self.mem_pool_host
        starts = host_indices[:: self.page_tokens].tolist()
        pages = [pool.get_data_page(int(i), flat=False) for i in starts]
        return [self._put(keys, pages, extra_info)] * len(keys)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:  # fmt: skip
        pool = self.mem_pool_host
        dest, ok = self._get(keys)
        for j, start in enumerate(host_indices[:: self.page_tokens].tolist()):
            if ok[j]:
                self._place(pool, int(start), dest[:, j])
        return ok

    def _place(self, pool: Any, start: int, layers: npt.NDArray[np.uint8]) -> None:
        """Copy one restored ``[layers][page_bytes]`` page into the host pool. Where the pool's page is a
        view of its buffer (SGLang's host pools slice ``kv_buffer``) that is one strided copy straight
        into place; otherwise the pool's own ``set_from_flat_data_page`` (two more copies)."""
        target = pool.get_data_page(start, flat=False)
        if target.untyped_storage().data_ptr() != pool.kv_buffer.untyped_storage().data_ptr():
            pool.set_from_flat_data_page(start, self._natural_flat(layers))
            return
        moved_shape = list(self.page_shape)
        moved_shape.insert(0, moved_shape.pop(self.axis))
        source = torch.from_numpy(layers[:, : self.raw_bytes]).view(self.dtype).reshape(moved_shape)
        target.copy_(source.movedim(0, self.axis))  # same shape: page_shape is this view's shape

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        try:
            return self._engine().exists(self._keys(keys))
        except STORAGE_FAULTS as exc:
            log.warning("FlatCake storage: exists failed: %s", exc)
            return 0

    # ---- tensor interface (v0) -------------------------------------------------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        result = self.batch_get([key], [target_location])
        return result[0] if isinstance(result, list) else None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        dest, ok = self._get(keys)
        out: list[Any] = []
        for j in range(len(keys)):
            if not ok[j]:
                out.append(None)
                continue
            flat = self._natural_flat(dest[:, j])
            target = target_locations[j] if target_locations is not None else None
            if target is None:
                out.append(flat)
            else:
                target.copy_(flat.view(target.dtype).reshape(target.shape))
                out.append(target)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:  # fmt: skip
        return self._put(keys, list(values), None)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def clear(self) -> None:
        """Nothing to do per process: the agent owns the cache (reclaim and wipe are the agent's)."""

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
