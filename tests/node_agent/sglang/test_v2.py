"""The v2 interface (hybrid and sparse models) through SGLang's real ABC, factory, ``PoolTransfer``,
``PoolHitPolicy`` and ``count_pool_hits``, against a running agent.

SGLang's sidecar host pools (``pool_host/dsa.py`` DSAIndexerPoolHost, ``pool_host/mha.py`` for SWA,
``pool_host/mamba.py`` MambaPoolHost) cannot be imported here, transformers now pinned or not: importing
any ``mem_cache/pool_host`` module runs ``pool_host/__init__.py:3`` -> ``group.py:11`` -> ``memory_pool.py:58``
-> ``configs/__init__.py:71`` -> ``configs/nano_nemotron_vl.py:22`` -> ``multimodal/internvl_utils.py:5``,
which imports torchvision. No torchvision build for the CPU torch 2.13.0 is available to install (the
index's 0.28.0 is the CUDA build: it fails with ``operator torchvision::nms does not exist``), and a
stand-in module breaks transformers' image utilities on import. ``FlatPool`` reproduces the interface the
backend uses, which all of them share
(``page_size``, ``get_data_page(index, flat=True)``, ``get_dummy_flat_data_page``,
``set_from_flat_data_page``), at each kind's page geometry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    count_pool_hits,
)

from flatcake.node_agent.sglang.backend import FlatCakeStorage
from tests.node_agent.sglang.test_backend import DIM, HEADS, LAYERS, PAGE, HostPool, make_backend
from tests.support.agents import AgentThread

pytestmark = pytest.mark.integration
Start = Callable[..., AgentThread]
PAGE_BYTES = 2 * PAGE * HEADS * DIM * 2


class FlatPool:
    """A sidecar host pool: ``slots`` pages of ``page_bytes`` bytes in ``dtype``, ``page_size`` tokens each."""

    def __init__(self, page_size: int, page_bytes: int, dtype: torch.dtype, slots: int = 16) -> None:
        self.page_size, self.dtype = page_size, dtype
        per_page = page_bytes // torch.tensor([], dtype=dtype).element_size()
        self.buf = (
            torch.randn(slots, per_page).to(dtype)
            if dtype.is_floating_point
            else torch.randint(0, 255, (slots, per_page), dtype=dtype)
        )

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self.buf[int(index) // self.page_size]

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros_like(self.buf[0])

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.buf[int(index) // self.page_size].copy_(data_page.reshape(-1))


# The kinds SGLang's hybrid pools expose: a KV-derived indexer (every page, DSA), SWA (a trailing window
# of pages, full KV geometry) and Mamba (one state per request tail, page_size 1, larger than a KV page).
KINDS = {
    PoolName.INDEXER: (FlatPool(PAGE, LAYERS * 1024, torch.uint8), PoolHitPolicy.ALL_PAGES),
    PoolName.SWA: (FlatPool(PAGE, LAYERS * PAGE_BYTES, torch.bfloat16), PoolHitPolicy.TRAILING_PAGES),
    PoolName.MAMBA: (FlatPool(1, 3 * LAYERS * PAGE_BYTES + 100, torch.float32), PoolHitPolicy.TRAILING_PAGES),
}


def hosts(pool: FlatPool, slots: range) -> torch.Tensor:
    return torch.cat([torch.arange(s * pool.page_size, (s + 1) * pool.page_size) for s in slots])


@pytest.mark.parametrize("kind", list(KINDS))
def test_v2_round_trip_per_cache_kind(agent_thread: Start, kind: PoolName) -> None:
    agent = agent_thread(layers=LAYERS, page_bytes=PAGE_BYTES, files=8, file_bytes=64 * LAYERS * PAGE_BYTES)
    kv_pool = HostPool(False, "page_first")
    backend = make_backend(agent, kv_pool)
    assert isinstance(backend, FlatCakeStorage)
    side, policy = KINDS[kind]
    backend.register_mem_host_pool_v2(kv_pool, PoolName.KV)
    backend.register_mem_host_pool_v2(side, kind)
    keys = [f"{i:064x}" for i in range(4)]
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    # KV through v1 (as the hybrid controller's base _page_backup does), the sidecar through v2 first.
    side_keys = keys if policy == PoolHitPolicy.ALL_PAGES else keys[-2:]
    start = 0 if policy == PoolHitPolicy.ALL_PAGES else 2
    stored = side.buf.clone()
    set_out = backend.batch_set_v2([PoolTransfer(kind, host_indices=hosts(side, range(start, 4)), keys=side_keys)],
                                   HiCacheStorageExtraInfo(prefix_keys=keys[:start]))  # fmt: skip
    assert count_pool_hits(set_out) == {kind: len(side_keys)}
    assert backend.batch_set_v1(keys, torch.arange(0, 4 * PAGE), info) == [True] * 4
    # Sidecar keys live in their own namespace: the KV names are untouched by them.
    assert backend.batch_exists(keys) == 4 and backend.batch_exists([f"{k}#{kind}" for k in keys]) == 0
    probe = PoolTransfer(kind, keys=side_keys, hit_policy=policy)
    result = backend.batch_exists_v2(keys, [probe], info)
    assert result.kv_hit_pages == 4 and result.extra_pool_hit_pages[kind] == 4
    if policy == PoolHitPolicy.TRAILING_PAGES:
        assert result.restorable_prefix_pages == [4]  # the state exists only at the tail it was written for
    else:
        assert result.restorable_prefix_pages == [1, 2, 3, 4]
    side.buf.zero_()
    got = backend.batch_get_v2([PoolTransfer(kind, host_indices=hosts(side, range(8, 8 + len(side_keys))),
                                             keys=side_keys)], info)  # fmt: skip
    assert got == {kind: [True] * len(side_keys)}
    for j in range(len(side_keys)):
        assert torch.equal(side.buf[8 + j], stored[start + j])
    # A missing sidecar page is a miss for that pool; a wrong index count fails the transfer, not the call.
    assert backend.batch_get_v2([PoolTransfer(kind, host_indices=hosts(side, range(1)), keys=["f" * 64])]) == {
        kind: [False]
    }
    assert (
        backend.batch_get_v2([PoolTransfer(kind, host_indices=torch.arange(1), keys=side_keys)])
        == {kind: [False] * len(side_keys)}
        or side.page_size == 1
    )
    backend.close()


def test_v2_kv_transfers_use_the_v1_path(agent_thread: Start) -> None:
    agent = agent_thread(layers=LAYERS, page_bytes=PAGE_BYTES, files=8, file_bytes=64 * LAYERS * PAGE_BYTES)
    kv_pool = HostPool(False, "layer_first")
    backend = make_backend(agent, kv_pool)
    keys = [f"{i:064x}" for i in range(3)]
    original = kv_pool.kv_buffer.clone()
    out = backend.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=torch.arange(0, 3 * PAGE), keys=keys)])
    assert out == {"kv": [True] * 3}
    kv_pool.kv_buffer.zero_()
    got = backend.batch_get_v2([PoolTransfer(PoolName.KV, host_indices=torch.arange(0, 3 * PAGE), keys=keys)])
    assert got == {"kv": [True] * 3}
    assert torch.equal(kv_pool.kv_buffer[:, :, : 3 * PAGE], original[:, :, : 3 * PAGE])
    assert backend.batch_exists_v2(keys).kv_hit_pages == 3
    backend.close()


class CopyingPool(FlatPool):
    """A pool whose flat pages are assembled copies (as a pool over several buffers would give)."""

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return super().get_data_page(index, flat).clone()


def _stored(agent_thread: Start, kind: PoolName, side: FlatPool) -> tuple[FlatCakeStorage, list[str], torch.Tensor]:
    agent = agent_thread(layers=LAYERS, page_bytes=PAGE_BYTES, files=8, file_bytes=64 * LAYERS * PAGE_BYTES)
    kv_pool = HostPool(False, "page_first")
    backend = make_backend(agent, kv_pool)
    backend.register_mem_host_pool_v2(kv_pool, PoolName.KV)
    backend.register_mem_host_pool_v2(side, kind)
    keys = [f"{i:064x}" for i in range(3)]
    out = backend.batch_set_v2([PoolTransfer(kind, host_indices=hosts(side, range(3)), keys=keys)])
    assert out == {kind: [True] * 3}
    return backend, keys, side.buf.clone()


@pytest.mark.parametrize("kind", list(KINDS))
def test_sidecar_pages_are_restored_in_place(agent_thread: Start, kind: PoolName,
                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    side = FlatPool(KINDS[kind][0].page_size, KINDS[kind][0].buf[0].numel() * KINDS[kind][0].buf.element_size(),
                    KINDS[kind][0].dtype)  # fmt: skip
    backend, keys, stored = _stored(agent_thread, kind, side)

    def no_copy(index: int, data_page: torch.Tensor) -> None:
        raise AssertionError("a sidecar page was copied into the pool instead of restored in place")

    monkeypatch.setattr(side, "set_from_flat_data_page", no_copy)
    sentinel = torch.full_like(side.buf.view(torch.uint8), 0xA5).view(side.dtype)
    side.buf.copy_(sentinel)
    slots = [9, 4, 12]  # not the order they were written from, nor contiguous
    got = backend.batch_get_v2([PoolTransfer(kind, host_indices=hosts(side, slots), keys=keys)])
    assert got == {kind: [True] * 3}
    for j, slot in enumerate(slots):
        assert torch.equal(side.buf[slot].view(torch.uint8), stored[j].view(torch.uint8)), (kind, slot)
    for other in set(range(len(side.buf))) - set(slots):  # a page's last chunk never spills into the next
        assert torch.equal(side.buf[other].view(torch.uint8), sentinel[other].view(torch.uint8)), (kind, other)
    backend.close()


def test_a_pool_that_copies_its_pages_keeps_the_copying_path(agent_thread: Start) -> None:
    side = CopyingPool(PAGE, LAYERS * 1024, torch.uint8)
    backend, keys, stored = _stored(agent_thread, PoolName.INDEXER, side)
    side.buf.zero_()
    got = backend.batch_get_v2([PoolTransfer(PoolName.INDEXER, host_indices=hosts(side, [5, 6, 7]), keys=keys)])
    assert got == {PoolName.INDEXER: [True] * 3}
    assert torch.equal(side.buf[5:8], stored[:3])
    backend.close()


def test_block_groups_report_the_pages_their_leading_complete_groups_cover(agent_thread: Start) -> None:
    side = FlatPool(PAGE, LAYERS * 1024, torch.uint8, slots=24)
    backend, keys, _ = _stored(agent_thread, PoolName.INDEXER, side)  # KV not stored yet: no KV hit
    kv_keys = [f"{i:064x}" for i in range(8)]
    assert backend.batch_set_v1(kv_keys, torch.arange(0, 8 * PAGE), HiCacheStorageExtraInfo(prefix_keys=[]))
    # Groups of 2 keys, each covering a block of 4 KV pages: keys 0-1 stored (group 0 whole), key 2 alone.
    group = PoolTransfer(PoolName.INDEXER, keys=[*keys, "e" * 64], hit_policy=PoolHitPolicy.BLOCK_GROUPS,
                         block_pages=4, group_pages=2)  # fmt: skip
    result = backend.batch_exists_v2(kv_keys, [group])
    assert result.kv_hit_pages == 8  # never gates the KV hit
    assert result.extra_pool_hit_pages[PoolName.INDEXER] == 4
    assert result.restorable_prefix_pages == list(range(1, 9))
    # Only blocks inside the KV prefix count: with 3 KV pages no block of 4 is covered.
    short = backend.batch_exists_v2(kv_keys[:3], [group])
    assert short.kv_hit_pages == 3 and PoolName.INDEXER not in short.extra_pool_hit_pages
    bad = dataclasses.replace(group, group_pages=0)
    assert PoolName.INDEXER not in backend.batch_exists_v2(kv_keys, [bad]).extra_pool_hit_pages
    backend.close()
