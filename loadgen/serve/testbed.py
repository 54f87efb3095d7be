"""The storage-bound testbed: every system's files on one loop device whose bandwidth the kernel's
block-I/O throttle caps, for every process a run starts.

On this CPU a restore costs far less, next to the prefill it saves, than on a GPU over NVMe
(``serve_calibration``: ``factor``), so restore speed cannot show in TTFT. A scaled testbed closes the
gap as GPU-less labs do: the calibrated model shape, plus a read limit of this machine's rate divided
by the shape's remaining factor (``read_limit``). The limit is the kernel's: cgroup v1
``blkio.throttle.read_bps_device``/``write_bps_device`` or v2 ``io.max``, on the loop device's
``MAJ:MIN``. The bench moves itself into the cgroup before it starts anything, so the agent, the engine
server, Mooncake's master and every baseline inherit it; ``verify`` fails a point where any process it
started is outside. Biases to state: DRAM copies and page-cache hits are not throttled (systems that
keep more in DRAM or in the page cache gain next to SSD reads), and cgroup v1 cannot throttle buffered
writeback (written pages reach the device from the kernel's flusher threads).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

V1_ROOT = Path("/sys/fs/cgroup/blkio")
V2_ROOTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
XFS_MIN_BYTES = 512 << 20  # mkfs.xfs refuses filesystems under 300 MB
TOOLS = {"losetup": "mount", "mkfs.xfs": "xfsprogs", "mount": "mount", "umount": "mount"}


class TestbedError(RuntimeError):
    """The testbed cannot be built here, or a process escaped its limit."""


def read_limit(calibration: dict[str, Any], shape: str) -> dict[str, Any]:
    """The read limit that makes ``shape``'s restores cost, next to its prefill, what the calibration's
    GPU reference's do: this machine's measured read rate over the shape's ``factor``."""
    rows = {r["where"]: r for r in calibration["here"]}
    where = f"this machine, {shape}"
    if where not in rows:
        known = ", ".join(w.removeprefix("this machine, ") for w in rows)
        raise TestbedError(f"shape {shape!r} is not in the calibration (it has {known}); run bench serve --calibrate")
    row = rows[where]
    limit = int(row["read_bytes_per_s"] / row["factor"])
    return {"shape": shape, "reference": calibration["reference"]["where"],
            "reference_restore_over_prefill": calibration["reference"]["restore_over_prefill"],
            "here_read_bytes_per_s": row["read_bytes_per_s"], "here_restore_over_prefill": row["restore_over_prefill"],
            "factor": row["factor"], "read_bytes_per_s": limit,
            "arithmetic": f"{row['read_bytes_per_s']:.3g} B/s / {row['factor']:.3g} = {limit:.3g} B/s"}  # fmt: skip


def device_number(dev: str | Path) -> str:
    """``MAJ:MIN`` of a block device node."""
    st = os.stat(dev)
    return f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"


def _v2_root() -> Path | None:
    for root in V2_ROOTS:
        ctl = root / "cgroup.controllers"
        if ctl.exists() and "io" in ctl.read_text().split():
            return root
    return None


@dataclass
class Throttle:
    """A cgroup with a read (and write) limit on one device; ``join`` moves a process into it, children
    inherit it. Removed on exit, its members moved back to the root."""

    device: str  # MAJ:MIN
    read_bps: int
    write_bps: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.read_bps < 1 or (self.write_bps is not None and self.write_bps < 1):
            raise TestbedError(f"throttle: rates must be >= 1 B/s (read {self.read_bps}, write {self.write_bps})")
        self.name = self.name or f"flatcake-testbed-{os.getpid()}"
        self.path: Path | None = None
        self.version = 0

    def __enter__(self) -> Throttle:
        if os.geteuid() != 0:
            raise TestbedError("the block-I/O throttle needs root (cgroup files are root's)")
        if (V1_ROOT / "blkio.throttle.read_bps_device").exists():
            # A child of this process's own blkio cgroup (a container's, on CI), where it returns on exit.
            self.version, self.path = 1, V1_ROOT / own_cgroup("blkio").lstrip("/") / self.name
            self.path.mkdir(exist_ok=True)
            (self.path / "blkio.throttle.read_bps_device").write_text(f"{self.device} {self.read_bps}\n")
            if self.write_bps is not None:
                (self.path / "blkio.throttle.write_bps_device").write_text(f"{self.device} {self.write_bps}\n")
        elif (root := _v2_root()) is not None:
            # Under the root, which alone may both hold processes and hand the io controller down.
            self.version, self.path = 2, root / self.name
            (root / "cgroup.subtree_control").write_text("+io\n")
            self.path.mkdir(exist_ok=True)
            wbps = self.write_bps if self.write_bps is not None else "max"
            (self.path / "io.max").write_text(f"{self.device} rbps={self.read_bps} wbps={wbps}\n")
        else:
            raise TestbedError("no block-I/O controller: neither cgroup v1 blkio nor v2 io is mounted")
        return self

    def join(self, pid: int | None = None) -> None:
        assert self.path is not None, "join inside the with block"
        (self.path / "cgroup.procs").write_text(f"{pid or os.getpid()}\n")

    def members(self) -> set[int]:
        assert self.path is not None
        return {int(p) for p in (self.path / "cgroup.procs").read_text().split()}

    def holds(self, pid: int) -> bool:
        """Whether ``pid`` is in this cgroup (its /proc entry names it)."""
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except FileNotFoundError:
            return False
        want = f"/{self.name}"
        for line in lines:
            _, controllers, path = line.split(":", 2)
            ours = (self.version == 1 and "blkio" in controllers.split(",")) or (self.version == 2 and not controllers)
            if ours and path.endswith(want):
                return True
        return False

    def verify(self, root_pid: int | None = None) -> int:
        """Every live descendant of ``root_pid`` (default: this process) is in the cgroup; returns how many
        were checked. Raises naming any that is not: a process that escaped would read unthrottled."""
        outside = [(pid, cmd) for pid, cmd in descendants(root_pid or os.getpid()) if not self.holds(pid)]
        if outside:
            names = ", ".join(f"{pid} ({cmd[:80]})" for pid, cmd in outside)
            raise TestbedError(f"processes outside the throttle {self.name}: {names}")
        return len(descendants(root_pid or os.getpid()))

    def __exit__(self, *exc: object) -> None:
        if self.path is None:
            return
        home = self.path.parent / "cgroup.procs"
        for pid in self.members():
            with contextlib.suppress(OSError):
                home.write_text(f"{pid}\n")
        with contextlib.suppress(OSError):
            self.path.rmdir()
        self.path = None


