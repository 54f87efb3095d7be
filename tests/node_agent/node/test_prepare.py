from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from flatcake.cli import main
from flatcake.node_agent.config import EngineConfig, PrepareConfig
from flatcake.node_agent.datapath.file_pool import PoolManifest
from flatcake.node_agent.node import hugepages as H
from flatcake.node_agent.node import prepare as P
from tests.support.engines import small_config


def cfg(tmp: Path, **prep: object) -> EngineConfig:
    base = small_config(tmp)
    mount = str(tmp / "mnt")
    ssd = dataclasses.replace(base.ssd, dir=mount + "/pool") if prep.get("devices") else base.ssd
    dram = dataclasses.replace(base.dram, huge_pages=prep.get("hugepage_size", "none") != "none")
    return dataclasses.replace(
        base, ssd=ssd, dram=dram, prepare=PrepareConfig(mount=mount, **{"hugepage_size": "none", **prep})
    )  # type: ignore[arg-type]


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
    c = cfg(tmp_path, hugepage_size="2Mi", hugepages=8)
    mine = {c.dram.name: 8}
    # A DRAM pool on tmpfs pages (dram.huge_pages false) needs none: nothing is planned (it reserved them).
    tmpfs = dataclasses.replace(c, dram=dataclasses.replace(c.dram, huge_pages=False))
    assert names(P.plan(tmpfs, P.NodeState(hugepages={"2Mi": 0}))) == ["pool"] and P.wanted_hugepages(tmpfs) == 0
    assert names(P.plan(c, P.NodeState(hugepages={"2Mi": 0}))) == ["hugepages", "pool"]
    assert names(P.plan(c, P.NodeState(hugepages={"2Mi": 8}, hugepage_shares=mine))) == ["pool"]
    assert names(P.plan(c, P.NodeState(hugepages={"2Mi": 8}))) == ["hugepages", "pool"]  # share not recorded yet
    two = P.NodeState(hugepages={"2Mi": 8}, hugepage_shares={**mine, "other-cache": 4})
    assert "reserve 12 pages of 2Mi: 8 for this DRAM pool, 4 for other caches" in P.plan(c, two)[0].why
    k = dataclasses.replace(c, prepare=dataclasses.replace(c.prepare, restart_kubelet=True))
    assert names(P.plan(k, P.NodeState(hugepages={"2Mi": 2}))) == ["hugepages", "kubelet", "pool"]
    derived = dataclasses.replace(c, prepare=dataclasses.replace(c.prepare, hugepages=0))
    assert P.wanted_hugepages(derived) == -(-c.dram.bytes // (2 << 20))


@pytest.mark.unit
def test_a_cache_gets_its_own_hugetlbfs_mount_limited_to_its_pages(tmp_path: Path) -> None:
    """Inference pods mount the cache's own hugetlbfs, never the node's /dev/hugepages with other
    caches' pools: prepare mounts one at dram.hugetlbfs_dir, at most the cache's pages, once."""
    c = cfg(tmp_path, hugepage_size="2Mi", hugepages=8)
    where = str(tmp_path / "run" / "hugepages")
    c = dataclasses.replace(c, dram=dataclasses.replace(c.dram, hugetlbfs_dir=where),
                            agent=dataclasses.replace(c.agent, group="4242"))  # fmt: skip
    reserved = P.NodeState(hugepages={"2Mi": 8}, hugepage_shares={c.dram.name: 8})
    steps = P.plan(c, reserved)
    assert names(steps) == ["mkdir", "hugetlbfs", "pool"]
    assert steps[1].argv == ("mount", "-t", "hugetlbfs", "-o",
                             f"pagesize={2 << 20},size={8 * (2 << 20)},mode=0770,gid=4242", "nodev", where)  # fmt: skip
    mounted = dataclasses.replace(reserved, hugetlbfs={where: 2 << 20}, mounts={where: "nodev"})
    assert names(P.plan(c, mounted)) == ["pool"]  # there already: nothing
    for other, why in ((dataclasses.replace(reserved, hugetlbfs={where: 1 << 30}), "1073741824-byte pages"),
                       (dataclasses.replace(reserved, mounts={where: "/dev/sdz"}), "already has /dev/sdz")):  # fmt: skip
        with pytest.raises(P.PrepareError, match=f"dram.hugetlbfs_dir: {where} .*{why}"):
            P.plan(c, other)
    node_wide = dataclasses.replace(c, dram=dataclasses.replace(c.dram, hugetlbfs_dir=None))
    assert names(P.plan(node_wide, reserved)) == ["pool"]  # no directory named: the node's mounts, as before


@pytest.mark.integration
def test_two_caches_on_a_node_add_their_hugepages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two caches prepare one node (nr_hugepages emulated by a file: the real one is the machine's):
    the count becomes the sum of their shares, not the last one's need, and is never lowered."""
    sysfs = tmp_path / "sys" / "hugepages-{kb}kB" / "nr_hugepages"
    count = Path(str(sysfs).format(kb=2048))
    count.parent.mkdir(parents=True)
    count.write_text("0")
    monkeypatch.setattr(H, "SYSFS_HUGEPAGES", str(sysfs))

    def cache(name: str, pages: int) -> EngineConfig:
        c = cfg(tmp_path / name, hugepage_size="2Mi", hugepages=pages, hugepage_shares_dir=str(tmp_path / "shares"))
        return dataclasses.replace(c, dram=dataclasses.replace(c.dram, name=name))

    def prepare(c: EngineConfig) -> list[str]:
        steps = P.plan(c, P.probe(c))
        P.apply(c, steps, log=lambda _: None)
        return names(steps)

    a, b = cache("a", 100), cache("b", 50)
    assert prepare(a) == ["hugepages", "pool"] and count.read_text() == "100"
    assert prepare(b) == ["hugepages", "pool"] and count.read_text() == "150"  # b's 50 added to a's 100
    assert prepare(a) == ["pool"] and prepare(b) == ["pool"]  # both satisfied: nothing written again
    assert prepare(cache("a", 120)) == ["hugepages", "pool"] and count.read_text() == "170"
    count.write_text("0")  # a reboot (the records on /run go too; here they stay): the first prepare sets the sum
    assert prepare(b) == ["hugepages", "pool"] and count.read_text() == "170"
    count.write_text("1000")  # reserved ahead, more than needed: kept
    assert prepare(cache("c", 10)) == ["hugepages", "pool"] and count.read_text() == "1000"
    assert P.reclaim(b, log=lambda _: None)[-1].startswith("the hugepage share of b")
    assert H.hugepage_shares(a) == {"a": 120, "c": 10} and count.read_text() == "1000"  # pages stay


@pytest.mark.integration
def test_concurrent_caches_reserve_the_sum(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Init containers of several caches run at once after a reboot: the lock makes every share count."""
    sysfs = tmp_path / "hugepages-{kb}kB"
    (tmp_path / "hugepages-2048kB").write_text("0")
    monkeypatch.setattr(H, "SYSFS_HUGEPAGES", str(sysfs))
    base = cfg(tmp_path, hugepage_size="2Mi", hugepage_shares_dir=str(tmp_path / "shares"))
    caches = [dataclasses.replace(base, dram=dataclasses.replace(base.dram, name=f"cache{i}"),
                                  prepare=dataclasses.replace(base.prepare, hugepages=10 + i)) for i in range(8)]  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(len(caches)) as pool:
        list(pool.map(H.reserve_hugepages, caches))
    assert int((tmp_path / "hugepages-2048kB").read_text()) == sum(10 + i for i in range(8))


@pytest.mark.unit
def test_single_device_gets_xfs_and_a_mount(tmp_path: Path) -> None:
    c = cfg(tmp_path, devices=("/dev/nvme0n1",))
    fresh = P.NodeState(existing_devices=frozenset({"/dev/nvme0n1"}), filesystems={"/dev/nvme0n1": ""})
    steps = P.plan(c, fresh)
    assert names(steps) == ["mkfs", "mkdir", "mount", "pool"]
    assert steps[0].argv == ("mkfs.xfs", "/dev/nvme0n1")  # no -f: mkfs.xfs itself refuses a filesystem
    ready = dataclasses.replace(fresh, filesystems={"/dev/nvme0n1": "xfs"}, mounts={c.prepare.mount: "/dev/nvme0n1"})
    assert names(P.plan(c, ready)) == ["pool"]  # prepared already: nothing destructive again


@pytest.mark.unit
def test_data_on_a_device_is_never_formatted_without_wipe(tmp_path: Path) -> None:
    c = cfg(tmp_path, devices=("/dev/sdb",))
    state = P.NodeState(existing_devices=frozenset({"/dev/sdb"}), filesystems={"/dev/sdb": "ext4"})
    with pytest.raises(P.PrepareError, match="/dev/sdb carries ext4; refusing to format over it .wipePolicy: Refuse"):
        P.plan(c, state)
    table = dataclasses.replace(state, filesystems={}, signatures={"/dev/sdb": ("gpt", "PMBR")})
    with pytest.raises(P.PrepareError, match="/dev/sdb carries gpt, PMBR; refusing"):
        P.plan(c, table)  # a partition table alone is data too
    wipe = cfg(tmp_path, devices=("/dev/sdb",), wipe=True)
    steps = P.plan(wipe, state)
    assert [s.argv for s in steps[:2]] == [("wipefs", "--all", "/dev/sdb"), ("mkfs.xfs", "-f", "/dev/sdb")]
    busy = dataclasses.replace(state, in_use={"/dev/sdb": ("partition sdb1 mounted at /data",)})
    with pytest.raises(P.PrepareError, match=r"/dev/sdb is in use \(partition sdb1 mounted at /data\).*any wipePolicy"):
        P.plan(wipe, busy)  # in use: refused even under Wipe


@pytest.mark.unit
def test_raid_members_with_data_are_refused_before_any_step(tmp_path: Path) -> None:
    devs = ("/dev/nvme0n1", "/dev/nvme1n1")
    state = P.NodeState(existing_devices=frozenset(devs), signatures={"/dev/nvme1n1": ("ext4",)})
    with pytest.raises(P.PrepareError, match="/dev/nvme1n1 carries ext4; refusing to create an array over it"):
        P.plan(cfg(tmp_path, devices=devs), state)
    held = dataclasses.replace(state, signatures={}, in_use={"/dev/nvme0n1": ("held by dm-3",)})
    with pytest.raises(P.PrepareError, match=r"/dev/nvme0n1 is in use \(held by dm-3\)"):
        P.plan(cfg(tmp_path, devices=devs, wipe=True), held)
    steps = P.plan(cfg(tmp_path, devices=devs, wipe=True), state)
    assert names(steps)[:3] == ["wipefs", "raid", "mkfs"] and steps[0].device == "/dev/nvme1n1"
    assert steps[2].argv == ("mkfs.xfs", "-f", "/dev/md/flatcake")


@pytest.mark.unit
def test_symlinked_devices_are_matched_by_the_device_they_name(tmp_path: Path) -> None:
    """mdstat and mountinfo name /dev/nvme0n1, the config /dev/disk/by-id/...: compared resolved."""
    link = "/dev/disk/by-id/nvme-X"
    c = cfg(tmp_path, devices=(link,))
    ready = P.NodeState(existing_devices=frozenset({"/dev/nvme0n1"}), resolved={link: "/dev/nvme0n1"},
                        filesystems={"/dev/nvme0n1": "xfs"}, mounts={c.prepare.mount: "/dev/nvme0n1"},
                        in_use={"/dev/nvme0n1": (f"mounted at {c.prepare.mount}",)})  # fmt: skip
    assert names(P.plan(c, ready)) == ["pool"]
    links = ("/dev/disk/by-id/a", "/dev/disk/by-id/b")
    arrays = P.NodeState(existing_devices=frozenset({"/dev/nvme0n1", "/dev/nvme1n1", "/dev/md127"}),
                         resolved=dict(zip(links, ("/dev/nvme0n1", "/dev/nvme1n1"), strict=True)),
                         md_arrays={"/dev/md127": ("/dev/nvme1n1", "/dev/nvme0n1")},
                         filesystems={"/dev/md127": "xfs"})  # fmt: skip
    assert names(P.plan(cfg(tmp_path, devices=links), arrays)) == ["mkdir", "mount", "pool"]  # reused


@pytest.mark.unit
def test_raid_is_created_once_and_reused(tmp_path: Path) -> None:
    devs = ("/dev/nvme0n1", "/dev/nvme1n1")
    c = cfg(tmp_path, devices=devs)
    state = P.NodeState(existing_devices=frozenset(devs))
    steps = P.plan(c, state)
    assert names(steps) == ["raid", "mkfs", "mkdir", "mount", "pool"]
    assert steps[0].argv == ("mdadm", "--create", "/dev/md/flatcake", "--run", "--level=0", "--chunk=512",
                             "--raid-devices=2", *devs)  # fmt: skip
    assert steps[1].argv == ("mkfs.xfs", "/dev/md/flatcake")
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


TOOLS = {"losetup": "mount", "mkfs.xfs": "xfsprogs", "mkfs.ext4": "e2fsprogs", "mount": "mount", "umount": "mount",
         "blkid": "util-linux", "wipefs": "util-linux", "sfdisk": "fdisk"}  # fmt: skip


@pytest.fixture
def loop(tmp_path: Path) -> Iterator[Callable[[], str]]:
    """Makes loop devices over sparse images; unmounts and detaches them afterwards."""
    assert os.geteuid() == 0, "needs root for losetup, mkfs and mount: run bin/test as root (CI does)"
    for tool, package in TOOLS.items():
        assert shutil.which(tool), f"{tool} is missing: bin/test installs it (apt-get install {package})"
    made: list[str] = []

    def make() -> str:
        image = tmp_path / f"disk{len(made)}.img"
        with open(image, "wb") as f:
            f.truncate(320 << 20)
        out = subprocess.run(["losetup", "--find", "--show", str(image)], capture_output=True, text=True)
        assert out.returncode == 0, f"no loop device: {out.stderr.strip()} (modprobe loop, or run with --privileged)"
        made.append(out.stdout.strip())
        return made[-1]

    yield make
    for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
        if str(tmp_path) in line.split()[4]:
            subprocess.run(["umount", line.split()[4]], capture_output=True)
    for dev in made:
        subprocess.run(["losetup", "-d", dev], capture_output=True)


def run(cmd: list[str], stdin: str = "") -> None:
    out = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    assert out.returncode == 0, f"{' '.join(cmd)}: {out.stderr.strip()}"


def prepare_cli(tmp_path: Path, c: EngineConfig, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`flatcake agent prepare` as the init container runs it: exit code and stderr."""
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(c.to_dict()))
    code = main(["agent", "prepare", "--config", str(path)])
    return code, capsys.readouterr().err


@pytest.mark.system
def test_real_xfs_on_a_loop_device(tmp_path: Path, loop: Callable[[], str]) -> None:
    """Runs mkfs.xfs and mount for real on a loop device, then builds the pool on XFS."""
    dev = loop()
    c = cfg(tmp_path, devices=(dev,))
    steps = P.plan(c, P.probe(c))
    assert names(steps) == ["mkfs", "mkdir", "mount", "pool"]
    P.apply(c, steps, log=lambda _: None)
    assert P.probe(c).mounts.get(c.prepare.mount) == dev
    manifest = PoolManifest.load(Path(c.ssd.dir))
    assert manifest.extents == [1] * c.ssd.file_count  # XFS: one extent per preallocated file
    assert names(P.plan(c, P.probe(c))) == ["pool"]  # idempotent: no second mkfs


@pytest.mark.system
def test_a_real_hugetlbfs_mount_for_one_cache(tmp_path: Path) -> None:
    """The mount prepare plans, made for real (root): probe reads its page size back, a second plan is
    empty, and the mount holds no more than the cache's pages."""
    c = cfg(tmp_path, hugepage_size="2Mi", hugepages=2)
    where = tmp_path / "run" / "hugepages"
    c = dataclasses.replace(c, dram=dataclasses.replace(c.dram, hugetlbfs_dir=str(where)))
    state = dataclasses.replace(P.probe(c), hugepages={"2Mi": 2}, hugepage_shares={c.dram.name: 2})
    steps = [s for s in P.plan(c, state) if s.name in ("mkdir", "hugetlbfs")]
    assert names(steps) == ["mkdir", "hugetlbfs"]
    P.apply(c, steps, log=lambda _: None)
    try:
        assert P.probe(c).hugetlbfs.get(str(where)) == 2 << 20
        again = dataclasses.replace(P.probe(c), hugepages={"2Mi": 2}, hugepage_shares={c.dram.name: 2})
        assert names(P.plan(c, again)) == ["pool"]
        assert os.statvfs(where).f_blocks == 2 and stat_mode(where) == 0o700  # at most 2 pages; the agent's
    finally:
        subprocess.run(["umount", str(where)], capture_output=True)


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


@pytest.mark.system
def test_refuse_keeps_partition_tables_filesystems_and_mounted_devices(
    tmp_path: Path, loop: Callable[[], str], capsys: pytest.CaptureFixture[str]
) -> None:
    """wipePolicy Refuse, for real: a disk with only a partition table, one with ext4, one mounted,
    and RAID members one of which holds ext4. Each is refused naming the device and what it carries,
    and keeps it; a mounted device is refused under Wipe too."""
    table, ext4, mounted, blank = loop(), loop(), loop(), loop()
    run(["sfdisk", "--quiet", table], stdin="label: gpt\n,,L\n")
    run(["mkfs.ext4", "-q", ext4])
    run(["mkfs.ext4", "-q", mounted])
    (tmp_path / "busy").mkdir()
    run(["mount", mounted, str(tmp_path / "busy")])
    cases = [
        ((table,), False, f"{table} carries gpt"),
        ((ext4,), False, f"{ext4} carries ext4; refusing to format"),
        ((mounted,), False, f"{mounted} is in use (mounted at {tmp_path / 'busy'})"),
        ((mounted,), True, f"{mounted} is in use (mounted at {tmp_path / 'busy'})"),
        ((blank, ext4), False, f"{ext4} carries ext4; refusing to create an array"),
    ]
    before = {d: P._signatures(d) for d in (table, ext4, mounted, blank)}
    assert before[table][0] == "gpt" and before[ext4] == ("ext4",) and before[blank] == ()
    for devices, wipe, message in cases:
        code, err = prepare_cli(tmp_path, cfg(tmp_path, devices=devices, wipe=wipe), capsys)
        assert code == P.PrepareError.exit_code and message in err, (devices, err)
        assert {d: P._signatures(d) for d in before} == before  # nothing was written anywhere
    assert not (tmp_path / "mnt").exists()  # not even the mount point


@pytest.mark.system
def test_wipe_erases_a_partition_table_then_formats(tmp_path: Path, loop: Callable[[], str]) -> None:
    dev = loop()
    run(["sfdisk", "--quiet", dev], stdin="label: dos\n,,L\n")
    c = cfg(tmp_path, devices=(dev,), wipe=True)
    steps = P.plan(c, P.probe(c))
    assert names(steps) == ["wipefs", "mkfs", "mkdir", "mount", "pool"]
    P.apply(c, steps, log=lambda _: None)
    assert P._signatures(dev) == ("xfs",)
    assert names(P.plan(c, P.probe(c))) == ["pool"]  # then reused, never wiped again


@pytest.mark.system
def test_a_by_id_symlink_prepares_on_every_run(
    tmp_path: Path, loop: Callable[[], str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A /dev/disk/by-id/... style path (a symlink to the device node) run twice: the second run
    finds its own mount (mountinfo names the device node) and changes nothing."""
    dev = loop()
    by_id = tmp_path / "by-id" / "nvme-FLATCAKE_TEST_0001"
    by_id.parent.mkdir()
    by_id.symlink_to(dev)
    c = cfg(tmp_path, devices=(str(by_id),))
    for _ in range(2):
        code, err = prepare_cli(tmp_path, c, capsys)
        assert code == 0, err
    assert names(P.plan(c, P.probe(c))) == ["pool"]
    assert P.probe(c).mounts[c.prepare.mount] == dev
