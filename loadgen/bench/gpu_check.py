"""``bin/gpu-check``: the device check of the GPU data path, on a machine with one NVIDIA GPU.

Through the real engine it fills a pool on local disk (one set of pages placed on SSD, one in the
pinned DRAM pool), restores each set into HBM (SSD pages through kvikio: GDS, or kvikio's compat mode
when GDS is absent; DRAM pages by H2D copies from the pinned pool), checks a checksum of every page
in HBM, and reads the same bytes once more with a plain sequential kvikio read as the device's limit.
It prints one JSON object (restore GB/s, raw GB/s, their ratio, time to first layer, peak staging
bytes, kvikio's mode); progress goes to stderr.

``--dry-run`` prints the device plan, then runs the same steps at a small size on the CPU: the engine's
host path (O_DIRECT into numpy), a plain O_DIRECT read as the limit, and the same JSON. CI runs it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from flatcake.errors import ConfigError
from flatcake.loadgen.models import DEFAULT, preset
from flatcake.node_agent import DramConfig, Engine, EngineConfig, Hints, IOConfig, SsdConfig, aligned_empty
from flatcake.node_agent.datapath.buffers import round_up
from flatcake.node_agent.datapath.file_pool import open_direct

MiB, GiB = 1 << 20, 1 << 30
DEVICE_GIB = 2.0  # bytes restored into HBM per path (the issue asks for at least 2 GiB)
DRY_RUN_MIB = 24  # the CPU rehearsal: same steps, a size the 2-core CI machine does in seconds
RAW_CHUNK = 64 * MiB
BUDGET_S = 8 * 60  # the whole check, installs included, must end within this


@dataclass(frozen=True)
class Plan:
    """Geometry and sizes of one check; everything else follows from these."""

    model: str
    layers: int
    page_bytes: int
    pages: int  # per path: this many pages go to SSD, as many to DRAM
    pages_per_put: int  # one put (one scope, contiguous on disk) per this many pages
    file_bytes: int
    file_count: int
    dram_bytes: int
    workers: int
    staging_layers: int
    staging_slot_bytes: int
    directory: str

    @property
    def page_set_bytes(self) -> int:
        """Bytes one page takes in every layer."""
        return self.layers * self.page_bytes

    @property
    def path_bytes(self) -> int:
        """Bytes restored into device memory by each path."""
        return self.pages * self.page_set_bytes

    def engine_config(self, backend: str, pinned: bool) -> EngineConfig:
        d = Path(self.directory)
        return EngineConfig(
            layers=self.layers,
            page_bytes=self.page_bytes,
            dram=DramConfig(
                bytes=self.dram_bytes,
                huge_pages=False,
                shm_dir="/dev/shm",
                pinned=pinned,
                name=f"flatcake-gpu-check-{os.getpid()}",
            ),
            ssd=SsdConfig(dir=str(d / "pool"), file_bytes=self.file_bytes, file_count=self.file_count),
            io=IOConfig(
                backend=backend,
                workers=self.workers,
                staging_layers=self.staging_layers,
                staging_slot_bytes=self.staging_slot_bytes,
                streams=1,
            ),
        )

    def describe(self) -> list[str]:
        b = self.path_bytes
        return [
            f"geometry: {self.model}, {self.layers} layers x {self.page_bytes} B per page-layer",
            f"fill: {self.pages} pages on SSD (one-shot) and {self.pages} in DRAM (shared prompt), "
            f"{self.pages_per_put} pages per put, {b / GiB:.2f} GiB each, through the engine",
            f"pool: {self.file_count} files x {self.file_bytes / MiB:.0f} MiB in {self.directory}/pool; "
            f"DRAM {self.dram_bytes / MiB:.0f} MiB in /dev/shm; raw copy {b / GiB:.2f} GiB in {self.directory}/raw.bin",
            f"restore 1: the SSD pages into device memory ({self.workers} workers, staging "
            f"{self.staging_layers} x {self.staging_slot_bytes / MiB:.0f} MiB), time to first layer and GB/s",
            "check: a checksum of every page-layer in device memory against the one computed at fill",
            "restore 1 again, the page cache dropped once more: file handles and kvikio's buffers now open",
            f"raw: one sequential read of the same {b / GiB:.2f} GiB from raw.bin into device memory",
            "restore 2: the DRAM pages into device memory (pinned pool, H2D), checked the same way",
        ]


def make_plan(target_bytes: int, directory: Path, model: str = DEFAULT, workers: int = 4) -> Plan:
    """Pages enough for ``target_bytes`` per path; pool files hold a put each and stay under the low
    watermark, so nothing is reclaimed while the check runs."""
    if target_bytes <= 0:
        raise ConfigError(f"--gib: {target_bytes} bytes; give a positive size")
    if workers < 1:
        raise ConfigError(f"--workers: {workers} must be >= 1")
    m = preset(model)
    layers, page_bytes = m.layers, m.page_layer_bytes
    pages = math.ceil(target_bytes / (layers * page_bytes))
    per_put = max(1, min(64, pages // 4))
    put_bytes = per_put * layers * page_bytes
    file_bytes = round_up(max(2 * put_bytes, 256 * MiB if pages > 256 else 0))
    needed = pages * layers * page_bytes
    file_count = math.ceil(needed / (0.7 * file_bytes)) + 1  # low watermark 0.8: room for every put
    dram_bytes = round_up((pages + 1) * layers * page_bytes, MiB)
    slot = 8 * MiB if pages > 256 else round_up(per_put * page_bytes)  # the engine's default; one put-layer
    return Plan(model, layers, page_bytes, pages, per_put, file_bytes, file_count, dram_bytes, workers, 2, slot,
                str(directory))  # fmt: skip


class Device(Protocol):
    """Where restores land: the GPU (cupy, kvikio) or, for the dry run, host memory (numpy, O_DIRECT)."""

    @property
    def name(self) -> str: ...
    @property
    def backend(self) -> str: ...  # the engine's io.backend
    @property
    def pinned(self) -> bool: ...  # dram.pinned
    @property
    def xp(self) -> Any: ...  # numpy or cupy

    def empty(self, shape: tuple[int, ...]) -> Any: ...
    def synchronize(self) -> None: ...
    def raw_read(self, path: Path, dest: Any, nbytes: int) -> None: ...
    def to_host(self, array: Any) -> npt.NDArray[Any]: ...
    def mode(self, engine: Engine) -> dict[str, Any]: ...


class HostDevice:
    name = "cpu (dry run: no GPU used)"
    backend = "posix"
    pinned = False
    xp = np

    def empty(self, shape: tuple[int, ...]) -> Any:
        return aligned_empty(shape)

    def synchronize(self) -> None:
        pass

    def raw_read(self, path: Path, dest: Any, nbytes: int) -> None:
        view = memoryview(dest.reshape(-1)).cast("B")
        fd = open_direct(path)
        try:
            for at in range(0, nbytes, RAW_CHUNK):
                n = min(RAW_CHUNK, nbytes - at)
                if os.preadv(fd, [view[at : at + n]], at) != n:
                    raise OSError(f"{path}: short read at {at}")
        finally:
            os.close(fd)

    def to_host(self, array: Any) -> npt.NDArray[Any]:
        return np.asarray(array)

    def mode(self, engine: Engine) -> dict[str, Any]:
        return {"kvikio_mode": "none (dry run: posix O_DIRECT)", "gds_available": None, "io_backend": engine.io.name}


class CudaDevice:
    backend = "kvikio"
    pinned = True

    def __init__(self) -> None:
        import cupy
        import kvikio

        self.xp, self._kvikio = cupy, kvikio
        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        memory = props["totalGlobalMem"] / GiB
        self.name = f"{name} ({memory:.0f} GiB), cupy {cupy.__version__}, kvikio {kvikio.__version__}"

    def empty(self, shape: tuple[int, ...]) -> Any:
        return self.xp.empty(shape, dtype=self.xp.uint8)

    def synchronize(self) -> None:
        self.xp.cuda.runtime.deviceSynchronize()

    def raw_read(self, path: Path, dest: Any, nbytes: int) -> None:
        # One read call: kvikio splits it into task_size pieces on its thread pool (sized by the engine).
        with self._kvikio.CuFile(str(path), "r") as f:
            got = int(f.read(dest.reshape(-1)[:nbytes], nbytes, 0))
        if got != nbytes:
            raise OSError(f"{path}: kvikio read {got} of {nbytes} bytes")

    def to_host(self, array: Any) -> npt.NDArray[Any]:
        return np.asarray(array.get())

    def mode(self, engine: Engine) -> dict[str, Any]:
        gds = getattr(engine.io, "gds_available", None)
        return {"kvikio_mode": getattr(engine.io, "mode", "unknown"), "gds_available": gds,
                "io_backend": engine.io.name}  # fmt: skip


def checksums(xp: Any, kv: Any) -> Any:
    """One position-weighted sum of 64-bit words per page-layer (``[layers][pages]``): a moved, swapped or
    torn page changes it. Computed by ``xp`` (numpy or cupy) where the bytes are, layer by layer."""
    layers, pages, page_bytes = kv.shape
    weights = xp.arange(1, page_bytes // 8 + 1, dtype=xp.uint64)
    out = xp.empty((layers, pages), dtype=xp.uint64)
    for layer in range(layers):
        words = kv[layer].reshape(pages, page_bytes).view(xp.uint64)
        out[layer] = (words * weights).sum(axis=1, dtype=xp.uint64)
    return out


def _page_buffers(plan: Plan, first_id: int) -> Any:
    """``(index, kv)`` for every put: random bytes, each page-layer stamped with a unique id."""
    rng = np.random.default_rng(first_id)
    base = rng.integers(0, 256, size=(plan.layers, plan.pages_per_put, plan.page_bytes), dtype=np.uint8)
    for lo in range(0, plan.pages, plan.pages_per_put):
        n = min(plan.pages_per_put, plan.pages - lo)
        kv = aligned_empty((plan.layers, n, plan.page_bytes))
        kv[...] = base[:, :n]
        ids = (first_id + lo + np.arange(n, dtype=np.uint64))[None, :] * np.uint64(plan.layers)
        ids = ids + np.arange(plan.layers, dtype=np.uint64)[:, None] + np.uint64(1)
        kv[:, :, :8] = ids.view(np.uint8).reshape(plan.layers, n, 8)
        yield lo, kv


class Progress:
    def __init__(self, log: Callable[[str], None]) -> None:
        self.t0, self._log = time.perf_counter(), log

    def __call__(self, message: str) -> None:
        self._log(f"[{time.perf_counter() - self.t0:6.1f}s] {message}")

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def _drop_cache(paths: Sequence[Path]) -> None:
    """Evict the files from the page cache (kvikio's compat mode may read through it)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _restore(engine: Engine, device: Device, keys: list[str], dest: Any, expected: npt.NDArray[np.uint64],
             before: dict[str, int]) -> dict[str, Any]:  # fmt: skip
    t0 = time.perf_counter()
    first = 0.0
    with engine.get(keys, dest) as restore:
        for layer in restore:
            if layer == 0:
                first = time.perf_counter() - t0
        missing = sorted(restore.missing)
        peak = restore.staging_peak_bytes
    device.synchronize()
    seconds = time.perf_counter() - t0
    got = device.to_host(checksums(device.xp, dest))
    bad = np.flatnonzero((got != expected).any(axis=0))
    stats = engine.stats.snapshot()
    nbytes = int(dest.nbytes)
    return {
        "bytes": nbytes,
        "seconds": round(seconds, 4),
        "gb_per_s": round(nbytes / seconds / 1e9, 3),
        "time_to_first_layer_s": round(first, 4),
        "staging_peak_bytes": int(peak),
        "pages": len(keys),
        "pages_missing": len(missing),
        "pages_bad_checksum": len(bad),
        "served_from": {
            m: stats.get(f"restore_pages_{m}", 0) - before.get(f"restore_pages_{m}", 0) for m in ("dram", "ssd")
        },
    }


