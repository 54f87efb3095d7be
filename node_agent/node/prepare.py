"""``flatcake agent prepare``: make a node ready for the agent. Plan (pure), then apply; idempotent.

Steps, each only when the node is not already in the wanted state:
1. hugepages: reserve through sysfs and verify. The kubelet reads hugepage capacity only when it
   starts, so pods can request ``hugepages-*`` only after a kubelet restart: either provision the
   pages ahead (kernel command line, or a node-setup DaemonSet), or opt in to ``restart_kubelet``.
2. RAID-0 over the listed devices with mdadm (an existing array of exactly those devices is reused,
   never recreated); one device is used directly.
3. XFS on the array or device; an XFS already there is reused (mounted, never formatted).
4. mount it at ``prepare.mount``.

Nothing destructive (mdadm --create, mkfs) runs over a device that carries anything: a partition
table, a filesystem, a RAID or LVM signature (as ``wipefs`` lists them), or a device that is mounted
or held (its own or a partition's mount, a holder such as md or device-mapper, swap). ``wipe``
(``wipePolicy: Wipe``) erases the signatures first (``wipefs --all``); a device in use is refused even
then, since wiping it would pull a filesystem out from under whatever uses it.

Device paths are resolved once, in ``probe`` (``/dev/disk/by-id/...`` symlinks name the same device as
``/proc/mdstat`` and mountinfo do, so a second run recognises what the first one made).
5. the file pool: preallocated files checked to be single extents (FIEMAP), and its manifest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from flatcake.errors import PrepareError
from flatcake.node_agent.catalog.files import resolve_gid
from flatcake.node_agent.config import EngineConfig
from flatcake.node_agent.constants import HUGEPAGE_BYTES
from flatcake.node_agent.datapath.file_pool import create_pool
from flatcake.node_agent.node.hugepages import (
    hugepage_shares,
    node_total,
    release_share,
    reserve_hugepages,
    reserved_hugepages,
    wanted_hugepages,
)


@dataclass(frozen=True)
class NodeState:
    """What the node looks like now (from ``probe``; tests build it by hand)."""

    hugepages: dict[str, int] = field(default_factory=dict)  # size -> reserved pages
    md_arrays: dict[str, tuple[str, ...]] = field(default_factory=dict)  # /dev/mdX -> member devices
    md_available: bool = True  # /proc/mdstat exists (the md driver is loaded)
    filesystems: dict[str, str] = field(default_factory=dict)  # device -> filesystem type ("" if none)
    mounts: dict[str, str] = field(default_factory=dict)  # mount point -> device
    existing_devices: frozenset[str] = frozenset()
    # prepare.devices as written -> the device node they name (symlinks such as /dev/disk/by-id/...
    # resolved); the other fields are keyed by the resolved path. Absent: the path is used as it is.
    resolved: dict[str, str] = field(default_factory=dict)
    signatures: dict[str, tuple[str, ...]] = field(default_factory=dict)  # device -> wipefs types ("gpt", "ext4")
    in_use: dict[str, tuple[str, ...]] = field(default_factory=dict)  # device -> "mounted at /x", "held by md127"
    hugepage_shares: dict[str, int] = field(default_factory=dict)  # dram.name -> pages, caches on this node
    hugetlbfs: dict[str, int] = field(default_factory=dict)  # hugetlbfs mount point -> its page bytes


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
    total = node_total(c, state.hugepage_shares)
    have = state.hugepages.get(p.hugepage_size, 0)
    # The node's count serves every cache on it: this cache's share is recorded and added to theirs.
    if want and (state.hugepage_shares.get(c.dram.name) != want or have < total):
        steps.append(Step("hugepages", f"reserve {total} pages of {p.hugepage_size}: {want} for this DRAM pool, "
                          f"{total - want} for other caches on this node ({have} reserved now)",
                          action="hugepages"))  # fmt: skip
        if p.restart_kubelet:
            # Through PID 1's mount namespace: from the agent's init container (hostPID, privileged)
            # this reaches the host's systemd; on the host itself it is a plain systemctl.
            restart = ("nsenter", "--target", "1", "--mount", "--", "systemctl", "restart", "kubelet")
            steps.append(Step("kubelet", "the kubelet reads hugepage capacity only at start", argv=restart))
    if want and c.dram.hugetlbfs_dir:
        _hugetlbfs(steps, c, want, state)
    if p.devices:
        devices = tuple(state.resolved.get(d, d) for d in p.devices)
        missing = [d for d, real in zip(p.devices, devices, strict=True) if real not in state.existing_devices]
        if missing:
            raise PrepareError(
                f"devices: {missing} do not exist on this node; fix prepare.devices in the FlatCakeCache"
            )
        if len(devices) > 1:
            target = _raid(steps, devices, p.raid_name, state, p.wipe)
            fresh = target not in state.md_arrays  # made by this plan: nothing on it yet
        else:
            target, fresh = devices[0], False
        if not fresh:
            _format_or_reuse(steps, target, state, p.mount, p.wipe)
        else:
            steps.append(Step("mkfs", f"{target} is the new array", argv=_mkfs(target, p.wipe), device=target))
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


def _hugetlbfs(steps: list[Step], c: EngineConfig, pages: int, state: NodeState) -> None:
    """This cache's own hugetlbfs at ``dram.hugetlbfs_dir``, limited to its pages: its inference pods mount
    that directory alone, never the node-wide /dev/hugepages that holds other caches' DRAM pools."""
    where, size = c.dram.hugetlbfs_dir or "", HUGEPAGE_BYTES[c.prepare.hugepage_size]
    have = state.hugetlbfs.get(where)
    if have == size:
        return
    if have is not None:
        raise PrepareError(f"dram.hugetlbfs_dir: {where} is hugetlbfs of {have}-byte pages, this cache's are {size} "
                           "bytes (prepare.hugepage_size); unmount it or choose another directory")  # fmt: skip
    if where in state.mounts:
        raise PrepareError(f"dram.hugetlbfs_dir: {where} already has {state.mounts[where]} mounted; unmount it or "
                           "choose another directory")  # fmt: skip
    gid = resolve_gid(c.agent.group)
    options = [f"pagesize={size}", f"size={pages * size}", "mode=0770" if gid >= 0 else "mode=0700"]
    options += [f"gid={gid}"] if gid >= 0 else []
    steps.append(Step("mkdir", f"mount point {where}", argv=("mkdir", "-p", where)))
    steps.append(Step("hugetlbfs", f"this cache's own hugepages, at most {pages} of {c.prepare.hugepage_size}",
                      argv=("mount", "-t", "hugetlbfs", "-o", ",".join(options), "nodev", where)))  # fmt: skip


