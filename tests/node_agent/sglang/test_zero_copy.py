"""Zero-copy restores: pages land in SGLang's host pool in its own layout, written in place by the
restore's scatter (no ``[layers][pages][page_bytes]`` buffer, no copy after), bit-exact, for every host
layout SGLang 0.5.23 gives a HiCache storage backend (``layer_first``, ``page_first``,
``page_first_direct``; MHA and MLA). ``HostPool`` reproduces those layouts (see test_backend.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

from flatcake.node_agent.sglang.backend import FlatCakeStorage
from tests.node_agent.sglang.test_backend import DIM, HEADS, LAYERS, MLA_DIM, PAGE, PAGES, HostPool, make_backend
from tests.support.agents import AgentThread

pytestmark = pytest.mark.integration
Start = Callable[..., AgentThread]
LAYOUTS = [(mla, layout) for mla in (False, True) for layout in ("layer_first", "page_first", "page_first_direct")]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)  # compare bf16 bit patterns, not values


def _no_copy(*_: Any, **__: Any) -> None:
    raise AssertionError("a restore copied through an intermediate buffer")


@pytest.mark.parametrize(("mla", "layout"), LAYOUTS)
def test_restores_land_in_the_host_pool_in_place_bit_exact(
    agent_thread: Start, monkeypatch: pytest.MonkeyPatch, mla: bool, layout: str
) -> None:
    page_bytes = PAGE * MLA_DIM * 2 if mla else 2 * PAGE * HEADS * DIM * 2
    agent = agent_thread(layers=LAYERS, page_bytes=page_bytes, files=8, file_bytes=64 * LAYERS * page_bytes,
                         io={"verify_reads": "all"})  # fmt: skip
    pool = HostPool(mla, layout)
    backend = make_backend(agent, pool)
    assert isinstance(backend, FlatCakeStorage) and backend.target is not None
    original = pool.kv_buffer.clone()
    keys = [f"{i:064x}" for i in range(6)]
    # A shared prompt (DRAM) and a one-shot request (SSD): both media restore in place.
    shared = HiCacheStorageExtraInfo(extra_info={"expected_reuse": 4})
    assert backend.batch_set_v1(keys[:2], torch.arange(0, 2 * PAGE), shared) == [True] * 2
    assert backend.batch_set_v1(keys[2:], torch.arange(2 * PAGE, 6 * PAGE)) == [True] * 4
    placed = agent.agent.catalog.placements.snapshot()
    assert sum(v for k, v in placed.items() if k.startswith("dram/")) == 2
    assert sum(v for k, v in placed.items() if k.startswith("ssd/")) == 4

    monkeypatch.setattr(FlatCakeStorage, "_place", _no_copy)
    monkeypatch.setattr(FlatCakeStorage, "_natural_flat", _no_copy)
    pool.kv_buffer.view(torch.int16).fill_(0x5A5A)  # a sentinel: anything not restored must keep it
    sentinel = pool.kv_buffer.clone()
    slots = [11, 7, 8, 6, 10, 9]  # out of order, not contiguous with the stored slots
    indices = torch.cat([torch.arange(s * PAGE, (s + 1) * PAGE) for s in slots])
    before = backend.engine.stats.snapshot()
    assert backend.batch_get_v1(keys, indices) == [True] * 6
    after = backend.engine.stats.snapshot()
    assert after.get("restore_pages_dram", 0) - before.get("restore_pages_dram", 0) == 2
    assert after.get("restore_pages_ssd", 0) - before.get("restore_pages_ssd", 0) == 4
    assert after.get("verify_failures", 0) == 0

    def page(buffer: torch.Tensor, slot: int) -> torch.Tensor:
        copy = HostPool.__new__(HostPool)
        copy.__dict__.update(pool.__dict__)
        copy.kv_buffer = buffer
        return _bits(copy.get_data_page(slot * PAGE, flat=False))

    for j, slot in enumerate(slots):
        assert torch.equal(page(pool.kv_buffer, slot), page(original, j)), (j, slot)
    for slot in set(range(PAGES)) - set(slots):
        assert torch.equal(page(pool.kv_buffer, slot), page(sentinel, slot)), slot  # nothing written outside
    backend.close()


def test_a_pool_whose_pages_are_not_views_keeps_the_copying_path(agent_thread: Start) -> None:
    agent = agent_thread(layers=LAYERS, page_bytes=2 * PAGE * HEADS * DIM * 2, files=8)
    pool = HostPool(False, "page_first")
    pool.kv_buffer = pool.kv_buffer.transpose(1, 2).contiguous().transpose(1, 2)  # strided: not one C buffer
    backend = make_backend(agent, pool)
    assert isinstance(backend, FlatCakeStorage) and backend.target is None
    original = pool.kv_buffer.clone()
    assert backend.batch_set_v1(["a" * 64], torch.arange(0, PAGE)) == [True]
    pool.kv_buffer.zero_()
    assert backend.batch_get_v1(["a" * 64], torch.arange(PAGE, 2 * PAGE)) == [True]
    assert torch.equal(_bits(pool.kv_buffer[:, PAGE : 2 * PAGE]), _bits(original[:, :PAGE]))
    backend.close()
