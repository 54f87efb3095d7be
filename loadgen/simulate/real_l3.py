"""The two real SGLang L3 backends that ``bench peers`` and ``bench e2e`` run on this machine, simulated under
``tiered``'s rules (``Tiered``: FCFS, prefetch at admission in 128-page batches by one I/O thread, declined at
half the host pool in flight, the ``timeout`` stop policy, what did not land recomputed). They differ from the
idealized log only in what the L3 costs and how it keeps pages:

- ``hicache-file`` (``HiCacheFileL3``): SGLang 0.5.23's ``HiCacheFile``, one file per page, all of DRAM its
  host tier (as the emulator's ``--l3 hicache-file``). A page is found once its file has landed
  (``batch_exists`` stats the file); capacity is its ``LRUFileEvictor`` (``storage/file/lru_file_evictor.py``)
  with ``max_size`` set to the SSD: over the cap it evicts least recently used files (a read or a rewrite is a
  use) down to ``eviction_ratio`` (0.9) of it, never a file still being written.
- ``hicache-mooncake`` (``MooncakeL3``): Mooncake Store as this repo's benches deploy it
  (``loadgen/systems/mooncake.py``): half the DRAM budget is SGLang's host tier, half Mooncake's DRAM
  segment (the emulator's ``l3_dram_bytes``). Puts land in the segment; with ``offload_on_evict`` a page
  evicted from it (least recently used first, past the master's high watermark) is written to bucket files
  and found on SSD once written (read from DRAM, and holding its memory, until then; a put that finds the
  segment full of such pages is refused). Segment pages are served from DRAM (free at prefetch, copied in
  at dispatch, as FlatCake's DRAM pool is); bucket files are reclaimed oldest first (the log's reclaim).

Each backend's SSD reads and writes go through its own path (the instance's I/O thread for reads, the node's
backup or offload thread for writes) at the fraction of the device's rate that ``bench peers`` measured on
this VM (``CALIBRATION``); the device itself is busy only for the bytes at the profile's rate, so a slow
software path does not hold it. A job is done when both the path and the device are.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from flatcake.loadgen.simulate.devices import Device
from flatcake.loadgen.simulate.events import EventLoop
from flatcake.loadgen.simulate.model import Cluster, Job
from flatcake.loadgen.simulate.sglang_rules import Tiered
from flatcake.loadgen.systems.mooncake import BUCKET_KEYS

# HiCacheFile's LRUFileEvictor: over max_size it evicts down to this share of it (its default eviction_ratio).
EVICTION_RATIO = 0.9
# mooncake_master 0.3.13.post1's defaults (its --help): eviction starts past eviction_high_watermark_ratio of
# the segment and takes eviction_ratio of it per pass.
HIGH_WATERMARK = 0.9
EVICTION_SHARE = 0.05


@dataclass(frozen=True)
class PeersRun:
    """One backend in one ``bench peers`` run on this VM (3 repeats, medians; page cache dropped, 4 reads in
    flight for every reader and for fio), as its JSON gives it (``docs/results/<source>``, ``systems.<system>``,
    ``limit``, ``workload``)."""

    system: str  # bench peers' key: hicache_file, mooncake
    source: str
    layers: int
    page_layer_bytes: int  # O_DIRECT-padded: the page the simulator moves
    raw_page_layer_bytes: int  # the payload bench peers' rates count
    fio_read_bytes_per_s: float  # limit.read_bytes_per_s: fio O_DIRECT reads, the raw device on this VM
    restore_bytes_per_s: float
    dram_hit_fraction: float  # restored pages the backend served from its DRAM (Mooncake's segment)
    durable_write_bytes_per_s: float

    @property
    def page_span(self) -> int:
        return self.layers * self.page_layer_bytes

    def _pages_as_simulated(self, payload_bytes_per_s: float) -> float:
        # Pages per second times the simulator's (padded) page: what the log at the fio rate would move.
        return payload_bytes_per_s * self.page_layer_bytes / self.raw_page_layer_bytes

    @property
    def read_efficiency(self) -> float:
        """SSD pages restored per second, as simulated pages, over fio's rate. The whole restore time is put
        on the SSD pages (DRAM hits counted free), as the simulator charges segment hits nothing until the
        copy into HBM."""
        ssd_rate = (1 - self.dram_hit_fraction) * self.restore_bytes_per_s
        return self._pages_as_simulated(ssd_rate) / self.fio_read_bytes_per_s

    @property
    def write_efficiency(self) -> float:
        """Durable writes (acknowledged and on the device) as simulated pages, over fio's read rate: peers
        measures no raw write rate, and this VM's O_DIRECT writes run at about its reads (the engine's durable
        writes 1.44 GB/s against fio's 1.30 in the same run), so the fraction is applied to the profile's
        write rate."""
        return self._pages_as_simulated(self.durable_write_bytes_per_s) / self.fio_read_bytes_per_s


# The one calibration of the real L3s: pinned from the committed runs (tests re-derive every number from the
# JSON, so a rerun of bench peers that changes them fails until this table says the new ones).
CALIBRATION: tuple[PeersRun, ...] = (
    PeersRun("hicache_file", "peers-dsv4-flash.json", 43, 49152, 45723, 1297431554.7926586, 730100558.9953408, 0.0,
             297183703.97633994),
    PeersRun("mooncake", "peers-dsv4-flash.json", 43, 49152, 45723, 1297431554.7926586, 1084660061.3435297,
             0.37222222222222223, 79389201.72152774),
    PeersRun("hicache_file", "peers-llama3-70b-tp4.json", 80, 262144, 262144, 1072407272.2441435, 761425471.0961636,
             0.0, 413457094.5653645),
    PeersRun("mooncake", "peers-llama3-70b-tp4.json", 80, 262144, 262144, 1072407272.2441435, 1253947194.6163652,
             0.20833333333333334, 95836160.75078821),
)  # fmt: skip


def calibration(system: str, page_span: int) -> PeersRun:
    """``system``'s run measured at the page size nearest ``page_span``: each backend pays per page (a file
    opened, an object looked up), so its fraction of the device grows with the page (hicache-file 0.60 at
    dsv4-flash's 2 MiB rank pages, 0.71 at llama3-70b-tp4's 20 MiB)."""
    runs = [r for r in CALIBRATION if r.system == system]
    if not runs:
        raise ValueError(f"calibration: no bench peers run of {system!r}")
    return min(runs, key=lambda r: abs(math.log(r.page_span / page_span)))


class RealL3(Tiered):
    """``Tiered``'s rules over a real backend's measured costs (``PeersRun``): SSD reads by each instance's I/O
    thread, SSD writes by each node's writer, each at the backend's fraction of the device's rate."""

    peers_name = ""

    def __init__(self, c: Cluster, loop: EventLoop, host_dram_bytes: int | None = None) -> None:
        host = c if host_dram_bytes is None else dataclasses.replace(c, dram_bytes=host_dram_bytes)
        super().__init__(host, loop, l3=True)
        self.calibration = calibration(self.peers_name, c.page_span)
        d, ranks = c.device, c.device_ranks
        depth = max(1, d.queue_depth // ranks)
        read = d.read_bytes_per_s / ranks * self.calibration.read_efficiency
        write = d.write_bytes_per_s / ranks * self.calibration.write_efficiency
        self.readers = [[Device(read, d.command_s, depth) for _ in node] for node in self.instances]
        self.writers = [Device(write, d.command_s, depth) for _ in range(c.nodes)]

    def _ssd_read(self, job: Job, pages: int) -> float:
        """``pages`` whole pages read by the job's I/O thread, one command each; when they are in."""
        now, inst, nbytes = self.loop.now, job.inst, pages * self.c.page_span
        self.read_commands += pages
        self.read_bytes += nbytes
        self.ssd_pages_read += pages
        path = self.readers[inst.node][inst.index].submit(now, nbytes, pages)
        return max(path, self.ssd[inst.node].submit(now, nbytes, pages))

    def _ssd_write(self, node: int, pages: int, commands: int) -> float:
        """``pages`` written by the node's writer; when they are on the device."""
        now, nbytes = self.loop.now, pages * self.c.page_span
        path = self.writers[node].submit(now, nbytes, commands)
        return max(path, self.ssd[node].submit(now, nbytes, commands, write=True))

    def counters(self) -> dict[str, Any]:
        cal = self.calibration
        return {**super().counters(), "calibration": {"source": cal.source, "read_efficiency": cal.read_efficiency,
                                                      "write_efficiency": cal.write_efficiency}}  # fmt: skip


class HiCacheFileL3(RealL3):
    """SGLang's ``HiCacheFile``: one file per page, found once written, LRU files capped at the SSD."""

    peers_name = "hicache_file"

    def __init__(self, c: Cluster, loop: EventLoop) -> None:
        super().__init__(c, loop)
        self.name = "hicache-file"
        self.cap_pages = max(1, c.ssd_bytes // c.page_span)
        self.files: list[OrderedDict[int, bool]] = [OrderedDict() for _ in range(c.nodes)]  # key -> landed
        self.evicted_files = 0

    def _l3_prefix(self, node: int, keys: tuple[int, ...], start: int) -> int:
        files, n = self.files[node], start
        while n < len(keys) and files.get(keys[n]):
            n += 1
        return n - start

    def _unstored(self, node: int, keys: list[int]) -> list[int]:
        """Its ``set`` skips a key it holds and refreshes its recency."""
        files, out = self.files[node], []
        for key in keys:
            if key in files:
                files.move_to_end(key)
            else:
                out.append(key)
        return out

    def _l3_append(self, node: int, keys: list[int]) -> float | None:
        if not keys:
            return None
        files = self.files[node]
        if len(files) + len(keys) > self.cap_pages:
            self._evict(files, max(0, int(self.cap_pages * EVICTION_RATIO) - len(keys)))
        for key in keys:
            files[key] = False  # reserved: not found until its file is renamed into place
        done = self._ssd_write(node, len(keys), len(keys))
        self.loop.at(done, self._landed, node, keys)
        return done

    def _evict(self, files: OrderedDict[int, bool], target: int) -> None:
        attempts = len(files)  # as its evictor: files still being written are passed over, not evicted
        while len(files) > target and attempts > 0:
            key, landed = files.popitem(last=False)
            if landed:
                self.evicted_files += 1
                attempts = len(files)
            else:
                files[key] = False
                attempts -= 1

    def _landed(self, node: int, keys: list[int]) -> None:
        files = self.files[node]
        for key in keys:
            if key in files:
                files[key] = True

    def _read_batch(self, node: int, batch: list[int], job: Job) -> tuple[int, float]:
        got = self._l3_prefix(node, tuple(batch), 0)
        files = self.files[node]
        for key in batch[:got]:
            files.move_to_end(key)  # a read is a use
        return got, self._ssd_read(job, got) if got else self.loop.now

    def occupancy(self) -> tuple[int, int]:
        dram, _ = super().occupancy()
        return dram, sum(len(f) for f in self.files) * self.c.page_span * self.c.width

    def counters(self) -> dict[str, Any]:
        return {**super().counters(), "evicted_files": self.evicted_files}


class MooncakeL3(RealL3):
    """Mooncake Store: a DRAM segment (half the budget) over bucket files written as the segment evicts."""

    peers_name = "mooncake"

    def __init__(self, c: Cluster, loop: EventLoop) -> None:
        segment = c.dram_bytes // 2  # the emulator's split: half SGLang's host tier, half Mooncake's segment
        super().__init__(c, loop, host_dram_bytes=c.dram_bytes - segment)
        self.name = "hicache-mooncake"
        self.segment_pages = max(1, segment // c.page_span)
        self.segment: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(c.nodes)]
        self.offloading: list[set[int]] = [set() for _ in range(c.nodes)]  # evicted, bucket not yet written
        self.offloaded_pages = 0
        self.refused_puts = 0
        self.peak_offload_backlog = 0
        self.segment_reads = 0

    def _in_dram(self, node: int, key: int) -> bool:
        return key in self.segment[node] or key in self.offloading[node]

    def _l3_prefix(self, node: int, keys: tuple[int, ...], start: int) -> int:
        l3, n = self.l3[node], start
        while n < len(keys) and (keys[n] in l3 or self._in_dram(node, keys[n])):
            n += 1
        return n - start

    def _unstored(self, node: int, keys: list[int]) -> list[int]:
        l3 = self.l3[node]
        return [k for k in keys if k not in l3 and not self._in_dram(node, k)]

    def _l3_append(self, node: int, keys: list[int]) -> float | None:
        """Puts into the segment, found at once. A page being offloaded holds its memory until its bucket is
        written, so a put that finds no room is refused (SGLang's backend reports it failed and HiCache does
        not retry it). Past the high watermark the master evicts the least recently used pages to SSD."""
        if not keys:
            return None
        seg, pending = self.segment[node], self.offloading[node]
        room = max(0, self.segment_pages - len(seg) - len(pending))
        for key in keys[:room]:
            seg[key] = None
        self.refused_puts += len(keys) - min(room, len(keys))
        evict = 0
        while len(seg) - evict > HIGH_WATERMARK * self.segment_pages:  # eviction passes until under it
            evict += max(1, int(EVICTION_SHARE * self.segment_pages))
        if evict:
            self._offload(node, [seg.popitem(last=False)[0] for _ in range(min(evict, len(seg)))])
        return None

    def _offload(self, node: int, keys: list[int]) -> None:
        pending = self.offloading[node]
        pending.update(keys)
        self.peak_offload_backlog = max(self.peak_offload_backlog, len(pending))
        done = self._ssd_write(node, len(keys), -(-len(keys) // BUCKET_KEYS))
        self.loop.at(done, self._offloaded, node, keys)

    def _offloaded(self, node: int, keys: list[int]) -> None:
        self.offloading[node].difference_update(keys)
        self.offloaded_pages += self._log(node, keys)

    def _read_batch(self, node: int, batch: list[int], job: Job) -> tuple[int, float]:
        got = self._l3_prefix(node, tuple(batch), 0)
        seg, ssd = self.segment[node], 0
        for key in batch[:got]:
            if key in seg:
                seg.move_to_end(key)  # a read is a use
            if self._in_dram(node, key):
                job.l3_dram.add(key)
                self.segment_reads += 1
            else:
                ssd += 1
        return got, self._ssd_read(job, ssd) if ssd else self.loop.now

    def _held_pages(self) -> int:
        """Pages in the segments, those being offloaded included (they hold their memory until written)."""
        return sum(len(s) + len(p) for s, p in zip(self.segment, self.offloading, strict=True))

    def occupancy(self) -> tuple[int, int]:
        dram, ssd = super().occupancy()
        return dram + self._held_pages() * self.c.page_span * self.c.width, ssd

    def counters(self) -> dict[str, Any]:
        # What the segment holds when the trace ends was never written to SSD, and is not durable: the
        # reason its SSD bytes written fall short of what write-through systems write on a finite trace.
        held = self._held_pages()
        at_end = {"segment_pages_at_end": held, "segment_bytes_at_end": held * self.c.page_span * self.c.width}
        return {**super().counters(), "offloaded_pages": self.offloaded_pages, "segment_reads": self.segment_reads,
                "refused_puts": self.refused_puts, "peak_offload_backlog_pages": self.peak_offload_backlog,
                **at_end}  # fmt: skip