def _mkfs(device: str, wipe: bool) -> tuple[str, ...]:
    # -f only under wipe: without it mkfs.xfs itself refuses a device where it finds a filesystem, a
    # second guard behind the checks here (a new array may expose old data past the members' headers).
    return ("mkfs.xfs", "-f", device) if wipe else ("mkfs.xfs", device)


def _found(state: NodeState, device: str) -> list[str]:
    """What ``device`` carries: wipefs's signature types, else blkid's filesystem type."""
    found = list(state.signatures.get(device, ()))
    fs = state.filesystems.get(device, "")
    if fs and fs not in found:
        found.append(fs)
    return found


def _refuse_in_use(device: str, state: NodeState, own_mount: str = "") -> None:
    busy = [u for u in state.in_use.get(device, ()) if own_mount == "" or u != f"mounted at {own_mount}"]
    if busy:
        raise PrepareError(f"devices: {device} is in use ({'; '.join(busy)}); refusing to touch it, under any "
                           "wipePolicy. Unmount or release it, or list other devices in prepare.devices")  # fmt: skip


def _refuse_or_wipe(steps: list[Step], device: str, found: list[str], wipe: bool, what: str) -> None:
    """``device`` carries ``found``: under wipe, erase its signatures (a step); else refuse."""
    if not wipe:
        raise PrepareError(f"devices: {device} carries {', '.join(found)}; refusing to {what} over it "
                           "(wipePolicy: Refuse). Set wipePolicy: Wipe to erase it (its data is lost) "
                           "or list other devices")  # fmt: skip
    steps.append(Step("wipefs", f"{device} carries {', '.join(found)} (wipe allowed)",
                      argv=("wipefs", "--all", device), device=device))  # fmt: skip


