"""Storage and copy devices as FIFO servers with bandwidth, per-command cost and queue depth.

A job of ``k`` commands and ``n`` bytes occupies the device for ``ceil(k / queue_depth) x command_s +
n / bandwidth``: bandwidth is shared by everything queued (a FIFO keeps the device's throughput and
is O(1) per job), and up to ``queue_depth`` commands overlap their fixed cost. So one read of ``n``
bytes takes ``command_s + n / B``, and small commands stop paying for themselves once their count
outgrows the queue depth: the effect FC-CIO's coalescing removes.

Profiles are per node; the simulator divides bandwidth and queue depth among the ranks that share a
node's devices (see ``run``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flatcake.errors import ConfigError

GB = 1e9


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    read_bytes_per_s: float
    write_bytes_per_s: float
    command_s: float  # fixed cost of one command (submission + device latency)
    queue_depth: int  # commands in flight at once
    h2d_bytes_per_s: float  # one GPU's host-to-device copy rate (DRAM hits)
    source: str


PROFILES = {
    # This VM (docs/benchmarks.md): fio 1 MiB O_DIRECT sequential reads with 2 jobs 1.0-1.16
    # GB/s; 4 KiB at queue depth 1 ~13.5K IOPS (74 us a command); FlatCake's durable writes 1.26 GB/s
    # (bench peers); two I/O workers. No GPU: H2D is PCIe 4.0 x16's usual 25 GB/s.
    "this-vm": DeviceProfile(
        "this-vm", read_bytes_per_s=1.1 * GB, write_bytes_per_s=1.26 * GB, command_s=74e-6, queue_depth=2,
        h2d_bytes_per_s=25 * GB,
        source="docs/benchmarks.md bench restore/peers: fio 1 MiB O_DIRECT 1.0-1.16 GB/s (2 jobs), 4 KiB QD1 "
               "13.5K IOPS, FlatCake durable writes 1.26 GB/s; H2D 25 GB/s (PCIe 4.0 x16, assumed)",
    ),
    # The paper's node: 4 x Samsung PM9A3 3.84 TB (U.2, PCIe 4.0) in RAID-0. Datasheet per drive: 6,900 MB/s
    # sequential read, 4,100 MB/s sequential write, 1,000K random-read IOPS (4 KiB, QD high). Four drives:
    # 27.6 GB/s read, 16.4 GB/s write; 80 us a command with 256 in flight gives 3.2M IOPS, under 4 x 1M.
    # H2D: PCIe 5.0 x16 to each B200/H200, ~50 GB/s in practice.
    "nvme-raid0-4x-pm9a3": DeviceProfile(
        "nvme-raid0-4x-pm9a3", read_bytes_per_s=4 * 6.9 * GB, write_bytes_per_s=4 * 4.1 * GB, command_s=80e-6,
        queue_depth=256, h2d_bytes_per_s=50 * GB,
        source="Samsung PM9A3 3.84 TB datasheet (MZQL23T8HCLS): 6,900 MB/s seq read, 4,100 MB/s seq write, "
               "1,000K IOPS 4 KiB random read; x4 RAID-0 (the paper's drives, reference article line 157); "
               "H2D 50 GB/s (PCIe 5.0 x16, assumed)",
    ),
}  # fmt: skip
DEFAULT_PROFILE = "nvme-raid0-4x-pm9a3"


def profile(name: str | DeviceProfile) -> DeviceProfile:
    """A named profile, or one given whole (measured rates: ``simulate --validate``)."""
    if isinstance(name, DeviceProfile):
        return name
    if name not in PROFILES:
        raise ConfigError(f"--device: {name!r} is not a profile; choose one of {', '.join(PROFILES)}")
    return PROFILES[name]


class Device:
    """One FIFO server. ``submit`` returns when a job finishes; the caller schedules that event."""

    def __init__(self, bytes_per_s: float, command_s: float, queue_depth: int, write_bytes_per_s: float = 0) -> None:
        if bytes_per_s <= 0 or command_s < 0 or queue_depth < 1:
            raise ValueError("device: need bandwidth > 0, command cost >= 0 and queue depth >= 1")
        self.bytes_per_s = bytes_per_s
        self.write_bytes_per_s = write_bytes_per_s or bytes_per_s
        self.command_s, self.queue_depth = command_s, queue_depth
        self.free_at = 0.0
        self.busy_s = 0.0
        self.read_bytes = self.read_commands = 0
        self.write_bytes = self.write_commands = 0

    def service_s(self, nbytes: int, commands: int, write: bool = False) -> float:
        rate = self.write_bytes_per_s if write else self.bytes_per_s
        return math.ceil(commands / self.queue_depth) * self.command_s + nbytes / rate

    def submit(self, now: float, nbytes: int, commands: int, write: bool = False) -> float:
        """Queue a job at ``now``; returns its finish time."""
        if commands <= 0:
            return now
        service = self.service_s(nbytes, commands, write)
        start = max(now, self.free_at)
        self.free_at = start + service
        self.busy_s += service
        if write:
            self.write_bytes += nbytes
            self.write_commands += commands
        else:
            self.read_bytes += nbytes
            self.read_commands += commands
        return self.free_at
