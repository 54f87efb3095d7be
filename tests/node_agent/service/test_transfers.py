"""The connectors' transfers off the step (node_agent/service/transfers.py: the vLLM connector's and the SGLang
linker's), without a server: a layer's
wait returns only once that layer's bytes landed and the forward can start before the last layer has;
parked loads report when they end; saves run after the step (their blocks copied out there, or by the step
that releases them), wait for room past their bound, and are retried while the agent is away."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from flatcake.node_agent.service.transfers import AsyncLoads, LayerLoads, SaveJob, SaveQueue
from tests.support.waiting import wait_until

pytestmark = pytest.mark.unit

LAYERS = 4


class GatedRestore:
    """A restore whose layer ``l`` lands (its bytes written into ``dest[l]``) only once ``gates[l]`` is set."""

    def __init__(self, dest: np.ndarray, gates: list[threading.Event], missing: set[int] | None = None) -> None:
        self.dest, self.gates, self.missing = dest, gates, missing or set()

    def __iter__(self) -> Iterator[int]:
        for layer, gate in enumerate(self.gates):
            assert gate.wait(30), "the test never opened this layer's gate"
            self.dest[layer] = layer + 1
            yield layer

    def __enter__(self) -> GatedRestore:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def test_a_layers_wait_returns_once_its_bytes_landed_not_before_and_not_after_the_rest() -> None:
    dest = np.zeros((LAYERS, 8), np.uint8)
    gates = [threading.Event() for _ in range(LAYERS)]
    loads = LayerLoads(lambda: GatedRestore(dest, gates), LAYERS, 8)
    gates[0].set()
    loads.wait(0)  # the forward's first attention layer
    assert (dest[0] == 1).all()  # its bytes are there ...
    assert not dest[1:].any()  # ... and the later layers are still on their way: the forward overlaps them
    returned = threading.Event()

    def layer_two() -> None:
        loads.wait(2)
        assert (dest[2] == 3).all(), "wait(2) returned before layer 2's bytes landed"
        returned.set()

    waiter = threading.Thread(target=layer_two)
    waiter.start()
    gates[1].set()
    wait_until(lambda: (dest[1] == 2).all(), what="layer 1 to land")
    assert not returned.is_set()  # layer 1 landed, layer 2 has not: its wait is still waiting
    gates[2].set()
    waiter.join(30)
    assert returned.is_set()
    gates[3].set()
    assert loads.join() == set() and len(loads.landed_at) == LAYERS


def test_a_restore_that_fails_releases_every_wait_and_misses_every_page() -> None:
    def broken() -> GatedRestore:
        raise ConnectionError("the agent went away")

    loads = LayerLoads(broken, LAYERS, 5)
    loads.wait(LAYERS - 1)  # not left hanging
    assert loads.join() == set(range(5)) and isinstance(loads.failed, ConnectionError)


def test_parked_loads_report_in_order_with_their_misses() -> None:
    a = AsyncLoads()
    gate = threading.Event()

    def first() -> set[int]:
        assert gate.wait(30)
        return set()

    def second() -> set[int]:
        raise OSError(5, "Input/output error")

    a.submit("r1", 3, first)
    a.submit("r2", 4, second)
    assert a.done() == []  # r1 is still loading; r2 waits behind it
    gate.set()
    got: list[tuple[str, set[int]]] = []
    wait_until(lambda: bool(got.extend(a.done())) or len(got) == 2, what="both loads to end")
    assert got == [("r1", set()), ("r2", {0, 1, 2, 3})]  # a failed load: every page a miss
    a.stop()


def job(name: str, nbytes: int) -> SaveJob:
    return SaveJob(name, nbytes, lambda: name)


def test_saves_run_after_the_step_wait_for_room_and_are_retried_while_the_agent_is_away() -> None:
    stored: list[str] = []
    agent_up = threading.Event()
    release = threading.Event()
    attempts = {"n": 0}

    def store(job: str) -> None:
        if job == "slow":
            assert release.wait(30)
        if job == "during-restart" and not agent_up.is_set():
            attempts["n"] += 1
            raise ConnectionError("the flatcake agent went away")
        stored.append(job)

    q = SaveQueue(store, max_bytes=100, retry_s=30.0)
    assert q.submit(job("slow", 60)) < 1.0  # queued: the step goes on while it is stored
    waited: list[float] = []
    step = threading.Thread(target=lambda: waited.append(q.submit(job("next", 60))))
    step.start()  # 60 + 60 > 100: this step waits for room
    wait_until(lambda: q.pending_bytes == 60, what="the first save to be in flight")
    assert step.is_alive()
    release.set()
    step.join(30)
    assert waited and stored[:1] == ["slow"]
    q.submit(job("during-restart", 10))
    wait_until(lambda: attempts["n"] >= 2, what="the save to be retried while the agent is away")
    agent_up.set()  # a restarted agent answers: the save lands, none lost
    assert q.drain(30) and stored == ["slow", "next", "during-restart"] and q.dropped == 0
    q.stop()


def test_a_save_the_agent_refuses_is_dropped_and_the_queue_goes_on() -> None:
    from flatcake.errors import PoolFullError

    def store(job: str) -> None:
        if job == "full":
            raise PoolFullError("SSD file pool full")

    q = SaveQueue(store, max_bytes=100, retry_s=0.0)
    q.submit(job("full", 10))
    q.submit(job("fine", 10))
    assert q.drain(30) and (q.stored, q.dropped) == (1, 1)
    q.stop()


def test_a_save_is_copied_out_on_the_thread_unless_its_blocks_are_released_first() -> None:
    """A save is a reference to vLLM's blocks until copied out: by the save thread after the step, or by the
    step that releases the request's blocks (finished, preempted) before its forward may overwrite them.
    Either way the stored bytes are the ones the step completed."""
    blocks = np.zeros((4, 8), dtype=np.uint8)
    stored: dict[str, bytes] = {}
    busy = threading.Event()
    gathered_by: dict[str, str] = {}

    def gather(req: str, block: int) -> bytes:
        gathered_by[req] = threading.current_thread().name
        return blocks[block].tobytes()

    def store(data: tuple[str, bytes]) -> None:
        if data[0] == "a":
            assert busy.wait(30)  # the thread is busy storing a: b waits in the queue, not copied yet
        stored[data[0]] = data[1]

    q = SaveQueue(store, max_bytes=1 << 20)
    blocks[0], blocks[1] = 1, 2
    q.submit(SaveJob("a", 8, lambda: ("a", gather("a", 0))))
    q.submit(SaveJob("b", 8, lambda: ("b", gather("b", 1)), pages=1))
    wait_until(lambda: "a" in gathered_by, what="the thread to copy a's blocks out")
    assert "b" not in gathered_by  # not copied on submit: the step did not wait for it
    assert q.release({"b"})[1] == 1 and gathered_by["b"] == threading.current_thread().name
    blocks[1] = 99  # the next forward writes b's freed block: the save keeps the bytes it had
    blocks[0] = 98  # a's blocks were copied by the thread before
    busy.set()
    assert q.drain(30) and stored == {"a": bytes([1] * 8), "b": bytes([2] * 8)}
    assert q.gathered_on_release == 1 and q.stored == 2
    q.stop()


def test_release_waits_for_a_copy_the_thread_has_begun() -> None:
    copying = threading.Event()
    finish = threading.Event()
    waiting = threading.Event()
    order: list[str] = []

    class Observed(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            if threading.current_thread().name == "step":
                waiting.set()
            return super().wait(timeout)

    def slow_gather() -> str:
        copying.set()
        assert finish.wait(30)
        order.append("copied")
        return "a"

    q = SaveQueue(lambda data: order.append("stored"), max_bytes=1 << 20)
    q._cond = Observed()
    q.submit(SaveJob("a", 8, slow_gather))
    assert copying.wait(30)
    step = threading.Thread(target=lambda: (q.release({"a"}), order.append("released")), name="step")
    step.start()
    assert waiting.wait(30)  # the step waits: the thread is reading blocks the forward may overwrite
    assert "released" not in order
    finish.set()
    step.join(30)
    assert q.drain(30) and order.index("copied") < order.index("released") and q.gathered_on_release == 0
    q.stop()


def test_the_end_hook_sees_the_final_misses_before_waits_past_the_last_yielded_layer_return() -> None:
    """The SGLang linker releases its forward's last layer in ``on_end``: it must run once ``missing`` is
    final, and before anyone waiting on a layer the restore did not yield is let go."""
    dest = np.zeros((LAYERS, 8), np.uint8)
    gates = [threading.Event() for _ in range(LAYERS)]
    ended: list[tuple[set[int], BaseException | None, bool]] = []
    loads: list[LayerLoads] = []

    def on_end(missing: set[int], failed: BaseException | None) -> None:
        released = loads[0]._landed >= LAYERS  # waits past the yielded layers not yet let go
        ended.append((set(missing), failed, released))

    loads.append(LayerLoads(lambda: GatedRestore(dest, gates, missing={3}), LAYERS, 8, on_end=on_end))
    for gate in gates:
        gate.set()
    assert loads[0].join() == {3}
    assert ended == [({3}, None, False)]