def _format_or_reuse(steps: list[Step], target: str, state: NodeState, mount: str, wipe: bool) -> None:
    """XFS alone on ``target`` is reused; nothing at all gets mkfs; anything else needs wipe."""
    _refuse_in_use(target, state, own_mount=mount)
    found = _found(state, target)
    if found == ["xfs"]:
        return
    if found:
        _refuse_or_wipe(steps, target, found, wipe, "format")
    why = f"{target} has {'nothing on it' if not found else ', '.join(found) + ' (wipe allowed)'}"
    steps.append(Step("mkfs", why, argv=_mkfs(target, wipe), device=target))


def _raid(steps: list[Step], devices: Sequence[str], name: str, state: NodeState, wipe: bool) -> str:
    for md, members in state.md_arrays.items():
        if sorted(members) == sorted(devices):
            return md  # found: reused, never recreated
        shared = set(members) & set(devices)
        if shared:
            raise PrepareError(f"raid: {sorted(shared)} already belong to {md} with other members; "
                               "stop that array or change prepare.devices")  # fmt: skip
    # Every member is checked before any step: one refused member leaves all of them untouched.
    for device in devices:
        _refuse_in_use(device, state)
    for device in devices:
        found = _found(state, device)
        if found:
            _refuse_or_wipe(steps, device, found, wipe, "create an array")
    if not state.md_available:
        raise PrepareError("raid: no md driver on this node (/proc/mdstat is missing); load it with "
                           "`modprobe md_mod raid0` or give a single device")  # fmt: skip
    md = f"/dev/md/{name}"
    steps.append(Step("raid", f"RAID-0 over {len(devices)} devices", device=md,
                      argv=("mdadm", "--create", md, "--run", "--level=0", "--chunk=512",
                            f"--raid-devices={len(devices)}", *devices)))  # fmt: skip
    return md


def _signatures(device: str) -> tuple[str, ...]:
    """The signatures wipefs finds on ``device`` (partition tables, filesystems, RAID, LVM), listed
    only: without --all wipefs erases nothing, and --no-act makes that explicit."""
    try:
        out = subprocess.run(["wipefs", "--no-act", "--json", device], capture_output=True, text=True)
    except FileNotFoundError:
        raise PrepareError("devices: wipefs is missing; install util-linux (the agent image has it)") from None
    if out.returncode != 0:
        raise PrepareError(f"devices: cannot read the signatures on {device} (wipefs: {out.stderr.strip()}); "
                           "run the prepare step privileged, with the host's /dev")  # fmt: skip
    if not out.stdout.strip():
        return ()  # wipefs prints nothing at all for a blank device
    found = json.loads(out.stdout).get("signatures", [])
    return tuple(dict.fromkeys(str(s.get("type", "?")) for s in found))  # once each, in wipefs's order


