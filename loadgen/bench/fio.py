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


class SequentialReadLimit:
    """Sequential ``O_DIRECT`` read, ``block_bytes`` blocks (1 MiB unless a benchmark matches its
    system's read size), ``jobs`` jobs: the bandwidth a restore can hope for.

    Shared virtual disks drift by 2x within a minute, and read recently written data faster than older
    data (a write-back cache below the guest). So the limit is measured in ``chunks`` that a benchmark
    interleaves with its own writes and reads (write a turn, lay out a chunk; restore a session, read
    its chunks): fio's bytes are then as fresh as the system's and see the same conditions. Every byte
    is read once, as the systems under test do.
    """

    def __init__(
        self,
        directory: str | Path,
        jobs: int,
        size_bytes: int,
        chunks: int = 1,
        block_bytes: int = 1 << 20,
        iodepth: int = 1,
    ) -> None:
        """``iodepth`` above 1 reads asynchronously (libaio) with that many commands in flight per job: the
        device's ceiling (1 MiB, a deep queue), where 1 reads as the systems do (psync, one a job)."""
        fio = shutil.which("fio")
        if fio is None:
            raise FioMissing("fio is not installed: run `apt-get install fio` (bin/flatcake does it when root)")
        self.jobs, self.chunks, self.block_bytes, self.iodepth = jobs, chunks, block_bytes, iodepth
        self.size_mib = max(1, (size_bytes // (jobs * chunks)) >> 20)  # per job and chunk
        self.work = Path(tempfile.mkdtemp(prefix="fio-", dir=directory))
        self._fio = fio
        self._bytes = 0
        self._seconds = 0.0
        self._iops: list[float] = []

    def _run(self, chunk: int, *extra: str) -> dict[str, Any]:
        where = self.work / str(chunk)
        where.mkdir(exist_ok=True)
        args = [
            self._fio, f"--name=limit{chunk}", f"--directory={where}", f"--size={self.size_mib}m", "--rw=read",
            f"--bs={min(self.block_bytes, self.size_mib << 20)}", "--direct=1",
            *(["--ioengine=psync"] if self.iodepth <= 1 else ["--ioengine=libaio", f"--iodepth={self.iodepth}"]),
            f"--numjobs={self.jobs}", "--group_reporting",
            "--output-format=json", *extra,
        ]  # fmt: skip
        try:
            out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"fio failed ({exc.returncode}): {exc.stderr.strip()[-500:]}") from None
        return dict(json.loads(out[out.index("{") :])["jobs"][0]["read"])

    def prepare(self, chunk: int) -> None:
        """Lay out one chunk's files (writes, not measured)."""
        self._run(chunk, "--create_only=1")

    def measure(self, chunk: int) -> float:
        """Read one chunk; returns its bandwidth and adds it to the total."""
        read = self._run(chunk)
        nbytes = (self.size_mib << 20) * self.jobs
        bw = float(read["bw_bytes"])
        self._bytes += nbytes
        self._seconds += nbytes / bw
        self._iops.append(float(read["iops"]))
        return bw

    def result(self) -> dict[str, Any]:
        return {
            "tool": "fio", "read_bytes_per_s": self._bytes / self._seconds if self._seconds else 0.0,
            "jobs": self.jobs, "block_bytes": self.block_bytes, "iodepth": self.iodepth, "size_bytes": self._bytes,
            "chunks": len(self._iops),
        }  # fmt: skip

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
