from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from flatcake.cli import main
from flatcake.node_agent.config import EngineConfig, PrepareConfig
from flatcake.node_agent.datapath.file_pool import PoolManifest
from flatcake.node_agent.node import prepare as P
from tests.support.engines import small_config


def cfg(tmp: Path, **prep: object) -> EngineConfig:
    base = small_config(tmp)
    mount = str(tmp / "mnt")
    ssd = dataclasses.replace(base.ssd, dir=mount + "/pool") if prep.get("devices") else base.ssd
    return dataclasses.replace(base, ssd=ssd, prepare=PrepareConfig(mount=mount, **{"hugepage_size": "none", **prep}))  # type: ignore[arg-type]


def names(steps: list[P.Step]) -> list[str]:
    return [s.name for s in steps]


@pytest.mark.integration
def test_directory_mode_creates_a_verified_pool_and_is_idempotent(tmp_path: Path) -> None:
    c = cfg(tmp_path)
    steps = P.plan(c, P.probe(c))
    assert names(steps) == ["pool"]
    P.apply(c, steps, log=lambda _: None)
    manifest = PoolManifest.load(Path(c.ssd.dir))
    assert manifest.count == c.ssd.file_count and all(n >= 1 for n in manifest.extents)
    P.apply(c, P.plan(c, P.probe(c)), log=lambda _: None)  # again: nothing breaks, same pool
    assert PoolManifest.load(Path(c.ssd.dir)) == manifest