_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(path: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes (\\040)."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), path)


class Mount(NamedTuple):
    """One line of /proc/self/mountinfo, the fields prepare reads."""

    majmin: str
    point: str
    source: str
    fstype: str
    options: str  # the superblock's options (hugetlbfs: ``pagesize=2M``)


def _mountinfo() -> list[Mount]:
    """Every mount this process sees."""
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5:
            continue
        rest += [""] * (3 - len(rest))
        mounts.append(Mount(fields[2], _unescape(fields[4]), _unescape(rest[1]), rest[0], rest[2]))
    return mounts


def _in_use(device: str, mounts: list[Mount], swaps: set[str]) -> tuple[str, ...]:
    """How ``device`` or one of its partitions is in use: mounted, held (md, device-mapper), swap."""
    sysfs = Path("/sys/class/block") / Path(device).name
    names = [Path(device).name]
    if sysfs.is_dir():
        names += sorted(p.name for p in sysfs.iterdir() if (p / "partition").exists())
    uses: list[str] = []
    for name in names:
        node = Path("/sys/class/block") / name
        where = "" if name == names[0] else f"partition {name} "
        number = (node / "dev").read_text().strip() if (node / "dev").exists() else ""
        uses += [f"{where}mounted at {m.point}" for m in mounts if number and m.majmin == number]
        holders = node / "holders"
        if holders.is_dir():
            uses += [f"{where}held by {h.name}" for h in sorted(holders.iterdir())]
        if f"/dev/{name}" in swaps:
            uses.append(f"{where}used as swap")
    return tuple(uses)


def probe(c: EngineConfig) -> NodeState:
    """Read the node's state: sysfs, /proc/mdstat, blkid, wipefs, /proc/self/mountinfo, /proc/swaps."""
    huge = reserved_hugepages()
    md_available = Path("/proc/mdstat").exists()
    arrays: dict[str, tuple[str, ...]] = {}
    if md_available:
        for line in Path("/proc/mdstat").read_text().splitlines():
            parts = line.split()
            if parts and parts[0].startswith("md") and ":" in parts:
                arrays["/dev/" + parts[0]] = tuple("/dev/" + m.split("[")[0] for m in parts[4:])
    # realpath, once: mdstat, mountinfo and sysfs name the device node, never the by-id symlink.
    resolved = {d: os.path.realpath(d) for d in c.prepare.devices}
    devices = list(dict.fromkeys([*resolved.values(), *arrays]))
    existing = frozenset(d for d in devices if os.path.exists(d))
    mounts_seen = _mountinfo()
    mounts = {m.point: os.path.realpath(m.source) if m.source.startswith("/dev/") else m.source for m in mounts_seen}
    swaps_file = Path("/proc/swaps")
    swaps_lines = swaps_file.read_text().splitlines()[1:] if swaps_file.exists() else []
    swaps = {os.path.realpath(line.split()[0]) for line in swaps_lines if line.split()}
    fs, signatures, in_use = {}, {}, {}
    for dev in sorted(existing):
        # -p probes the device itself: blkid's cache can still describe what a device node held before
        # (a loop device reattached, a disk replaced), which made a fresh disk look formatted.
        out = subprocess.run(["blkid", "-p", "-o", "value", "-s", "TYPE", dev], capture_output=True, text=True)
        fs[dev] = out.stdout.strip()
        signatures[dev] = _signatures(dev)
        in_use[dev] = _in_use(dev, mounts_seen, swaps)
    shares = hugepage_shares(c) if c.prepare.hugepage_size != "none" else {}
    return NodeState(huge, arrays, md_available, fs, mounts, existing, resolved, signatures, in_use, shares,
                     _hugetlbfs_mounts(mounts_seen))  # fmt: skip


def _hugetlbfs_mounts(mounts: list[Mount]) -> dict[str, int]:
    """hugetlbfs mount points and their page bytes (``pagesize=2M``; 2 MiB when it says none)."""
    found = {}
    for m in mounts:
        if m.fstype == "hugetlbfs":
            option = next((o for o in m.options.split(",") if o.startswith("pagesize=")), "pagesize=2M")
            found[m.point] = _size_bytes(option.removeprefix("pagesize="))
    return found


def _size_bytes(text: str) -> int:
    """``2M``, ``1024M``, ``1G`` (as mountinfo writes hugetlbfs page sizes) in bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text and text[-1].upper() in units else int(text)


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
    pool directory (files, manifest), the state directory (journal, epoch), the shared DRAM pool file and its
    hugepage share record.
    The filesystem, the array and the reserved pages stay; idempotent. Returns what was removed."""
    removed = []
    for folder in dict.fromkeys([Path(c.ssd.dir), Path(c.state_dir)]):  # the pool, then its journal's
        if folder.exists():
            shutil.rmtree(folder)
            removed.append(str(folder))
    dram_dirs = [Path(c.dram.shm_dir)] + ([Path(c.dram.hugetlbfs_dir)] if c.dram.hugetlbfs_dir else [])
    for d in dram_dirs:
        path = d / c.dram.name
        if path.exists():
            path.unlink()
            removed.append(str(path))
    if c.prepare.hugepage_size != "none" and release_share(c):
        removed.append(f"the hugepage share of {c.dram.name} (the pages stay reserved)")
    for what in removed:
        log(f"reclaim: removed {what}")
    if not removed:
        log("reclaim: nothing to remove")
    return removed
