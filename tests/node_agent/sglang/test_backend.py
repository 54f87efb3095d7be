"""The SGLang HiCache backend through SGLang's real ABC and backend factory, against a running agent.

SGLang's host KV pools cannot be built here (they pull in transformers, torchvision and a device
pool), so ``HostPool`` is the load generator's reproduction of their page layouts as SGLang 0.5.23
defines them (flatcake.loadgen.systems.sglang: ``kv_buffer`` shapes for ``layer_first``, ``page_first``
and ``page_first_direct``, ``get_data_page``, ``set_from_flat_data_page``), at small dimensions.
Everything else is SGLang's own code.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from flatcake.loadgen.systems.sglang import HostPool as SGLangHostPool
from flatcake.node_agent.sglang.backend import FlatCakeStorage
from tests.support.agents import AgentThread

pytestmark = pytest.mark.integration

LAYERS, PAGE, HEADS, DIM, PAGES = 4, 16, 2, 64, 12  # MHA page: 2*16*2*64*2 B = 8 KiB per layer
MLA_DIM = 128  # MLA page: 16*128*2 B = 4 KiB per layer


class HostPool(SGLangHostPool):
    """The shared emulation of SGLang's host pool (flatcake.loadgen.systems.sglang) at this file's small
    dimensions, bf16, filled with random values."""

    def __init__(self, mla: bool, layout: str) -> None:
        super().__init__(pages=PAGES, page_size=PAGE, layers=LAYERS, mla=mla, layout=layout, dtype=torch.bfloat16,
                         mla_dim=MLA_DIM, heads=HEADS, head_dim=DIM)  # fmt: skip
        self.kv_buffer.copy_(torch.randn(self.kv_buffer.shape))


def make_backend(agent: AgentThread, pool: HostPool, tp_rank: int = 0, tp_size: int = 1,
                 module: str = "flatcake.node_agent.sglang", extra: dict[str, Any] | None = None) -> HiCacheStorage:  # fmt: skip
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=pool.mla, enable_storage_metrics=False, is_page_first_layout=pool.layout != "layer_first",
        model_name="test/model",
        extra_config={"backend_name": "flatcake", "module_path": module,
                      "class_name": "FlatCakeStorage", "socket": agent.socket, "interface_v1": True, **(extra or {})},
    )  # fmt: skip
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    assert isinstance(backend, HiCacheStorage) and isinstance(backend, FlatCakeStorage)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


Start = Callable[..., AgentThread]


@pytest.mark.parametrize(("mla", "layout"), [(False, "layer_first"), (False, "page_first"),
                                              (True, "layer_first"), (True, "page_first")])  # fmt: skip
def test_v1_round_trip_through_the_abc(agent_thread: Start, mla: bool, layout: str) -> None:
    page_bytes = PAGE * MLA_DIM * 2 if mla else 2 * PAGE * HEADS * DIM * 2
    agent = agent_thread(layers=LAYERS, page_bytes=page_bytes, files=8, file_bytes=64 * LAYERS * page_bytes)
    pool = HostPool(mla, layout)
    backend = make_backend(agent, pool)
    original = pool.kv_buffer.clone()
    keys = [f"{i:064x}" for i in range(6)]
    first = torch.arange(0, 3 * PAGE)
    assert backend.batch_set_v1(keys[:3], first) == [True] * 3
    # The next turn's pages name their prefix: the backend derives a short second turn.
    later = torch.arange(3 * PAGE, 6 * PAGE)
    extra = HiCacheStorageExtraInfo(prefix_keys=keys[:3])
    assert backend.batch_set_v1(keys[3:], later, extra) == [True] * 3
    assert backend.batch_exists(keys) == 6 and backend.batch_exists(["f" * 64, *keys]) == 0
    assert backend.exists(keys[0]) and not backend.exists("e" * 64)
    # Restore into other host slots and compare with what was stored.
    pool.kv_buffer.zero_()
    target = torch.arange(6 * PAGE, 12 * PAGE)
    assert backend.batch_get_v1([*keys, "d" * 64], torch.arange(6 * PAGE, 13 * PAGE)[: 7 * PAGE]) == [True] * 6 + [
        False
    ]
    for j in range(6):
        got = pool.get_data_page(int(target[j * PAGE]), flat=False)
        want = HostPool.get_data_page(_with_buffer(pool, original), j * PAGE, flat=False)
        assert torch.equal(got, want), j
    placements = agent.agent.catalog.placements.snapshot()
    # The second write continues the first with a short turn: a short chat, in a DRAM scope of its own.
    assert placements == {"ssd/one_shot": 3, "dram/short_chat": 3}
    backend.close()


def test_two_tenants_with_one_prompt_never_share_a_page(agent_thread: Start) -> None:
    """extra config tenant (the webhook sets the pod's namespace): one cache, one prompt, two tenants, two
    sets of pages; a second process of the same tenant finds its tenant's."""
    from flatcake.errors import ConfigError

    page_bytes = 2 * PAGE * HEADS * DIM * 2
    agent = agent_thread(layers=LAYERS, page_bytes=page_bytes, files=8, file_bytes=64 * LAYERS * page_bytes)
    keys = [f"{i:064x}" for i in range(3)]
    a, b = make_backend(agent, HostPool(False, "page_first"), extra={"tenant": "team-a"}), None
    try:
        assert a.batch_set_v1(keys, torch.arange(0, 3 * PAGE)) == [True] * 3
        b = make_backend(agent, HostPool(False, "page_first"), extra={"tenant": "team-b"})
        assert a.batch_exists(keys) == 3 and b.batch_exists(keys) == 0
        assert b.batch_get_v1(keys, torch.arange(0, 3 * PAGE)) == [False] * 3
        again = make_backend(agent, HostPool(False, "page_first"), extra={"tenant": "team-a"})
        assert again.batch_exists(keys) == 3
        again.close()
        untenanted = make_backend(agent, HostPool(False, "page_first"))
        assert untenanted.batch_exists(keys) == 0
        untenanted.close()
        assert agent.agent.catalog.table.pages() == 3  # one set stored, nothing shared
        with pytest.raises(ConfigError, match="tenant: 'team a/b' must be 1-63 letters"):
            make_backend(agent, HostPool(False, "page_first"), extra={"tenant": "team a/b"})
    finally:
        a.close()
        if b is not None:
            b.close()


def _with_buffer(pool: HostPool, buffer: torch.Tensor) -> HostPool:
    copy = HostPool.__new__(HostPool)
    copy.__dict__.update(pool.__dict__)
    copy.kv_buffer = buffer
    return copy


def test_v0_tensor_interface(agent_thread: Start) -> None:
    agent = agent_thread(layers=LAYERS, page_bytes=2 * PAGE * HEADS * DIM * 2)
    pool = HostPool(False, "layer_first")
    backend = make_backend(agent, pool)
    pages = [pool.get_data_page(i * PAGE).clone() for i in range(2)]
    assert backend.batch_set(["a" * 64, "b" * 64], pages)
    assert backend.set("c" * 64, pool.get_data_page(2 * PAGE).clone())
    out = torch.empty_like(pages[0])
    assert backend.get("a" * 64, out) is out and torch.equal(out, pages[0])
    got = backend.batch_get(["b" * 64, "z" * 64], [torch.empty_like(pages[1]), torch.empty_like(pages[1])])
    assert torch.equal(got[0], pages[1]) and got[1] is None
    assert backend.get("z" * 64, torch.empty_like(out)) is None
    backend.close()


def test_mha_keys_are_per_rank_and_mla_keys_are_shared(agent_thread: Start) -> None:
    agent = agent_thread(layers=LAYERS, page_bytes=2 * PAGE * HEADS * DIM * 2, files=8)
    pools = [HostPool(False, "layer_first") for _ in range(2)]
    ranks = [make_backend(agent, pools[r], tp_rank=r, tp_size=2) for r in range(2)]
    key = ["1" * 64]
    for r in range(2):
        assert ranks[r].batch_set_v1(key, torch.arange(0, PAGE)) == [True]
    originals = [p.get_data_page(0, flat=False).clone() for p in pools]
    for r in range(2):
        pools[r].kv_buffer.zero_()
        assert ranks[r].batch_get_v1(key, torch.arange(PAGE, 2 * PAGE)) == [True]
        assert torch.equal(pools[r].get_data_page(PAGE, flat=False), originals[r])  # its own heads
    assert not torch.equal(originals[0], originals[1])
    for b in ranks:
        b.close()


def test_mla_non_writer_ranks_do_not_write(agent_thread: Start) -> None:
    agent = agent_thread(layers=LAYERS, page_bytes=PAGE * MLA_DIM * 2)
    pools = [HostPool(True, "page_first") for _ in range(2)]
    rank0, rank1 = (make_backend(agent, pools[r], tp_rank=r, tp_size=2) for r in range(2))
    assert rank1.batch_set_v1(["2" * 64], torch.arange(0, PAGE)) == [True]
    assert rank1.batch_exists(["2" * 64]) == 0  # rank 1 skipped the write
    assert rank0.batch_set_v1(["2" * 64], torch.arange(0, PAGE)) == [True]
    assert rank1.batch_exists(["2" * 64]) == 1  # shared key, visible to every rank
    rank0.close()
    rank1.close()


def test_geometry_mismatch_fails_at_registration(agent_thread: Start) -> None:
    agent = agent_thread(layers=LAYERS + 1, page_bytes=2 * PAGE * HEADS * DIM * 2)
    with pytest.raises(ValueError, match="layers: the client's model has 4"):
        make_backend(agent, HostPool(False, "layer_first"))


@pytest.mark.parametrize("module", ["flatcake.node_agent.sglang", "flatcake.node_agent.sglang_backend"])
def test_both_module_paths_load_through_the_dynamic_factory(agent_thread: Start, module: str) -> None:
    """``sglang_backend`` is the path configurations written before the layout moved still name."""
    page_bytes = 2 * PAGE * HEADS * DIM * 2
    agent = agent_thread(layers=LAYERS, page_bytes=page_bytes, files=8, file_bytes=64 * LAYERS * page_bytes)
    pool = HostPool(False, "page_first")
    backend = make_backend(agent, pool, module=module)
    keys = [f"{i:064x}" for i in range(2)]
    assert backend.batch_set_v1(keys, torch.arange(0, 2 * PAGE)) == [True, True]
    assert backend.batch_exists(keys) == 2


class CopyingHostPool(HostPool):
    """A host pool whose pages are copies, not views: the backend must go through set_from_flat_data_page."""

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return super().get_data_page(index, flat).clone()


@pytest.mark.parametrize("pool_class", [HostPool, CopyingHostPool])
def test_restored_pages_land_in_the_pool_whether_its_pages_are_views_or_copies(
    agent_thread: Start, pool_class: type[HostPool]
) -> None:
    page_bytes = 2 * PAGE * HEADS * DIM * 2
    agent = agent_thread(layers=LAYERS, page_bytes=page_bytes, files=8, file_bytes=64 * LAYERS * page_bytes)
    pool = pool_class(False, "page_first")
    backend = make_backend(agent, pool)
    original = pool.kv_buffer.clone()
    keys = [f"{i:064x}" for i in range(3)]
    assert backend.batch_set_v1(keys, torch.arange(0, 3 * PAGE)) == [True] * 3
    pool.kv_buffer.zero_()
    assert backend.batch_get_v1(keys, torch.arange(3 * PAGE, 6 * PAGE)) == [True] * 3
    for j in range(3):
        assert torch.equal(pool.kv_buffer[:, (3 + j) * PAGE : (4 + j) * PAGE], original[:, j * PAGE : (j + 1) * PAGE])
    backend.close()


def test_a_prefix_written_through_one_nodes_sglang_is_a_hit_on_anothers(agent_thread: Start, tmp_path: Path) -> None:
    """Two nodes' agents (loopback): node B's agent names node A's as its peer, so B's backend finds and
    restores, bit-exact into its host pool, the pages A's backend stored, and only B's own after them."""
    from flatcake.net import free_port
    from flatcake.node_agent.config import ClusterConfig

    page_bytes = 2 * PAGE * HEADS * DIM * 2
    listen = f"127.0.0.1:{free_port()}"
    size = {"layers": LAYERS, "page_bytes": page_bytes, "files": 8, "file_bytes": 64 * LAYERS * page_bytes}
    secret = tmp_path / "peer-secret"  # the cache's, held by both agents (the backend's reads are signed by B's)
    secret.write_bytes(b"0123456789abcdef0123456789abcdef")
    a = agent_thread("a", node_id=1, cluster=ClusterConfig(listen=listen, staging_bytes=8 * LAYERS * page_bytes,
                                                           secret_file=str(secret)), **size)  # fmt: skip
    b = agent_thread("b", node_id=2, cluster=ClusterConfig(peers=(listen,), staging_bytes=8 * LAYERS * page_bytes,
                                                           secret_file=str(secret)), **size)  # fmt: skip
    pool_a, pool_b = HostPool(False, "page_first"), HostPool(False, "page_first")
    writer, reader = make_backend(a, pool_a), make_backend(b, pool_b)
    keys = [f"{i:064x}" for i in range(6)]
    assert writer.batch_set_v1(keys, torch.arange(0, 6 * PAGE)) == [True] * 6
    assert reader.batch_exists(keys) == 6 and reader.batch_exists([*keys, "e" * 64]) == 6
    pool_b.kv_buffer.zero_()
    assert reader.batch_get_v1(keys, torch.arange(6 * PAGE, 12 * PAGE)) == [True] * 6
    for j in range(6):
        assert torch.equal(pool_b.get_data_page((6 + j) * PAGE, flat=False), pool_a.get_data_page(j * PAGE, flat=False))
    assert reader.cluster is not None and reader.cluster.last.node_id == 1 and reader.cluster.last.pages == 6
    assert writer.cluster is not None and writer.cluster.peers == []  # A serves peers; it names none itself
    reader.close()
    writer.close()
