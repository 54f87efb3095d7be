"""The storage-bound testbed (loadgen/serve/testbed.py): a loop disk whose reads the kernel's block-I/O
throttle caps, for this process and every process it starts; a process outside is caught."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flatcake.loadgen.serve import testbed as T

MiB = 1 << 20
CALIBRATION = Path(__file__).resolve().parents[3] / "docs" / "results" / "serve-calibration.json"

READ = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT)
buf = mmap.mmap(-1, 1 << 20)
t0 = time.monotonic()
n = 0
while (got := os.preadv(fd, [buf], n)) > 0:
    n += got
print(n / (time.monotonic() - t0))
"""


def read_rate(path: Path) -> float:
    """O_DIRECT read of the whole file in 1 MiB commands, in a child process (so it inherits the
    cgroup of this one): bytes per second."""
    out = subprocess.run([sys.executable, "-c", READ, str(path)], capture_output=True, text=True, check=True)
    return float(out.stdout)


def write_file(path: Path, size: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    buf = mmap.mmap(-1, MiB)
    buf.write(os.urandom(MiB))
    try:
        for i in range(size // MiB):
            os.pwritev(fd, [buf], i * MiB)
    finally:
        os.close(fd)


@pytest.mark.unit
def test_the_read_limit_brings_the_calibrated_shape_to_the_gpu_reference() -> None:
    cal = json.loads(CALIBRATION.read_text())
    lim = T.read_limit(cal, "mha-small-mlp")
    row = next(r for r in cal["here"] if r["where"] == "this machine, mha-small-mlp")
    assert lim["read_bytes_per_s"] == int(row["read_bytes_per_s"] / row["factor"])
    # at that rate a restore costs what the reference's does, next to the prefill it saves
    scaled = row["restore_over_prefill"] * row["read_bytes_per_s"] / lim["read_bytes_per_s"]
    assert scaled == pytest.approx(cal["reference"]["restore_over_prefill"], rel=1e-6)
    with pytest.raises(T.TestbedError, match="not in the calibration"):
        T.read_limit(cal, "no-such-shape")


@pytest.mark.system
def test_a_throttled_read_is_capped_and_an_unthrottled_one_is_not(tmp_path: Path) -> None:
    limit = 8 * MiB
    with T.loop_disk(tmp_path / "disk.img", 256 * MiB, tmp_path / "mnt") as (disk, number):
        data = disk / "pages"
        write_file(data, 24 * MiB)
        free = read_rate(data)
        with T.Throttle(number, limit) as throttle:
            throttle.join()
            assert throttle.holds(os.getpid())
            capped = read_rate(data)
        assert not throttle.holds(os.getpid())  # back where it was once the testbed is gone
    assert capped <= 1.5 * limit, (
        f"throttled read ran at {capped / MiB:.1f} MiB/s against a {limit / MiB:.0f} MiB/s limit"
    )
    assert free > 2 * limit, f"unthrottled read ran at only {free / MiB:.1f} MiB/s"


@pytest.mark.system
def test_verify_names_a_process_that_escaped_the_throttle(tmp_path: Path) -> None:
    with (
        T.loop_disk(tmp_path / "disk.img", 64 * MiB, tmp_path / "mnt") as (_, number),
        T.Throttle(number, 8 * MiB) as throttle,
    ):
        throttle.join()
        inside = subprocess.Popen(["sleep", "60"])
        escaped = subprocess.Popen(["sleep", "61"])
        try:
            assert throttle.holds(inside.pid) and throttle.holds(escaped.pid)  # a fork is born in its parent's cgroup
            assert throttle.verify() >= 2
            assert throttle.path is not None
            (throttle.path.parent / "cgroup.procs").write_text(f"{escaped.pid}\n")  # a baseline started elsewhere
            with pytest.raises(T.TestbedError, match=f"{escaped.pid} \\(sleep 61\\)"):
                throttle.verify()
        finally:
            inside.kill()
            escaped.kill()
            inside.wait()
            escaped.wait()
