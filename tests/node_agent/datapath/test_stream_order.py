"""GPU ordering, on the CPU: a GPU restore scatters on a stream of its own, records an event after each
slot's scatter, and reads into a slot again only after that event has completed; the window goes back
only when every event has. ``FakeCuda`` stands in for ``cupy.cuda`` and records the order of
operations; nothing here runs on a GPU, and nothing GPU-only is claimed tested."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from flatcake.node_agent.datapath.restore import Restore, StreamOrder, WindowPool
from flatcake.node_agent.datapath.stats import Stats
from flatcake.node_agent.policy.coalesce import plan_restore

pytestmark = pytest.mark.unit
LAYERS, PAGE, SLOT = 6, 4096, 2 * 4096


class FakeCuda:
    """``Stream``/``Event`` that log ``(op, id)``; an event completes only when synchronized."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self._ids = 0
        cuda = self

        class Stream:
            def __init__(self, non_blocking: bool = False) -> None:
                assert non_blocking, "a restore's stream must not serialize with the default stream"

            def __enter__(self) -> Stream:
                cuda.log.append(("stream", 0))
                return self

            def __exit__(self, *exc: object) -> None:
                pass

        class Event:
            def __init__(self) -> None:
                cuda._ids += 1
                self.id = cuda._ids

            def record(self, stream: Any) -> None:
                cuda.log.append(("record", self.id))

            def synchronize(self) -> None:
                cuda.log.append(("sync", self.id))

        self.Stream, self.Event = Stream, Event


class LoggingIO:
    name, workers = "kvikio", 1

    def __init__(self, log: list[tuple[str, int]], slot_of: Any) -> None:
        self.log, self.slot_of = log, slot_of

    def submit_read(self, worker: int, file: int, offset: int, buf: Any) -> Future[int]:
        self.log.append(("read", self.slot_of(buf)))
        f: Future[int] = Future()
        f.set_result(len(buf))
        return f

    def submit_write(self, *a: Any) -> Future[int]:
        raise AssertionError

    def close(self) -> None:
        pass


def test_a_slot_is_read_into_again_only_after_its_scatter_event_completed() -> None:
    cuda = FakeCuda()
    order = StreamOrder(cuda)
    stats = Stats()
    made: list[np.ndarray] = []

    def alloc(n: int) -> np.ndarray:
        made.append(np.zeros(n, np.uint8))
        return made[-1]

    windows = WindowPool(1, 2, SLOT, stats, alloc)

    def slot_of(buf: np.ndarray) -> int:  # a window is one allocation cut into slots
        (window,) = made
        return (buf.ctypes.data - window.ctypes.data) // SLOT

    n = 3  # pages far apart: one command per page-layer, 2 per slot -> many slot reuses
    fills = plan_restore(np.zeros(n, np.int64), np.arange(n, dtype=np.int64) * 40 * PAGE,
                         np.full(n, PAGE, np.int64), LAYERS, PAGE, 0, SLOT)  # fmt: skip

    def scatter(layer: int, buf: Any, src: Any, dst: Any, count: Any) -> None:
        cuda.log.append(("scatter", slot_of(buf)))

    restore = Restore(layers=LAYERS, fills=fills, dest_pages=np.arange(n), request_index=np.arange(n),
                      io=LoggingIO(cuda.log, slot_of), windows=windows, scatter=scatter, copy_dram=lambda layer: None,
                      stats=stats, on_close=lambda: None, order=order)  # fmt: skip
    assert list(restore) == list(range(LAYERS)) and restore.missing == set()
    log = cuda.log
    assert len(fills) > 2 * 2  # more fills than slots: slots were reused
    # For every read into a slot that was scattered before: the event recorded right after that scatter
    # was synchronized between the scatter and this read.
    last_event: dict[int, int] = {}
    synced: set[int] = set()
    for i, (op, x) in enumerate(log):
        if op == "scatter":
            assert log[i + 1][0] == "record"
            last_event[x] = log[i + 1][1]
        elif op == "sync":
            synced.add(x)
        elif op == "read" and x in last_event:
            assert last_event[x] in synced, f"slot {x} read into at step {i} before its scatter completed"
    # The window is released only after every slot's last scatter completed.
    assert all(e in synced for e in last_event.values())
    assert stats.get("staging_waits") == 0 and windows.in_use_bytes == 0


def test_a_slot_waits_only_for_its_own_last_scatter_and_only_once() -> None:
    """Issue 45: this test asserted nothing. A slot never scattered waits for nothing; a scattered slot waits
    for the event recorded after its scatter, once; drain waits for every slot still pending, and only those."""
    cuda = FakeCuda()
    order = StreamOrder(cuda)
    order.reuse(0)  # a slot never scattered: nothing to wait for
    assert [op for op, _ in cuda.log if op == "sync"] == []
    order.scattered(0)
    order.scattered(1)
    order.scattered(1)  # slot 1 scattered again: only its latest event matters
    events = [i for op, i in cuda.log if op == "record"]
    assert len(events) == 3
    order.reuse(1)
    assert [(op, i) for op, i in cuda.log if op == "sync"] == [("sync", events[2])]
    order.reuse(1)  # already waited for: no second wait
    assert sum(op == "sync" for op, _ in cuda.log) == 1
    order.drain()  # slot 0's event is still pending
    assert [(op, i) for op, i in cuda.log if op == "sync"] == [("sync", events[2]), ("sync", events[0])]
    order.drain()
    assert sum(op == "sync" for op, _ in cuda.log) == 2


def test_a_region_is_pinned_once_per_process_and_unpinned_with_its_last_holder() -> None:
    from flatcake.node_agent.datapath import gpu

    class Runtime:
        def __init__(self) -> None:
            self.calls: list[tuple[str, int]] = []

        def hostRegister(self, ptr: int, size: int, flags: int) -> None:
            self.calls.append(("register", ptr))

        def hostUnregister(self, ptr: int) -> None:
            self.calls.append(("unregister", ptr))

    rt, view = Runtime(), np.zeros(4096, np.uint8)
    gpu.host_register(view, rt)
    gpu.host_register(view, rt)
    assert rt.calls == [("register", view.ctypes.data)]
    gpu.host_unregister(view, rt)
    assert len(rt.calls) == 1
    gpu.host_unregister(view, rt)
    gpu.host_unregister(view, rt)  # one release too many: nothing
    assert rt.calls == [("register", view.ctypes.data), ("unregister", view.ctypes.data)]
    assert (view.ctypes.data, view.nbytes) not in gpu.pinned_regions()


def test_kvikio_threads_default_keeps_every_in_flight_read_busy() -> None:
    from flatcake.node_agent.config import IOConfig
    from flatcake.node_agent.datapath.io_backends import set_kvikio_threads

    assert IOConfig().kvikio_pool() == IOConfig().streams * IOConfig().staging_layers * IOConfig().workers
    assert IOConfig(kvikio_threads=7).kvikio_pool() == 7
    seen: list[Any] = []

    class New:  # kvikio 25.x
        class defaults:
            @staticmethod
            def set(name: str, value: int) -> None:
                seen.append((name, value))

    class Old:  # kvikio 24.x
        class defaults:
            @staticmethod
            def num_threads_reset(value: int) -> None:
                seen.append(("reset", value))

    set_kvikio_threads(New, 16)
    set_kvikio_threads(Old, 8)
    assert seen == [("num_threads", 16), ("reset", 8)]
