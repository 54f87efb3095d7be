"""``flatcake agent prepare``: make a node ready for the agent. Plan (pure), then apply; idempotent.

Steps, each only when the node is not already in the wanted state:
1. hugepages: reserve through sysfs and verify. The kubelet reads hugepage capacity only when it
   starts, so pods can request ``hugepages-*`` only after a kubelet restart: either provision the
   pages ahead (kernel command line, or a node-setup DaemonSet), or opt in to ``restart_kubelet``.
2. RAID-0 over the listed devices with mdadm (an existing array of exactly those devices is reused,
   never recreated); one device is used directly.
3. XFS on the array or device, only where no filesystem exists, unless ``wipe`` allows it.
4. mount it at ``prepare.mount``.
5. the file pool: preallocated files checked to be single extents (FIEMAP), and its manifest.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from flatcake.errors import PrepareError
from flatcake.node_agent.config import EngineConfig
from flatcake.node_agent.datapath.file_pool import create_pool
from flatcake.node_agent.node.hugepages import reserve_hugepages, reserved_hugepages, wanted_hugepages


@dataclass(frozen=True)
class NodeState:
    """What the node looks like now (from ``probe``; tests build it by hand)."""

    hugepages: dict[str, int] = field(default_factory=dict)  # size -> reserved pages
    md_arrays: dict[str, tuple[str, ...]] = field(default_factory=dict)  # /dev/mdX -> member devices
    md_available: bool = True  # /proc/mdstat exists (the md driver is loaded)
    filesystems: dict[str, str] = field(default_factory=dict)  # device -> filesystem type ("" if none)
    mounts: dict[str, str] = field(default_factory=dict)  # mount point -> device
    existing_devices: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Step:
    name: str
    why: str
    argv: tuple[str, ...] = ()  # a command to run, or
    action: str = ""  # an in-process action: "hugepages" or "pool"
    device: str = ""

    def describe(self) -> str:
        what = " ".join(self.argv) if self.argv else self.action
        return f"{self.name}: {what}  # {self.why}"


def plan(c: EngineConfig, state: NodeState) -> list[Step]:
    """The steps that bring the node from ``state`` to what ``c`` asks for. Raises PrepareError
    for what cannot be done safely (a device with data and no wipe, missing devices, no md driver)."""
    p = c.prepare
    steps: list[Step] = []
    want = wanted_hugepages(c)
    if want and state.hugepages.get(p.hugepage_size, 0) < want:
        steps.append(Step("hugepages", f"reserve {want} pages of {p.hugepage_size} for the DRAM pool "
                          f"({state.hugepages.get(p.hugepage_size, 0)} reserved now)", action="hugepages"))  # fmt: skip
        if p.restart_kubelet:
            # Through PID 1's mount namespace: from the agent's init container (hostPID, privileged)
            # this reaches the host's systemd; on the host itself it is a plain systemctl.
            restart = ("nsenter", "--target", "1", "--mount", "--", "systemctl", "restart", "kubelet")
            steps.append(Step("kubelet", "the kubelet reads hugepage capacity only at start", argv=restart))
    if p.devices:
        missing = [d for d in p.devices if d not in state.existing_devices]
        if missing:
            raise PrepareError(
                f"devices: {missing} do not exist on this node; fix prepare.devices in the FlatCakeCache"
            )
        target = p.devices[0]
        if len(p.devices) > 1:
            target = _raid(steps, p.devices, p.raid_name, state)
        fs = state.filesystems.get(target, "")
        if fs and fs != "xfs" and not p.wipe:
            raise PrepareError(f"mkfs: {target} holds a {fs} filesystem; refusing to format it. Set wipePolicy "
                               "to allow wiping (its data is lost) or list other devices")  # fmt: skip
        if not fs or (fs != "xfs" and p.wipe):
            steps.append(Step("mkfs", f"{target} has {'no filesystem' if not fs else fs + ' (wipe allowed)'}",
                              argv=("mkfs.xfs", "-f", target), device=target))  # fmt: skip
        if state.mounts.get(p.mount) != target:
            if p.mount in state.mounts:
                raise PrepareError(f"mount: {p.mount} already has {state.mounts[p.mount]} mounted; "
                                   "unmount it or choose another prepare.mount")  # fmt: skip
            steps.append(Step("mkdir", f"mount point {p.mount}", argv=("mkdir", "-p", p.mount)))
            mount = ("mount", "-t", "xfs", "-o", "noatime", target, p.mount)
            steps.append(Step("mount", f"XFS on {target} at {p.mount}", argv=mount, device=target))
    steps.append(Step("pool", f"{c.ssd.file_count} files of {c.ssd.file_bytes} bytes in {c.ssd.dir}, "
                      "single extents checked", action="pool"))  # fmt: skip
    return steps


def _raid(steps: list[Step], devices: Sequence[str], name: str, state: NodeState) -> str:
    for md, members in state.md_arrays.items():
        if sorted(members) == sorted(devices):
            return md  # found: reused, never recreated
        shared = set(members) & set(devices)
        if shared:
            raise PrepareError(f"raid: {sorted(shared)} already belong to {md} with other members; "
                               "stop that array or change prepare.devices")  # fmt: skip
    if not state.md_available:
        raise PrepareError("raid: no md driver on this node (/proc/mdstat is missing); load it with "
                           "`modprobe md_mod raid0` or give a single device")  # fmt: skip
    md = f"/dev/md/{name}"
    steps.append(Step("raid", f"RAID-0 over {len(devices)} devices", device=md,
                      argv=("mdadm", "--create", md, "--run", "--level=0", "--chunk=512",
                            f"--raid-devices={len(devices)}", *devices)))  # fmt: skip
    return md


def probe(c: EngineConfig) -> NodeState:
    """Read the node's state: sysfs, /proc/mdstat, blkid, /proc/mounts."""
    huge = reserved_hugepages()
    md_available = Path("/proc/mdstat").exists()
    arrays: dict[str, tuple[str, ...]] = {}
    if md_available:
        for line in Path("/proc/mdstat").read_text().splitlines():
            parts = line.split()
            if parts and parts[0].startswith("md") and ":" in parts:
                arrays["/dev/" + parts[0]] = tuple("/dev/" + m.split("[")[0] for m in parts[4:])
    devices = [*c.prepare.devices, *arrays]
    fs = {}
    for dev in devices:
        out = subprocess.run(["blkid", "-o", "value", "-s", "TYPE", dev], capture_output=True, text=True)
        fs[dev] = out.stdout.strip()
    mounts = {}
    for line in Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2:
            mounts[parts[1]] = parts[0]
    existing = frozenset(d for d in devices if os.path.exists(d))
    return NodeState(huge, arrays, md_available, fs, mounts, existing)


