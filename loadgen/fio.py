"""The device limit, measured with fio on the same directory the systems use."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any


class FioMissing(RuntimeError):
    pass


def sequential_read_limit(directory: str | Path, jobs: int, size_bytes: int) -> dict[str, Any]:
    """Sequential ``O_DIRECT`` read, 1 MiB blocks, ``jobs`` jobs: the bandwidth a restore can hope for.

    fio writes its files, then reads every byte once, as the systems under test do: reading the same
    bytes again would measure the hypervisor's or controller's cache, not the medium.
    """
    fio = shutil.which("fio")
    if fio is None:
        raise FioMissing("fio is not installed: run `apt-get install fio` (bin/flatcake does it when root)")
    work = Path(tempfile.mkdtemp(prefix="fio-", dir=directory))
    size_mib = max(1, (size_bytes // jobs) >> 20)
    cmd = [
        fio,
        "--name=limit",
        f"--directory={work}",
        f"--size={size_mib}m",
        "--rw=read",
        "--bs=1m",
        "--direct=1",
        "--ioengine=psync",
        f"--numjobs={jobs}",
        "--group_reporting",
        "--output-format=json",
    ]
    try:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"fio failed ({exc.returncode}): {exc.stderr.strip()[-500:]}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    job = json.loads(out[out.index("{") :])["jobs"][0]["read"]
    return {
        "tool": "fio",
        "read_bytes_per_s": float(job["bw_bytes"]),
        "jobs": jobs,
        "block_bytes": 1 << 20,
        "iops": float(job["iops"]),
        "size_bytes": size_mib << 20,
    }
