import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from flatcake.errors import PoolFullError
from flatcake.node_agent.datapath.dram_pool import DramPool, hugetlbfs_mounts
from flatcake.node_agent.datapath.file_pool import MANIFEST, PoolManifest, contiguous_runs, count_extents, create_pool
from flatcake.node_agent.policy.slots import SlotAllocator


@pytest.mark.unit
def test_slot_allocator_is_exact_and_refuses_double_free() -> None:
    a = SlotAllocator(4)
    got = a.alloc(3)
    assert sorted(got) == [0, 1, 2] and a.free == 1
    with pytest.raises(PoolFullError):
        a.alloc(2)
    assert a.free == 1  # a failed alloc takes nothing
    a.release([got[0]])
    with pytest.raises(ValueError, match="double free"):
        a.release([got[0]])
    assert a.free == 2


@pytest.mark.integration
def test_dram_pool_is_a_shared_file_other_processes_can_map(tmp_path: Path) -> None:
    pool = DramPool(8192, 4, name="t-shared", want_huge_pages=False, shm_dir=str(tmp_path))
    try:
        pool.slot(2)[:5] = np.frombuffer(b"hello", np.uint8)
        data = Path(pool.info.path).read_bytes()
        assert data[2 * 8192 : 2 * 8192 + 5] == b"hello"
        assert pool.info.nbytes == 4 * 8192 and not pool.info.huge_pages
    finally:
        pool.close(unlink=True)
    assert not Path(pool.info.path).exists()


@pytest.mark.integration
def test_dram_pool_falls_back_with_a_reason(tmp_path: Path) -> None:
    empty = tmp_path / "mounts"
    empty.write_text("proc /proc proc rw 0 0\n")
    assert hugetlbfs_mounts(mounts=str(empty)) == []
    pool = DramPool(
        4096,
        2,
        name="t-fallback",
        want_huge_pages=True,
        shm_dir=str(tmp_path),
        hugetlbfs_dir=str(tmp_path / "no-such-mount"),
    )
    try:
        assert not pool.info.huge_pages and pool.info.fallback_reason
    finally:
        pool.close(unlink=True)


@pytest.mark.system
def test_dram_pool_on_real_huge_pages(tmp_path: Path) -> None:
    """Reserves two 2 MiB pages through sysfs, mounts hugetlbfs, maps the pool there, then releases."""
    nr = Path("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages")
    assert os.geteuid() == 0, "needs root to reserve huge pages: run bin/test as root (CI does)"
    assert nr.exists(), f"{nr} is missing: this kernel offers no 2 MiB huge pages"
    before = int(nr.read_text())
    mnt = tmp_path / "huge"
    mnt.mkdir()
    nr.write_text(str(before + 2))
    mounted = subprocess.run(
        ["mount", "-t", "hugetlbfs", "-o", "pagesize=2M", "none", str(mnt)], capture_output=True, text=True
    )
    try:
        assert mounted.returncode == 0, f"cannot mount hugetlbfs: {mounted.stderr.strip()}"
        assert mnt in hugetlbfs_mounts()
        pool = DramPool(1 << 20, 4, name="t-huge", want_huge_pages=True, hugetlbfs_dir=str(mnt))
        try:
            assert pool.info.huge_pages and pool.info.nbytes == 4 << 20
            pool.slot(3)[:] = 7
            assert int(pool.view.sum()) == 7 << 20
        finally:
            pool.close(unlink=True)
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", str(mnt)], check=False)
        nr.write_text(str(before))


@pytest.mark.integration
def test_file_pool_is_preallocated_contiguous_and_idempotent(tmp_path: Path) -> None:
    ticks: list[tuple[int, int]] = []
    m = create_pool(tmp_path, 3, 1 << 20, progress=lambda i, n: ticks.append((i, n)))
    assert ticks[-1] == (3, 3)
    assert m.count == 3 and m.total_bytes == 3 << 20
    for name, runs in zip(m.files, m.extents, strict=True):
        path = tmp_path / name
        assert path.stat().st_size == 1 << 20
        assert path.stat().st_blocks * 512 >= 1 << 20  # really allocated, not sparse
        assert runs == count_extents(path) >= 1
    assert PoolManifest.load(tmp_path) == m
    assert create_pool(tmp_path, 3, 1 << 20).files == m.files
    with pytest.raises(ValueError, match="existing pool has 3 files"):
        create_pool(tmp_path, 4, 1 << 20)
    with pytest.raises(ValueError, match="file_bytes"):
        create_pool(tmp_path / "x", 1, 1000)
    (tmp_path / MANIFEST).write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        PoolManifest.load(tmp_path)


@pytest.mark.unit
def test_contiguous_runs_merges_adjacent_extent_records() -> None:
    assert contiguous_runs([]) == 0
    assert contiguous_runs([(0, 1000, 10), (10, 1010, 5)]) == 1  # ext4 splits long extents in records
    assert contiguous_runs([(0, 1000, 10), (10, 5000, 5)]) == 2


@pytest.mark.integration
def test_refuse_policy_on_a_fragmented_file(tmp_path: Path) -> None:
    # A pool file of the right size whose every other block is a hole: its extents are discontiguous
    # on any filesystem with sparse files, so the refusal is checked deterministically.
    a = tmp_path / "pool-00000.dat"
    with open(a, "wb") as f:
        f.truncate(64 * 4096)
        for block in range(0, 64, 2):
            os.pwrite(f.fileno(), b"x" * 4096, block * 4096)
        os.fsync(f.fileno())
    runs = count_extents(a)
    assert runs > 1, "the sparse file should have several extents"
    from flatcake.node_agent.datapath.file_pool import ExtentError

    # The file already has the pool's size, so create_pool keeps it as it is (no fallocate fills the holes).
    with pytest.raises(ExtentError, match=rf"{runs} discontiguous extents.*extent_policy"):
        create_pool(tmp_path, 1, 64 * 4096, extent_policy="refuse")