def apply(c: EngineConfig, steps: Sequence[Step], log: Callable[[str], None] = print) -> None:
    for step in steps:
        log(f"prepare: {step.describe()}")
        if step.action == "hugepages":
            reserve_hugepages(c)
        elif step.action == "pool":
            try:
                create_pool(c.ssd.dir, c.ssd.file_count, c.ssd.file_bytes, extent_policy=c.ssd.extent_policy)
            except (OSError, ValueError, RuntimeError) as exc:
                raise PrepareError(f"pool: {exc}") from exc
        else:
            out = subprocess.run(step.argv, capture_output=True, text=True)
            if out.returncode != 0:
                device = f" on {step.device}" if step.device else ""
                cmd = " ".join(step.argv)
                raise PrepareError(f"{step.name}{device} failed ({cmd}): {out.stderr.strip()[-400:]}")


def reclaim(c: EngineConfig, log: Callable[[str], None] = print) -> list[str]:
    """Erase this cache's data on the node (a FlatCakeCache deleted with reclaimPolicy Delete): the
    pool directory (files, manifest, journal) and the shared DRAM pool file. The filesystem and array
    stay; idempotent. Returns what was removed."""
    removed = []
    pool = Path(c.ssd.dir)
    if pool.exists():
        shutil.rmtree(pool)
        removed.append(str(pool))
    dram_dirs = [Path(c.dram.shm_dir)] + ([Path(c.dram.hugetlbfs_dir)] if c.dram.hugetlbfs_dir else [])
    for d in dram_dirs:
        path = d / c.dram.name
        if path.exists():
            path.unlink()
            removed.append(str(path))
    for what in removed:
        log(f"reclaim: removed {what}")
    if not removed:
        log("reclaim: nothing to remove")
    return removed
