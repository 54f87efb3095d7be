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

Placement signals (Table 2) come from the key chain (``policy/signals.py``); what a chain cannot tell (the
expected reply length and reuse) from the ``placement_hints`` extra-config entry or the
``FLATCAKE_SGLANG_HINTS`` environment variable, and per request from ``extra_info.extra_info`` where a
caller fills it (SGLang 0.5.23's cache controller never does).

The v2 interface (``register_mem_host_pool_v2``, ``batch_exists_v2``, ``batch_get_v2``,
``batch_set_v2``; ``mem_cache/hicache_storage.py`` ``HiCacheStorage``, called by
``mem_cache/hybrid_cache/hybrid_cache_controller.py``) stores each sidecar pool (indexer, SWA, Mamba,
DeepSeek-V4 compressed pools, draft pools) under its own key namespace, ``<hash><suffix>#<pool>``, as
the flat pages SGLang's host pools give (``get_data_page(flat=True)``/``set_from_flat_data_page``),
cut into chunks of the agent's page geometry (``layers x page_bytes``); the KV pool keeps the v1 path.

Across nodes: when this node's agent names peers (``cluster.peers``), KV lookups and restores go on
where the local prefix ends, from another node's agent (``service/cluster.py``); sidecar pools are
looked up on this node only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from flatcake.node_agent.datapath.buffers import aligned_empty, round_up
from flatcake.node_agent.datapath.engine import Engine
from flatcake.node_agent.datapath.target import PagedTarget
from flatcake.node_agent.policy.placement import Hints
from flatcake.node_agent.policy.signals import ChainSignals, Run
from flatcake.node_agent.service.client import connect
from flatcake.node_agent.service.cluster import Cluster
from flatcake.node_agent.service.hints import deployment_hints, run_hints
from flatcake.node_agent.sglang.keys import DEFAULT_SOCKET, STORAGE_FAULTS, key_suffix

log = logging.getLogger(__name__)

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
KV = PoolName.KV.value


class FlatCakeStorage(HiCacheStorage):  # type: ignore[misc]
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        extra = storage_config.extra_config or {}
        self.socket = str(extra.get("socket", DEFAULT_SOCKET))
        self.is_mla = bool(storage_config.is_mla_model)
        c = storage_config
        # Every key builder appends the suffix (ranks, tenant): the linker derives the same one (keys.py).
        suffix = key_suffix(mla=self.is_mla, tp_rank=c.tp_rank, tp_size=c.tp_size, pp_rank=c.pp_rank,
                            pp_size=c.pp_size, cp_rank=c.attn_cp_rank, cp_size=c.attn_cp_size, extra=extra)  # fmt: skip
        self.suffix = suffix
        # Mamba state is sharded across TP ranks even when the model's MLA cache is replicated
        # (hicache_storage.py HiCacheFile._get_suffixed_key), so it always carries the rank.
        self.rank_suffix = suffix if not self.is_mla else f"@tp{c.tp_rank}of{c.tp_size}" + suffix
        self.writer = bool(getattr(c, "is_storage_writer", not self.is_mla or c.tp_rank == 0))
        self.engine: Engine | None = None
        self.cluster: Cluster | None = None  # other nodes' agents, when this node's agent names peers
        self.target: PagedTarget | None = None  # the host pool as a restore destination (_host_target)
        self._memory_base = 0
        self.signals = ChainSignals(int(extra.get("signal_capacity", 1 << 16)))
        self.defaults = deployment_hints(extra)
        self.pools: dict[str, Any] = {}  # sidecar host pools by name (register_mem_host_pool_v2)
        self._sidecar_geometry: dict[str, tuple[int, torch.dtype]] = {}  # flat bytes per page, dtype

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
        cluster = self.engine.config.cluster
        if cluster.peers or cluster.listen:  # KV pages this node lacks may come from another node's agent
            self.cluster = Cluster(self.engine)
        self.target = self._host_target(pool)
        log.info("FlatCake storage: restores %s", "land in the host pool in place" if self.target else
                 "copy into the host pool (its pages are not views of one CPU buffer)")  # fmt: skip
        log.info("FlatCake storage: %d layers x %d bytes per page (padded to %d), keys%s", self.layers,
                 self.raw_bytes, self.page_bytes, self.suffix or " shared by all ranks")  # fmt: skip

    def _host_target(self, pool: Any) -> PagedTarget | None:
        """Where each stored page-layer lies in the host pool's own buffer, so restores write there in place.

        Derived from the strides of ``get_data_page(index, flat=False)``, which SGLang's host pools return as a
        view of ``kv_buffer`` for ``layer_first``, ``page_first`` and ``page_first_direct`` (``pool_host/mha.py``
        and ``pool_host/mla.py`` ``get_data_page``): the page's layer axis moved first, its other axes in order,
        is the stored row (``_layer_major``); trailing axes contiguous in memory merge into one piece. Pages
        whose addresses are not views of one contiguous CPU buffer (a list of buffers, device memory, a pool
        that copies) keep the copying path (``_place``)."""
        buf = getattr(pool, "kv_buffer", None)
        if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu" or not buf.is_contiguous():
            return None
        page = pool.get_data_page(0, flat=False)
        if not isinstance(page, torch.Tensor) or page.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
            return None
        memory: npt.NDArray[np.uint8] = buf.view(torch.uint8).reshape(-1).numpy()
        self._memory_base = int(memory.ctypes.data)
        moved = page.movedim(self.axis, 0)
        size = page.element_size()
        shape, strides = list(moved.shape[1:]), list(moved.stride()[1:])
        block, i = 1, len(shape)
        while i and (shape[i - 1] == 1 or strides[i - 1] == block):
            block *= shape[i - 1]
            i -= 1
        offsets = np.zeros(1, np.int64)
        for n, stride in zip(shape[:i], strides[:i], strict=True):  # outer axes in C order: the row's order
            offsets = (offsets[:, None] + np.arange(n, dtype=np.int64)[None, :] * stride).reshape(-1)
        if len(offsets) * block * size != self.raw_bytes:
            return None
        return PagedTarget(memory, self.layers, [], moved.stride(0) * size, offsets * size, block * size)

    def _target_for(self, pool: Any, starts: Sequence[int]) -> PagedTarget:
        """The host target for pages at token indexes ``starts`` (each page's address asked of the pool)."""
        t = self.target
        assert t is not None
        offsets = [pool.get_data_page(s, flat=False).data_ptr() - self._memory_base for s in starts]
        return PagedTarget(t.memory, t.layers, offsets, t.layer_stride, t.piece_offsets, t.piece_bytes)

    def _engine(self) -> Engine:
        if self.engine is None:
            raise RuntimeError("FlatCakeStorage: register_mem_pool_host has not been called")
        return self.engine

    def _keys(self, keys: list[str]) -> list[str]:
        return [k + self.suffix for k in keys]

    @staticmethod
    def _prefix(extra_info: HiCacheStorageExtraInfo | None) -> list[str]:
        return list(extra_info.prefix_keys or []) if extra_info is not None else []

    def _observe(self, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None) -> None:
        """Every call that names a chain feeds the continuation counts (lookups too: a request waiting
        on a prompt shows it is shared before the prompt is written)."""
        self.signals.observe(self._prefix(extra_info), keys)

    def _hints(self, run: Run, extra_info: HiCacheStorageExtraInfo | None, namer: Any) -> Hints:
        """Table 2's hints for one run: derived fields, then the deployment's, then the request's."""
        passed = (extra_info.extra_info or {}) if extra_info is not None else {}
        return run_hints(run, self.defaults, passed, namer, "extra_info.extra_info")

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
        return self._store(keys, self._pack(pages), 1, lambda k: k + self.suffix, extra_info, record=True)

    def _store(self, keys: list[str], kv: npt.NDArray[np.uint8], chunks: int, namer: Any,
               extra_info: HiCacheStorageExtraInfo | None, *, record: bool) -> bool:  # fmt: skip
        """Put ``kv`` (``[layers][len(keys) * chunks][page_bytes]``) run by run: a prompt shared by several
        live requests apart from the request's own pages, each with its own hints."""
        runs = self.signals.write(self._prefix(extra_info), keys, self.page_tokens)
        try:
            for run in runs:
                names = [namer(k) if chunks == 1 else f"{namer(k)}/{c}" for k in keys[run.start : run.stop]
                         for c in range(chunks)]  # fmt: skip
                last = namer if chunks == 1 else (lambda k: f"{namer(k)}/{chunks - 1}")
                part = kv[:, run.start * chunks : run.stop * chunks]
                if len(runs) > 1:  # a slice of a layer-major buffer is strided: the engine takes aligned C order
                    part, view = aligned_empty(part.shape), part
                    part[...] = view
                self._engine().put(names, part, self._hints(run, extra_info, last))
        except STORAGE_FAULTS as exc:
            log.warning("FlatCake storage: put of %d pages failed: %s", len(keys), exc)
            return False
        if record:
            self.signals.record(keys, runs)
        return True

    def _get(self, keys: list[str], names: list[str] | None = None) -> tuple[npt.NDArray[np.uint8], list[bool]]:
        """Restore the stored prefix of ``names`` (default: the KV names of ``keys``) into a fresh
        ``[layers][entries][page_bytes]`` buffer; ok[i] says whether entry i's bytes arrived."""
        names = self._keys(keys) if names is None else names
        dest = aligned_empty((self.layers, max(len(names), 1), self.page_bytes))  # aligned: read in place
        return dest, self._restore(names, lambda hit: dest)

    def _restore(self, names: list[str], dest_for: Any) -> list[bool]:
        """Restore the stored prefix of ``names`` into ``dest_for(hit)`` (its first ``hit`` pages); ok[i]
        says whether entry i's bytes arrived."""
        engine = self._engine()
        try:
            hit = (self.cluster or engine).exists(names)
            if hit == 0:
                return [False] * len(names)
            if self.cluster is not None:  # the local prefix, then a peer's continuation
                missing = self.cluster.restore(names[:hit], dest_for(hit))
            else:
                with engine.get(names[:hit], dest_for(hit)) as restore:
                    missing = restore.run()
        except STORAGE_FAULTS as exc:
            log.warning("FlatCake storage: get of %d pages failed: %s", len(names), exc)
            return [False] * len(names)
        return [i < hit and i not in missing for i in range(len(names))]

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
        self._observe(keys, extra_info)
        if self.target is not None:  # zero-copy: the restore's scatter writes the host pool's pages in place
            starts = [int(s) for s in host_indices[:: self.page_tokens].tolist()]
            return self._restore(self._keys(keys), lambda hit: self._target_for(pool, starts[:hit]))
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
        self._observe(keys, extra_info)
        try:
            return (self.cluster or self._engine()).exists(self._keys(keys))
        except STORAGE_FAULTS as exc:
            log.warning("FlatCake storage: exists failed: %s", exc)
            return 0

    # ---- v2 interface: the KV pool and its sidecar pools (hybrid and sparse models) ----------------
    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang registers every host pool of its ``HostPoolGroup`` here after ``register_mem_pool_host``
        (``HybridCacheController.attach_storage_backend``, ``register_host_pool_entry`` for sidecars
        added later). A sidecar page is stored as its flat bytes cut into ``chunks`` engine pages."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == KV:
            return  # the anchor pool: register_mem_pool_host already took its geometry
        sample = host_pool.get_dummy_flat_data_page()
        flat_bytes = int(sample.numel() * sample.element_size())
        self.pools[name] = host_pool
        self._sidecar_geometry[name] = (flat_bytes, sample.dtype)
        log.info("FlatCake storage: pool %s, %d bytes per page in %d chunk(s)", name, flat_bytes,
                 self._chunks(name))  # fmt: skip

    def _chunks(self, name: str) -> int:
        span = self.layers * self.page_bytes
        return max(1, -(-self._sidecar_geometry[name][0] // span))

    def _namer(self, name: str) -> Any:
        # Mamba state is per rank under MLA too; other sidecars follow the KV pool's sharing.
        suffix = self.rank_suffix if name == PoolName.MAMBA.value else self.suffix
        return lambda k: f"{k}{suffix}#{name}"

    def _sidecar_names(self, name: str, keys: Sequence[str]) -> list[str]:
        namer, chunks = self._namer(name), self._chunks(name)
        return [namer(k) if chunks == 1 else f"{namer(k)}/{c}" for k in keys for c in range(chunks)]

    def _pool(self, name: str) -> Any:
        if name not in self.pools:
            raise ValueError(f"pool {name!r}: not registered; SGLang registers pools with register_mem_host_pool_v2 "
                             f"(registered: {sorted(self.pools)})")  # fmt: skip
        return self.pools[name]

    def _indices_ok(self, op: str, transfer: PoolTransfer, page_size: int) -> bool:
        n = len(transfer.keys or [])
        got = 0 if transfer.host_indices is None else int(transfer.host_indices.numel())
        if got != n * page_size:  # SGLang answers this as a failed transfer, not an exception (HiCacheFile)
            log.error("FlatCake storage: %s %s: %d host indices for %d keys of %d tokens", op, transfer.name, got, n,
                      page_size)  # fmt: skip
            return False
        return True

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:  # fmt: skip
        """The stored KV prefix, cut by each sidecar pool's hit policy (``PoolHitPolicy``): ALL_PAGES needs
        every page of the prefix, TRAILING_PAGES the last ``len(keys)`` pages before a prefix length
        (so restorable lengths can be sparse: ``restorable_prefix_pages``). BLOCK_GROUPS (a second form of
        the KV pages, e.g. compressed blocks: ``group_pages`` keys per block of ``block_pages`` KV pages) reports
        the KV pages its leading complete groups cover, within the KV prefix, and never cuts the KV hit."""
        kv_hit = self.batch_exists(keys, extra_info)
        hits: dict[str, int] = {KV: kv_hit} if kv_hit else {}
        restorable = set(range(1, kv_hit + 1))
        engine = self._engine()
        try:
            for t in pool_transfers or []:
                name = str(t.name)
                if name == KV or not restorable:
                    continue
                chunks = self._chunks(name)
                if t.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
                    covered = self._block_groups(name, t, kv_hit)
                    if covered:
                        hits[name] = covered
                    continue
                if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                    boundary = engine.exists(self._sidecar_names(name, keys[:kv_hit])) // chunks
                    ok = set(range(1, boundary + 1))
                else:  # TRAILING_PAGES: which pages hold a state, then which lengths end a full window
                    window = max(1, len(t.keys or []))
                    have = [engine.exists(self._sidecar_names(name, [k])) == chunks for k in keys[:kv_hit]]
                    ok = {n for n in range(1, kv_hit + 1) if all(have[max(0, n - window) : n])}
                    boundary = max(ok, default=0)
                if boundary:
                    hits[name] = boundary
                restorable &= ok
        except STORAGE_FAULTS as exc:
            log.warning("FlatCake storage: exists_v2 failed: %s", exc)
            return PoolTransferResult.empty()
        pages = sorted(restorable)
        return PoolTransferResult(pages[-1] if pages else 0, hits, pages)

    def _sidecar_target(self, name: str, pool: Any, starts: Sequence[int]) -> PagedTarget | None:
        """The sidecar pages at token indexes ``starts`` as a restore destination in the pool's own memory, or
        None where the pool's flat pages are not views of one CPU buffer (a pool that assembles or copies
        them keeps ``set_from_flat_data_page``). Chunk ``c`` of a page lands at ``c x layers x page_bytes``
        of its flat bytes, layer by layer, cut at the page's end (``PagedTarget`` limits)."""
        if not starts:
            return None
        flat_bytes = self._sidecar_geometry[name][0]
        views = [pool.get_data_page(s, flat=True) for s in starts]
        first = views[0]
        if not isinstance(first, torch.Tensor) or first.device.type != "cpu":
            return None
        storage = first.untyped_storage()
        # A pool that copies answers each call with a new tensor of its own: ask twice, same storage or no.
        again = pool.get_data_page(starts[0], flat=True)
        if again.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        for v in views:
            if (not v.is_contiguous() or v.untyped_storage().data_ptr() != storage.data_ptr()
                    or v.numel() * v.element_size() != flat_bytes):  # fmt: skip
                return None
        memory: npt.NDArray[np.uint8] = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
        base = int(memory.ctypes.data)
        span, chunks = self.layers * self.page_bytes, self._chunks(name)
        offsets = [v.data_ptr() - base + c * span for v in views for c in range(chunks)]
        limits = [flat_bytes - c * span for _ in views for c in range(chunks)]
        return PagedTarget(memory, self.layers, offsets, self.page_bytes, [0], self.page_bytes, limits)

    def _block_groups(self, name: str, t: PoolTransfer, kv_hit: int) -> int:
        """KV pages covered by the leading groups of ``t.keys`` stored whole: group g is keys
        ``[g * group_pages, (g + 1) * group_pages)`` and covers KV pages ``[g * block_pages, (g + 1) * block_pages)``;
        only groups whose block lies inside the KV prefix count (hicache_storage.py ``PoolHitPolicy``)."""
        group, block = int(t.group_pages), int(t.block_pages)
        if group < 1 or block < 1:
            log.error("FlatCake storage: exists %s: block_groups needs group_pages and block_pages >= 1 (got %d, %d)",
                      name, group, block)  # fmt: skip
            return 0
        keys = list(t.keys or [])
        groups = min(len(keys) // group, kv_hit // block)
        names = self._sidecar_names(name, keys[: groups * group])
        stored = self._engine().exists(names) // (self._chunks(name) * group) if names else 0
        return stored * block

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:  # fmt: skip
        out: dict[str, list[bool]] = {}
        for t in transfers:
            name, keys = str(t.name), list(t.keys or [])
            if name == KV:
                out[name] = self.batch_get_v1(keys, t.host_indices, extra_info) if keys else []
                continue
            pool = self._pool(name)
            page_size = int(getattr(pool, "page_size", 1) or 1)
            if not self._indices_ok("get", t, page_size):
                out[name] = [False] * len(keys)
                continue
            chunks = self._chunks(name)
            flat_bytes, dtype = self._sidecar_geometry[name]
            starts = [int(t.host_indices[i * page_size]) for i in range(len(keys))]
            target = self._sidecar_target(name, pool, starts)
            if target is not None:  # in place: the restore's scatter writes each chunk into the pool's page
                ok = self._restore(self._sidecar_names(name, keys), target.head)
                out[name] = [all(ok[i * chunks : (i + 1) * chunks]) for i in range(len(keys))]
                continue
            dest, ok = self._get(keys, self._sidecar_names(name, keys))
            # [layers][entries][page_bytes] -> [entries][layers * page_bytes]: a chunk's bytes in order
            by_chunk = dest.transpose(1, 0, 2).reshape(dest.shape[1], -1)
            result = []
            for i in range(len(keys)):
                if not all(ok[i * chunks : (i + 1) * chunks]):
                    result.append(False)
                    continue
                raw = np.ascontiguousarray(by_chunk[i * chunks : (i + 1) * chunks]).reshape(-1)[:flat_bytes]
                page = torch.from_numpy(raw.copy()).view(dtype)
                pool.set_from_flat_data_page(starts[i], page)
                result.append(True)
            # SGLang counts a pool's hits as the leading run of successes (count_pool_hits)
            out[name] = result
        return out

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:  # fmt: skip
        out: dict[str, list[bool]] = {}
        for t in transfers:
            name, keys = str(t.name), list(t.keys or [])
            if name == KV:
                out[name] = self.batch_set_v1(keys, t.host_indices, extra_info) if keys else []
                continue
            pool = self._pool(name)
            page_size = int(getattr(pool, "page_size", 1) or 1)
            if not self._indices_ok("set", t, page_size):
                out[name] = [False] * len(keys)
                continue
            if not keys or (not self.writer and name != PoolName.MAMBA.value):
                out[name] = [True] * len(keys)  # MLA: rank 0 stores replicated sidecars; Mamba is per rank
                continue
            chunks = self._chunks(name)
            flat_bytes = self._sidecar_geometry[name][0]
            span = self.layers * self.page_bytes
            by_chunk = np.zeros((len(keys) * chunks, span), np.uint8)
            for i in range(len(keys)):
                page = pool.get_data_page(int(t.host_indices[i * page_size]), flat=True)
                raw = page.contiguous().view(torch.uint8).numpy()
                if raw.size != flat_bytes:
                    raise ValueError(f"pool {name}: a page of {raw.size} bytes, registered with {flat_bytes}")
                by_chunk[i * chunks : (i + 1) * chunks].reshape(-1)[:flat_bytes] = raw
            kv = aligned_empty((self.layers, len(keys) * chunks, self.page_bytes))
            kv[...] = by_chunk.reshape(len(keys) * chunks, self.layers, self.page_bytes).transpose(1, 0, 2)
            # The sidecar follows its KV chain's signals; its own namespace keeps its own scope chain.
            ok = self._store(keys, kv, chunks, self._namer(name), extra_info, record=False)
            out[name] = [ok] * len(keys)
        return out

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
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None