def own_cgroup(controller: str) -> str:
    """This process's cgroup path for a v1 ``controller`` ("/" at the root)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    raise TestbedError(f"this process is in no {controller} cgroup (is the controller mounted?)")


def descendants(root: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live process below ``root``, from /proc."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = [], [root]
    while frontier:
        p = frontier.pop()
        for child, ppid in parent.items():
            if ppid == p:
                frontier.append(child)
                with contextlib.suppress(OSError):
                    cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    out.append((child, cmd.strip()))
    return out


def _run(cmd: list[str]) -> str:
    tool = cmd[0]
    if shutil.which(tool) is None:
        raise TestbedError(f"{tool} is not installed (Debian package {TOOLS.get(tool, tool)}); bin/test installs it")
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise TestbedError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[:500]}")
    return done.stdout.strip()


@contextlib.contextmanager
def loop_disk(image: Path, size_bytes: int, mountpoint: Path) -> Iterator[tuple[Path, str]]:
    """A file-backed loop device (direct I/O to its backing file, so the host's page cache does not hold
    its blocks twice) with its own XFS, mounted at ``mountpoint``: yields (mountpoint, MAJ:MIN)."""
    if os.geteuid() != 0:
        raise TestbedError("the testbed's loop device needs root (losetup, mkfs.xfs, mount)")
    image.parent.mkdir(parents=True, exist_ok=True)
    with open(image, "wb") as f:
        f.truncate(max(size_bytes, XFS_MIN_BYTES))  # sparse: only what is written takes space
    dev = _run(["losetup", "--find", "--show", "--direct-io=on", str(image)])
    mounted = False
    try:
        _run(["mkfs.xfs", "-q", "-f", dev])
        mountpoint.mkdir(parents=True, exist_ok=True)
        _run(["mount", "-t", "xfs", dev, str(mountpoint)])
        mounted = True
        yield mountpoint, device_number(dev)
    finally:
        if mounted:
            with contextlib.suppress(TestbedError):
                _run(["umount", str(mountpoint)])
        with contextlib.suppress(TestbedError):
            _run(["losetup", "-d", dev])
        image.unlink(missing_ok=True)


_ACTIVE: list[Throttle] = []  # the throttle this process runs in (process-wide, as cgroup membership is)


@contextlib.contextmanager
def testbed(
    work: Path, size_bytes: int, read_bps: int, write_bps: int | None = None
) -> Iterator[tuple[Path, Throttle]]:
    """The loop disk under ``work`` and this process inside a throttle on it: yields (where every system's
    files go, the throttle). Processes started inside inherit the limit."""
    with contextlib.ExitStack() as stack:
        disk, number = stack.enter_context(loop_disk(work / "testbed.img", size_bytes, work / "disk"))
        throttle = stack.enter_context(Throttle(number, read_bps, write_bps))
        throttle.join()
        _ACTIVE.append(throttle)
        try:
            yield disk, throttle
        finally:
            _ACTIVE.remove(throttle)


def verify_active() -> int | None:
    """Inside ``testbed``: check every process this one started is throttled (``Throttle.verify``) and
    return how many; None outside a testbed."""
    return _ACTIVE[-1].verify() if _ACTIVE else None
