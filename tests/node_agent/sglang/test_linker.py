"""The SGLang linker's pure parts (node_agent/sglang/device_pages.py, linker.py), without a server: a stored
page is the device pool's layer bytes (K then V) in the HiCache backend's order, restored in place where the
pool is one allocation and through a per-layer copy where it is not; key chains are learned from the calls;
a batch whose restore misses a page is reported failed (its last layer is never released as landed)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from flatcake.node_agent.datapath.buffers import aligned_empty
from flatcake.node_agent.sglang.device_pages import Chains, KVPages, end_batch

pytestmark = pytest.mark.unit

LAYERS, PAGE, HEADS, DIM, ROWS = 3, 4, 2, 8, 64


def entry(k: list[torch.Tensor], v: list[torch.Tensor]) -> Any:
    """A stand-in for SGLang's DevicePoolEntry over an MHA pool: layer l is buffers (l, L + l), rows are tokens."""

    def prepare_locations(indices: torch.Tensor) -> list[int]:
        return indices.reshape(-1, PAGE)[:, 0].tolist()

    return SimpleNamespace(kv_buffer=[*k, *v], layer_mapping={i: (i, LAYERS + i) for i in range(LAYERS)},
                           prepare_locations=prepare_locations)  # fmt: skip


def separate() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    k = [torch.randn(ROWS, HEADS, DIM, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    v = [torch.randn(ROWS, HEADS, DIM, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    return k, v


def test_a_stored_page_is_each_layers_k_then_v_rows_and_copies_back_into_other_slots() -> None:
    k, v = separate()
    pages = KVPages(entry(k, v), LAYERS, PAGE)
    assert pages.raw_bytes == 2 * PAGE * HEADS * DIM * 2 and not pages.in_place  # separate allocations: copy
    rows = pages.rows(torch.arange(8, 16))  # pages at tokens 8 and 12
    kv = pages.copy_out(rows)
    for layer in range(LAYERS):
        want = torch.cat([k[layer][12:16].reshape(-1).view(torch.uint8), v[layer][12:16].reshape(-1).view(torch.uint8)])
        assert bytes(kv[layer, 1, : pages.raw_bytes]) == want.numpy().tobytes()
    for layer in range(LAYERS):
        pages.copy_in(layer, [40, 48], kv[layer])  # into two other slots
    for layer in range(LAYERS):
        assert torch.equal(k[layer][40:44], k[layer][8:12]) and torch.equal(v[layer][48:52], v[layer][12:16])
        assert not torch.equal(k[layer][44:48], k[layer][8:12]) or not k[layer][8:12].any()


def test_one_allocation_is_restored_in_place_where_the_copy_path_would_write() -> None:
    whole = torch.zeros(LAYERS, 2, ROWS, HEADS, DIM, dtype=torch.bfloat16)  # layer-major K and V in one buffer
    k, v = [whole[i, 0] for i in range(LAYERS)], [whole[i, 1] for i in range(LAYERS)]
    pages = KVPages(entry(k, v), LAYERS, PAGE)
    assert pages.in_place
    target = pages.target([20, 4])
    assert target is not None
    src = np.random.default_rng(1).integers(0, 255, (LAYERS, 2, pages.page_bytes), dtype=np.uint8)
    for layer in range(LAYERS):
        target.write(layer, np.arange(2), src[layer])
    in_place = whole.clone()
    whole.zero_()
    for layer in range(LAYERS):
        pages.copy_in(layer, [20, 4], src[layer])
    as_bytes = whole.view(torch.uint8)  # random bytes hold NaNs as bfloat16: compare the bytes
    assert torch.equal(in_place.view(torch.uint8), as_bytes) and as_bytes.any()


def test_chains_learn_each_pages_predecessor_and_join_a_sessions_turns() -> None:
    chains = Chains(capacity=8)
    chains.learn(["a", "b", "c"])  # a lookup of one prompt's pages
    assert chains.prefix("c") == ["a", "b"] and chains.prefix("a") == []
    chains.learn(["a", "b", "c", "d"], session="s1")  # its offload, in session s1
    chains.learn(["x", "y"], session="s1")  # the session's next turn, seen without its predecessor
    assert chains.prefix("y") == ["a", "b", "c", "d", "x"]
    chains.learn(["p", "q"], session="s2")
    assert chains.prefix("q") == ["p"]  # another session does not join s1
    chains.learn([f"k{i}" for i in range(20)])
    assert len(chains.prefix("k19")) <= 8  # bounded: the oldest links are forgotten


class Counter:
    """SGLang's LayerWiseLoadCounter as far as ``end_batch`` uses it (the real one's module imports
    torchvision through SGLang's memory pool, which this venv lacks: tests/node_agent/sglang/test_v2.py)."""

    def __init__(self) -> None:
        self.completed: list[int] = []
        self.failed: BaseException | None = None

    def complete(self, index: int, layer: int) -> None:
        self.completed.append(layer)

    def fail(self, index: int, error: BaseException) -> None:
        self.failed = error


def test_the_last_layer_is_released_only_once_no_page_is_missing() -> None:
    ok = Counter()
    assert end_batch(ok, 0, LAYERS, set(), None) is True
    assert ok.completed == [LAYERS - 1] and ok.failed is None
    bad = Counter()  # a page failed its checksum after every earlier layer was read by the forward
    assert end_batch(bad, 0, LAYERS, {1}, None) is False
    assert bad.completed == [] and isinstance(bad.failed, RuntimeError)  # finish() reports it: SGLang aborts
    broken = Counter()
    assert end_batch(broken, 0, LAYERS, set(range(4)), ConnectionError("the agent went away")) is False
    assert isinstance(broken.failed, ConnectionError) and broken.completed == []


def test_staged_pages_are_aligned_for_direct_reads() -> None:
    k, v = separate()
    pages = KVPages(entry(k, v), LAYERS, PAGE)
    staged = aligned_empty((LAYERS, 2, pages.page_bytes))
    assert staged.ctypes.data % 4096 == 0 and pages.page_bytes % 4096 == 0
