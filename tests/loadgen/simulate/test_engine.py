"""The simulator's building blocks: the virtual clock, devices, the HBM cache, sizes and page keys."""

from __future__ import annotations

import pytest

from flatcake.errors import ConfigError
from flatcake.loadgen.simulate.devices import Device
from flatcake.loadgen.simulate.events import EventLoop
from flatcake.loadgen.simulate.hbm import HbmCache
from flatcake.loadgen.simulate.run import GiB, TiB, parse_size
from flatcake.loadgen.simulate.workload import OFFSET_BITS, page_keys
from flatcake.loadgen.traces.formats import TraceRequest

pytestmark = pytest.mark.unit


def test_events_run_in_time_order_and_ties_in_scheduling_order() -> None:
    loop, seen = EventLoop(), []
    loop.at(2.0, seen.append, "c")
    loop.at(1.0, seen.append, "a")
    loop.at(1.0, seen.append, "b")
    loop.at(1.5, lambda: loop.after(0.25, seen.append, "nested"))
    loop.run()
    assert seen == ["a", "b", "nested", "c"]
    assert loop.now == 2.0


def test_a_read_takes_command_cost_plus_bytes_over_bandwidth() -> None:
    dev = Device(bytes_per_s=1e9, command_s=1e-4, queue_depth=1)
    assert dev.submit(0.0, 10**6, 1) == pytest.approx(1e-4 + 1e-3)
    # FIFO: the next job starts when the first ends.
    assert dev.submit(0.0, 10**6, 1) == pytest.approx(2 * (1e-4 + 1e-3))
    assert (dev.read_bytes, dev.read_commands) == (2 * 10**6, 2)


def test_queue_depth_overlaps_command_costs() -> None:
    shallow = Device(1e9, 1e-4, queue_depth=1).service_s(8 * 4096, 8)
    deep = Device(1e9, 1e-4, queue_depth=4).service_s(8 * 4096, 8)
    assert shallow == pytest.approx(8e-4 + 8 * 4096 / 1e9)
    assert deep == pytest.approx(2e-4 + 8 * 4096 / 1e9)  # 8 commands, 4 in flight: two rounds


def test_hbm_evicts_least_recent_unpinned_pages() -> None:
    hbm = HbmCache(3)
    hbm.insert([1, 2, 3])
    hbm.pin([3], +1)  # 3 is the oldest (deepest touched first), but pinned
    hbm.insert([4])
    assert 3 in hbm and 4 in hbm and hbm.prefix([1, 2]) == 1
    hbm.pin([3], -1)
    assert hbm.pins == {}


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1TiB", TiB), ("512GiB", 512 * GiB), ("4TB", 4 * 10**12), ("64Mi", 64 << 20), ("1T", TiB), ("4096", 4096)],
)
def test_sizes_take_units(text: str, expected: int) -> None:
    assert parse_size(text, "--dram") == expected


@pytest.mark.parametrize("text", ["", "1XB", "-1GiB", "0", "GiB"])
def test_bad_sizes_name_the_flag(text: str) -> None:
    with pytest.raises(ConfigError, match="--ssd"):
        parse_size(text, "--ssd")


def test_page_keys_follow_the_prefix_chained_hashes() -> None:
    a = TraceRequest(0, 1024 + 300, 1, (7, 8, 9), block_tokens=512)
    b = TraceRequest(0, 1024, 1, (7, 8), block_tokens=512)
    ka, kb = page_keys(a, 256), page_keys(b, 256)
    assert len(ka) == 5 and len(kb) == 4  # a partial last page is never cached
    assert ka[:4] == kb
    assert ka[0] == (7 << OFFSET_BITS) | 255