@pytest.mark.unit
def test_hugepages_are_reserved_only_when_short(tmp_path: Path) -> None:
    c = dataclasses.replace(cfg(tmp_path), prepare=PrepareConfig(hugepage_size="2Mi", hugepages=8))
    assert names(P.plan(c, P.NodeState(hugepages={"2Mi": 0}))) == ["hugepages", "pool"]
    assert names(P.plan(c, P.NodeState(hugepages={"2Mi": 8}))) == ["pool"]
    k = dataclasses.replace(c, prepare=dataclasses.replace(c.prepare, restart_kubelet=True))
    assert names(P.plan(k, P.NodeState(hugepages={"2Mi": 2}))) == ["hugepages", "kubelet", "pool"]
    derived = dataclasses.replace(c, prepare=dataclasses.replace(c.prepare, hugepages=0))
    assert P.wanted_hugepages(derived) == -(-c.dram.bytes // (2 << 20))


@pytest.mark.unit
def test_single_device_gets_xfs_and_a_mount(tmp_path: Path) -> None:
    c = cfg(tmp_path, devices=("/dev/nvme0n1",))
    fresh = P.NodeState(existing_devices=frozenset({"/dev/nvme0n1"}), filesystems={"/dev/nvme0n1": ""})
    steps = P.plan(c, fresh)
    assert names(steps) == ["mkfs", "mkdir", "mount", "pool"]
    assert steps[0].argv == ("mkfs.xfs", "-f", "/dev/nvme0n1")
    ready = dataclasses.replace(fresh, filesystems={"/dev/nvme0n1": "xfs"}, mounts={c.prepare.mount: "/dev/nvme0n1"})
    assert names(P.plan(c, ready)) == ["pool"]  # prepared already: nothing destructive again


@pytest.mark.unit
def test_data_on_a_device_is_never_formatted_without_wipe(tmp_path: Path) -> None:
    c = cfg(tmp_path, devices=("/dev/sdb",))
    state = P.NodeState(existing_devices=frozenset({"/dev/sdb"}), filesystems={"/dev/sdb": "ext4"})
    with pytest.raises(P.PrepareError, match="holds a ext4 filesystem; refusing to format it. Set wipePolicy"):
        P.plan(c, state)
    wipe = cfg(tmp_path, devices=("/dev/sdb",), wipe=True)
    assert P.plan(wipe, state)[0].argv == ("mkfs.xfs", "-f", "/dev/sdb")


@pytest.mark.unit
def test_raid_is_created_once_and_reused(tmp_path: Path) -> None:
    devs = ("/dev/nvme0n1", "/dev/nvme1n1")
    c = cfg(tmp_path, devices=devs)
    state = P.NodeState(existing_devices=frozenset(devs))
    steps = P.plan(c, state)
    assert names(steps) == ["raid", "mkfs", "mkdir", "mount", "pool"]
    assert steps[0].argv == ("mdadm", "--create", "/dev/md/flatcake", "--run", "--level=0", "--chunk=512",
                             "--raid-devices=2", *devs)  # fmt: skip
    assert steps[1].argv == ("mkfs.xfs", "-f", "/dev/md/flatcake")
    existing = dataclasses.replace(state, md_arrays={"/dev/md127": tuple(reversed(devs))},
                                   filesystems={"/dev/md127": "xfs"}, mounts={c.prepare.mount: "/dev/md127"})  # fmt: skip
    assert names(P.plan(c, existing)) == ["pool"]  # found and reused, never recreated
    overlap = dataclasses.replace(state, md_arrays={"/dev/md5": ("/dev/nvme1n1", "/dev/sdz")})
    with pytest.raises(P.PrepareError, match=r"already belong to /dev/md5"):
        P.plan(c, overlap)
    with pytest.raises(P.PrepareError, match="no md driver"):
        P.plan(c, dataclasses.replace(state, md_available=False))


@pytest.mark.unit
def test_errors_name_the_device_and_the_fix(tmp_path: Path) -> None:
    c = cfg(tmp_path, devices=("/dev/nvme9n1",))
    with pytest.raises(P.PrepareError, match=r"devices: \['/dev/nvme9n1'\] do not exist"):
        P.plan(c, P.NodeState())
    busy = P.NodeState(existing_devices=frozenset({"/dev/nvme9n1"}), filesystems={"/dev/nvme9n1": "xfs"},
                       mounts={c.prepare.mount: "/dev/sda1"})  # fmt: skip
    with pytest.raises(P.PrepareError, match="already has /dev/sda1 mounted"):
        P.plan(c, busy)
    failing = [P.Step("mkfs", "test", argv=("false",), device="/dev/nvme9n1")]
    with pytest.raises(P.PrepareError, match=r"mkfs on /dev/nvme9n1 failed \(false\)"):
        P.apply(c, failing, log=lambda _: None)
    with pytest.raises(ValueError, match="must lie under prepare.mount"):
        EngineConfig.from_dict({"ssd": {"dir": "/elsewhere"}, "prepare": {"devices": ["/dev/x"], "mount": "/mnt/fc"}})


@pytest.mark.integration
def test_cli_dry_run_prints_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(cfg(tmp_path).to_dict()))
    assert main(["agent", "prepare", "--config", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("pool: pool") and "single extents checked" in out
    assert not Path(json.loads(path.read_text())["ssd"]["dir"]).exists()  # dry run: nothing created


@pytest.mark.system
def test_real_xfs_on_a_loop_device(tmp_path: Path) -> None:
    """Runs mkfs.xfs and mount for real on a loop device, then builds the pool on XFS."""
    assert os.geteuid() == 0, "needs root for losetup, mkfs.xfs and mount: run bin/test as root (CI does)"
    for tool in ("losetup", "mkfs.xfs", "mount", "umount", "blkid"):
        assert shutil.which(tool), (
            f"{tool} is missing: bin/test installs it (apt-get install xfsprogs mount util-linux)"
        )
    image = tmp_path / "disk.img"
    with open(image, "wb") as f:
        f.truncate(320 << 20)
    loop = subprocess.run(["losetup", "--find", "--show", str(image)], capture_output=True, text=True)
    assert loop.returncode == 0, f"no loop device: {loop.stderr.strip()} (modprobe loop, or run with --privileged)"
    dev = loop.stdout.strip()
    c = cfg(tmp_path, devices=(dev,))
    try:
        steps = P.plan(c, P.probe(c))
        assert names(steps) == ["mkfs", "mkdir", "mount", "pool"]
        P.apply(c, steps, log=lambda _: None)
        assert P.probe(c).mounts.get(c.prepare.mount) == dev
        manifest = PoolManifest.load(Path(c.ssd.dir))
        assert manifest.extents == [1] * c.ssd.file_count  # XFS: one extent per preallocated file
        assert names(P.plan(c, P.probe(c))) == ["pool"]  # idempotent: no second mkfs
    finally:
        subprocess.run(["umount", c.prepare.mount], capture_output=True)
        subprocess.run(["losetup", "-d", dev], capture_output=True)
