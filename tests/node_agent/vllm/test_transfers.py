"""The vLLM connector's transfers off the step (node_agent/vllm/transfers.py), without a server: a layer's
wait returns only once that layer's bytes landed and the forward can start before the last layer has;
parked loads report when they end; saves run after the step, wait for room past their bound, and are
retried while the agent is away."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from flatcake.node_agent.vllm.transfers import AsyncLoads, LayerLoads, SaveQueue
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
    assert q.submit(60, "slow") < 1.0  # queued: the step goes on while it is stored
    waited: list[float] = []
    step = threading.Thread(target=lambda: waited.append(q.submit(60, "next")))
    step.start()  # 60 + 60 > 100: this step waits for room
    wait_until(lambda: q.pending_bytes == 60, what="the first save to be in flight")
    assert step.is_alive()
    release.set()
    step.join(30)
    assert waited and stored[:1] == ["slow"]
    q.submit(10, "during-restart")
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
    q.submit(10, "full")
    q.submit(10, "fine")
    assert q.drain(30) and (q.stored, q.dropped) == (1, 1)
    q.stop()