def run(plan: Plan, device: Device, log: Callable[[str], None], dry_run: bool) -> dict[str, Any]:
    progress = Progress(log)
    d = Path(plan.directory)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    free = shutil.disk_usage(d).free
    if free < 2 * plan.path_bytes + plan.file_bytes:
        raise ConfigError(f"--dir: {d} has {free / GiB:.1f} GiB free; the check writes "
                          f"{2 * plan.path_bytes / GiB:.1f} GiB there; free space or lower --gib")  # fmt: skip
    raw = d / "raw.bin"
    try:
        with Engine(plan.engine_config(device.backend, device.pinned)) as engine:
            mode = device.mode(engine)
            progress(
                f"engine up: I/O {engine.io.name}, {mode['kvikio_mode']}; filling {2 * plan.path_bytes / GiB:.2f} GiB"
            )
            expected: dict[str, npt.NDArray[np.uint64]] = {}
            fd = os.open(raw, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
            try:
                for name, first_id, hint in (("ssd", 0, Hints(turn=1)), ("dram", plan.pages, Hints(prefix_refcount=2))):
                    sums = np.empty((plan.layers, plan.pages), np.uint64)
                    for lo, kv in _page_buffers(plan, first_id):
                        engine.put([f"{name}-{lo + j}" for j in range(kv.shape[1])], kv, hint)
                        sums[:, lo : lo + kv.shape[1]] = checksums(np, kv)
                        if name == "ssd":  # the raw copy: the same bytes, in the order they were put
                            os.pwritev(fd, [memoryview(kv).cast("B")], lo * plan.page_set_bytes)
                    expected[name] = sums
                    progress(f"filled {plan.pages} {name} pages")
                os.fsync(fd)
            finally:
                os.close(fd)
            pool = sorted((d / "pool").glob("*"))
            dest = device.empty((plan.layers, plan.pages, plan.page_bytes))
            # Warm-up, untimed: the scatter kernel's first compile, the staging window's allocation (and its
            # cuFile registration in GDS mode) happen once per process, not per restore.
            with engine.get(["ssd-0", "dram-0"], device.empty((plan.layers, 2, plan.page_bytes))) as warm:
                warm.run()
            device.synchronize()

            _drop_cache([*pool, raw])
            before = engine.stats.snapshot()
            ssd = _restore(engine, device, [f"ssd-{i}" for i in range(plan.pages)], dest, expected["ssd"], before)
            progress(f"restore from SSD: {ssd['gb_per_s']} GB/s, first layer after {ssd['time_to_first_layer_s']} s, "
                     f"{ssd['pages_bad_checksum']} bad pages")  # fmt: skip
            # Once more, cache dropped again: the first restore opened each worker's file handles (and, in
            # kvikio's compat mode, its bounce buffers) as it touched them; an agent keeps both open.
            _drop_cache(pool)
            before = engine.stats.snapshot()
            again = _restore(engine, device, [f"ssd-{i}" for i in range(plan.pages)], dest, expected["ssd"], before)
            progress(f"again, handles open: {again['gb_per_s']} GB/s, first layer after "
                     f"{again['time_to_first_layer_s']} s, {again['pages_bad_checksum']} bad pages")  # fmt: skip

            _drop_cache([raw])
            t0 = time.perf_counter()
            device.raw_read(raw, dest, plan.path_bytes)
            device.synchronize()
            raw_s = time.perf_counter() - t0
            raw_gbps = plan.path_bytes / raw_s / 1e9
            progress(f"raw sequential read: {raw_gbps:.3f} GB/s")

            before = engine.stats.snapshot()
            dram = _restore(engine, device, [f"dram-{i}" for i in range(plan.pages)], dest, expected["dram"], before)
            progress(f"restore from pinned DRAM: {dram['gb_per_s']} GB/s, {dram['pages_bad_checksum']} bad pages")
            engine_io = engine.io.name
            placed_ok = all(p["served_from"]["ssd"] == plan.pages for p in (ssd, again))
            placed_ok = placed_ok and dram["served_from"]["dram"] == plan.pages
    finally:
        shutil.rmtree(d, ignore_errors=True)
    ok = placed_ok and all(p["pages_bad_checksum"] == 0 and p["pages_missing"] == 0 for p in (ssd, again, dram))
    layer0 = plan.path_bytes / plan.layers
    return {
        "ok": ok,
        "dry_run": dry_run,
        "device": device.name,
        **mode,
        "restore_gb_per_s": ssd["gb_per_s"],
        "raw_read_gb_per_s": round(raw_gbps, 3),
        "restore_vs_raw": round(ssd["gb_per_s"] / raw_gbps, 3),
        "time_to_first_layer_s": ssd["time_to_first_layer_s"],
        "first_layer_at_raw_s": round(layer0 / (raw_gbps * 1e9), 4),  # layer 0's bytes at the raw read's rate
        "staging_peak_bytes": ssd["staging_peak_bytes"],
        "paths": {"ssd": {**ssd, "via": engine_io}, "ssd_again": {**again, "via": engine_io}, "pinned_dram": dram},
        "raw_read": {
            "bytes": plan.path_bytes,
            "seconds": round(raw_s, 4),
            "via": "kvikio CuFile.read" if not dry_run else "O_DIRECT preadv",
        },
        "placement_as_planned": placed_ok,
        "plan": asdict(plan),
        "elapsed_s": round(progress.elapsed, 2),
        "budget_s": BUDGET_S,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bin/gpu-check", description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="print the plan, then rehearse it on the CPU (no GPU)")
    p.add_argument("--gib", type=float, default=DEVICE_GIB, help="GiB restored into HBM per path")
    p.add_argument("--dir", default=".flatcake-bench/gpu-check", help="scratch directory on the local disk")
    p.add_argument("--model", default=DEFAULT, help="model preset giving the page geometry")
    p.add_argument("--workers", type=int, default=4, help="I/O workers (parallel reads per restore)")
    p.add_argument("--json", metavar="PATH", help="also write the JSON here")
    args = p.parse_args(argv)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        plan = make_plan(int(args.gib * GiB), Path(args.dir), args.model, args.workers)
        device: Device
        if args.dry_run:
            log("gpu-check plan (on a GPU machine):")
            for line in plan.describe():
                log(f"  - {line}")
            plan = make_plan(DRY_RUN_MIB * MiB, Path(args.dir), args.model, args.workers)
            log(f"dry run: the same steps at {plan.path_bytes / MiB:.0f} MiB per path on the CPU")
            device = HostDevice()
        else:
            device = _cuda_device()
            for line in plan.describe():
                log(f"  - {line}")
        report = run(plan, device, log, args.dry_run)
    except ConfigError as exc:
        log(f"gpu-check: {exc}")
        return 2
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if report["ok"] else 1


def _cuda_device() -> Device:
    try:
        import cupy

        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # ImportError, or no driver / no device
        raise ConfigError(f"no usable GPU ({exc.__class__.__name__}: {exc}); run bin/gpu-check --dry-run on a "
                          "machine without one, or install the driver and requirements/gpu.txt") from None  # fmt: skip
    if count < 1:
        raise ConfigError("no CUDA device visible (CUDA_VISIBLE_DEVICES?); bin/gpu-check needs one GPU")
    return CudaDevice()


if __name__ == "__main__":
    sys.exit(main())
