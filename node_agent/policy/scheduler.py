"""FC-MAS: medium-aware request scheduling. Pure decision logic on a caller-supplied clock.

On arrival a request is stamped with ``arrival_ts`` and classified by the slowest medium its prefix
needs: all in DRAM (or HBM) goes to the DRAM-Ready queue and is dispatched at once; anything on SSD
goes to SSD-Preparing, where prefetches run in HRRN order by transfer volume,
``priority = 1 + wait / kv_bytes`` (small first at equal wait, and waiting raises priority so nothing
starves). A finished prefetch re-enters DRAM-Ready by its original ``arrival_ts``, not at the tail.
``policy="fcfs"`` is the ablation, SGLang's FCFS: one queue in arrival order, prefetches started in
that order, and the oldest *ready* request runs first; a request whose prefetch is still in flight is
skipped, not waited for (SGLang 0.5.23 ``managers/scheduler.py`` ``get_new_batch_prefill``: "skip
staging requests that are ongoing prefetch", ``continue``). The paper's Figure 4 FCFS blocks the
whole queue behind its head instead; no serving engine does that.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flatcake.errors import ConfigError
from flatcake.node_agent.constants import SCHEDULER_POLICIES

DRAM_READY = "dram_ready"
SSD_PREPARING = "ssd_preparing"


@dataclass
class Request:
    id: str
    arrival_ts: float
    ssd_bytes: int = 0  # KV bytes that must come from SSD; 0 means every page is in DRAM or HBM
    ready: bool = field(default=False, init=False)

    @property
    def needs_ssd(self) -> bool:
        return self.ssd_bytes > 0


class Scheduler:
    def __init__(self, policy: str = "mas") -> None:
        if policy not in SCHEDULER_POLICIES:
            raise ConfigError(f"scheduler.policy: {policy!r} must be one of {', '.join(SCHEDULER_POLICIES)}")
        self.policy = policy
        self._ready: list[tuple[float, int, Request]] = []  # heap by (arrival_ts, seq)
        self._preparing: dict[str, Request] = {}  # waiting for a prefetch to start
        self._prefetching: dict[str, Request] = {}
        self._fifo: list[Request] = []  # fcfs: every request, in arrival order
        self._seq = 0

    def arrive(self, req: Request) -> str:
        """Admit a request; returns the queue it joined."""
        self._seq += 1
        req.ready = not req.needs_ssd
        if self.policy == "fcfs":
            self._fifo.append(req)
        elif req.ready:
            heapq.heappush(self._ready, (req.arrival_ts, self._seq, req))
        if not req.ready:
            self._preparing[req.id] = req
        return DRAM_READY if req.ready else SSD_PREPARING

    def next_prefetch(self, now: float) -> Request | None:
        """The SSD prefetch to start now: HRRN by volume (mas) or the oldest (fcfs)."""
        if not self._preparing:
            return None
        if self.policy == "fcfs":
            req = min(self._preparing.values(), key=lambda r: r.arrival_ts)
        else:
            req = max(self._preparing.values(), key=lambda r: (hrrn(r, now), -r.arrival_ts))
        del self._preparing[req.id]
        self._prefetching[req.id] = req
        return req

    def prefetch_done(self, req_id: str) -> None:
        """Its SSD pages are in HBM (or its prefetch failed and it will recompute): it is ready."""
        req = self._prefetching.pop(req_id)
        req.ready = True
        if self.policy == "mas":
            self._seq += 1
            heapq.heappush(self._ready, (req.arrival_ts, self._seq, req))

    def next_dispatch(self) -> Request | None:
        """The request to run now, if any is ready (fcfs: the oldest ready one)."""
        if self.policy == "fcfs":
            for i, req in enumerate(self._fifo):
                if req.ready:
                    return self._fifo.pop(i)
            return None
        return heapq.heappop(self._ready)[2] if self._ready else None

    def depths(self) -> dict[str, int]:
        ready = sum(r.ready for r in self._fifo) if self.policy == "fcfs" else len(self._ready)
        return {DRAM_READY: ready, SSD_PREPARING: len(self._preparing) + len(self._prefetching)}


def hrrn(req: Request, now: float) -> float:
    """Response ratio with transfer volume in place of service time."""
    return 1.0 + max(0.0, now - req.arrival_ts) / max(req.ssd_bytes, 1)


@dataclass(frozen=True)
class Outcome:
    dispatched: dict[str, float]
    finished: dict[str, float]
    makespan: float
    mean_wait: float  # dispatch - arrival


def simulate(
    requests: Sequence[Request],
    policy: str,
    compute_seconds: Callable[[Request], float],
    transfer_seconds: Callable[[Request], float],
) -> Outcome:
    """Event-driven run on a virtual clock: one compute server, one SSD prefetch channel."""
    sched = Scheduler(policy)
    pending = sorted(requests, key=lambda r: r.arrival_ts)
    now = 0.0
    gpu_free_at = 0.0
    ssd_free_at = 0.0
    in_transfer: Request | None = None
    dispatched: dict[str, float] = {}
    finished: dict[str, float] = {}
    i = 0
    while len(finished) < len(requests):
        while i < len(pending) and pending[i].arrival_ts <= now:
            sched.arrive(pending[i])
            i += 1
        if in_transfer is not None and ssd_free_at <= now:
            sched.prefetch_done(in_transfer.id)
            in_transfer = None
        if in_transfer is None:
            nxt = sched.next_prefetch(now)
            if nxt is not None:
                in_transfer, ssd_free_at = nxt, now + transfer_seconds(nxt)
        if gpu_free_at <= now:
            run = sched.next_dispatch()
            if run is not None:
                dispatched[run.id] = now
                gpu_free_at = now + compute_seconds(run)
                finished[run.id] = gpu_free_at
                continue
        events = [t for t in (gpu_free_at, ssd_free_at if in_transfer else None) if t is not None and t > now]
        if i < len(pending):
            events.append(pending[i].arrival_ts)
        if not events:
            raise RuntimeError("scheduler stalled: no event left but requests unfinished")
        now = min(events)
    waits = [dispatched[r.id] - r.arrival_ts for r in requests]
    return Outcome(dispatched, finished, max(finished.values()), sum(waits) / len(waits))
