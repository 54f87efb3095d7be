"""The emulated SGLang host pool (flatcake.loadgen.systems.sglang.HostPool): every layout stores the
benchmark's layer-major pages and gives them back unchanged, and ``for_spec`` checks the geometry."""

from __future__ import annotations

import numpy as np
import pytest

from flatcake.errors import ConfigError
from flatcake.loadgen.systems.base import SystemSpec
from flatcake.loadgen.systems.sglang import LAYOUTS, HostPool

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_round_trip_in_every_layout(mla: bool, layout: str) -> None:
    pool = HostPool(pages=4, page_size=16, layers=3, mla=mla, layout=layout, mla_dim=64, heads=2, head_dim=32)
    assert pool.raw_bytes == (16 * 64 * 2 if mla else 2 * 16 * 2 * 32 * 2)  # bf16
    rng = np.random.default_rng(1)
    pages = rng.integers(0, 256, size=(3, 4, pool.raw_bytes), dtype=np.uint8)
    for slot in range(4):
        pool.write(slot, pages[:, slot])
    out = np.zeros_like(pages)
    for slot in (2, 0, 3, 1):
        pool.read(slot, out, slot)
    assert np.array_equal(out, pages)
    flat = pool.get_data_page(2 * 16).clone()  # SGLang's flat page moves, as the file backend uses them
    pool.set_from_flat_data_page(0, flat)
    pool.read(0, out, 0)
    assert np.array_equal(out[:, 0], pages[:, 2])


def test_for_spec_sizes_page_first_from_the_spec_and_refuses_a_mismatch() -> None:
    spec = SystemSpec(
        layers=2, page_bytes=2 * 16 * 2 * 128 * 2, page_tokens=16, sessions=1, session_bytes=1
    )  # MHA: 2 x 128 bf16 per token
    pool = HostPool.for_spec(spec, pages=3, mla=False)
    assert pool.layout == "page_first" and tuple(pool.kv_buffer.shape) == (2, 48, 2, 2, 128)
    mla = HostPool.for_spec(
        SystemSpec(layers=2, page_bytes=8192, page_tokens=16, sessions=1, session_bytes=1), pages=3, mla=True
    )
    assert tuple(mla.kv_buffer.shape) == (48, 2, 1, 512) and mla.raw_bytes == 8192
    with pytest.raises(ConfigError, match="page_bytes: 4096 is not this host pool's page-layer"):
        HostPool.for_spec(
            SystemSpec(layers=2, page_bytes=4096, page_tokens=16, sessions=1, session_bytes=1), pages=3, mla=False
        )
    with pytest.raises(ConfigError, match="layout: 'page_head'"):
        HostPool(pages=1, page_size=16, layers=1, mla=False, layout="page_head")
