"""``bin/gpu-check``: the plan, the checksum and kvikio's reported mode on the CPU, and ``--dry-run`` end to
end through the wrapper (no GPU, no network: CI runs it). The device run itself needs a GPU and has not
run here; nothing GPU-only is claimed tested."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest

from flatcake.loadgen.bench import gpu_check as gc
from flatcake.node_agent import ConfigError
from flatcake.node_agent.datapath.io_backends import kvikio_mode, set_kvikio_threads

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.unit
def test_the_device_plan_restores_at_least_2_gib_per_path_without_reclaim(tmp_path: Path) -> None:
    plan = gc.make_plan(int(gc.DEVICE_GIB * gc.GiB), tmp_path)
    assert plan.path_bytes >= 2 * gc.GiB
    put = plan.pages_per_put * plan.page_set_bytes
    assert plan.file_bytes >= put and plan.file_bytes % 4096 == 0  # a put's scope fits one file
    # Every put fits below the SSD pool's low watermark: no scope is reclaimed during the check.
    assert plan.path_bytes + put <= 0.8 * plan.file_bytes * plan.file_count
    assert plan.dram_bytes >= plan.path_bytes + plan.page_set_bytes
    config = plan.engine_config("kvikio", True)
    assert config.dram_slots >= plan.pages and config.io.backend == "kvikio" and config.dram.pinned
    assert any("2.00 GiB" in line for line in plan.describe())
    with pytest.raises(ConfigError, match="--gib"):
        gc.make_plan(0, tmp_path)


@pytest.mark.unit
def test_the_checksum_catches_a_swapped_page_and_a_changed_byte() -> None:
    kv = np.random.default_rng(1).integers(0, 256, size=(3, 4, 4096), dtype=np.uint8)
    want = gc.checksums(np, kv)
    swapped = kv.copy()
    swapped[1, [0, 1]] = swapped[1, [1, 0]]
    assert (gc.checksums(np, swapped) != want).sum() == 2
    torn = kv.copy()
    torn[2, 3, 4000] ^= 1
    assert (gc.checksums(np, torn) != want).tolist() == [[False] * 4, [False] * 4, [False, False, False, True]]
    words = np.zeros((1, 1, 4096), np.uint8)
    words[0, 0, :16] = np.array([1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0], np.uint8)
    moved = np.zeros_like(words)
    moved[0, 0, :16] = np.array([2, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0], np.uint8)
    assert gc.checksums(np, words) != gc.checksums(np, moved)  # same words, other places: a plain sum would agree


@pytest.mark.unit
def test_kvikio_mode_is_what_kvikio_resolves_in_each_api_generation() -> None:
    def new(compat: bool) -> SimpleNamespace:  # kvikio 25.06+: AUTO resolved against the cuFile driver
        return SimpleNamespace(defaults=SimpleNamespace(is_compat_mode_preferred=lambda: compat))

    assert kvikio_mode(new(True)) == "compat" and kvikio_mode(new(False)) == "gds"
    assert kvikio_mode(SimpleNamespace(defaults=SimpleNamespace(compat_mode=lambda: True))) == "compat"  # 24.10
    on, auto = SimpleNamespace(name="ON"), SimpleNamespace(name="AUTO")  # 24.12-25.02: CompatMode
    assert kvikio_mode(SimpleNamespace(defaults=SimpleNamespace(compat_mode=lambda: on))) == "compat"
    assert kvikio_mode(SimpleNamespace(defaults=SimpleNamespace(compat_mode=lambda: auto))) == "auto (unresolved)"


@pytest.mark.unit
def test_kvikio_submodules_that_import_kvikio_leaves_unbound_are_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvikio 26.10's ``import kvikio`` binds no ``defaults``: the first H200 run failed on the attribute."""
    package = ModuleType("fake_kvikio_2610")
    package.__path__ = []  # a package, as kvikio is
    defaults = ModuleType("fake_kvikio_2610.defaults")
    calls: list[tuple[str, int]] = []
    defaults.set = lambda key, value: calls.append((key, value))  # type: ignore[attr-defined]
    defaults.is_compat_mode_preferred = lambda: False  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, package.__name__, package)
    monkeypatch.setitem(sys.modules, defaults.__name__, defaults)
    assert not hasattr(package, "defaults")
    set_kvikio_threads(package, 8)
    assert calls == [("num_threads", 8)] and kvikio_mode(package) == "gds"


@pytest.mark.integration
def test_dry_run_prints_the_plan_and_rehearses_it_on_the_cpu(tmp_path: Path) -> None:
    # The checkout itself must not be on the path: its top-level `operator` package would shadow the
    # standard library's (the script imports the package from its own link tree).
    path = [p for p in sys.path if p and Path(p).resolve() != ROOT.resolve()]
    env = {**os.environ, "FLATCAKE_PYTHON": sys.executable, "PYTHONPATH": os.pathsep.join(path)}
    out = tmp_path / "report.json"
    done = subprocess.run(["bash", str(ROOT / "bin" / "gpu-check"), "--dry-run", "--dir", str(tmp_path / "scratch"),
                           "--json", str(out)], capture_output=True, text=True, env=env, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "installing" not in done.stderr  # a dry run installs nothing
    assert "gpu-check plan (on a GPU machine):" in done.stderr and "2.00 GiB each" in done.stderr
    report = json.loads(done.stdout)
    assert report == json.loads(out.read_text())
    assert report["ok"] and report["dry_run"] and report["placement_as_planned"]
    for key in ("restore_gb_per_s", "raw_read_gb_per_s", "restore_vs_raw", "time_to_first_layer_s",
                "staging_peak_bytes", "kvikio_mode", "gds_available"):  # fmt: skip
        assert key in report, key
    ssd, again, dram = report["paths"]["ssd"], report["paths"]["ssd_again"], report["paths"]["pinned_dram"]
    assert again["served_from"] == ssd["served_from"] and again["pages_bad_checksum"] == again["pages_missing"] == 0
    pages = report["plan"]["pages"]
    assert ssd["served_from"] == {"ssd": pages, "dram": 0} and dram["served_from"] == {"dram": pages, "ssd": 0}
    assert ssd["pages_bad_checksum"] == dram["pages_bad_checksum"] == 0
    assert ssd["staging_peak_bytes"] == 0  # the CPU rehearsal reads into host memory in place: nothing staged
    assert 0 < report["time_to_first_layer_s"] < ssd["seconds"]
    assert report["restore_vs_raw"] == pytest.approx(report["restore_gb_per_s"] / report["raw_read_gb_per_s"], rel=0.01)
    assert not (tmp_path / "scratch").exists()  # scratch removed


@pytest.mark.unit
def test_without_cuda_the_device_run_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy fails, as where the wheels are missing
    assert gc.main(["--dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "no usable GPU" in err and "--dry-run" in err and "requirements/gpu.txt" in err
    assert not (tmp_path / "x").exists()  # nothing written before the device was found


FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for the device machine's python: cupy of CUDA $FAKE_CUDA (none when empty), no kvikio.
case "$*" in
  "-c import cupy, kvikio") exit 1 ;;
  "-c import cupy; print"*) [ -n "$FAKE_CUDA" ] && echo "$FAKE_CUDA" && exit 0; exit 1 ;;
  "-m pip install"*)
    all="$*"; echo "pip ${all%% -r *}" >> "$LOG"; while [ $# -gt 0 ]; do [ "$1" = -r ] && cp "$2" "$LOG.req"; shift; done ;;
  "-m flatcake.loadgen.bench.gpu_check"*) echo "check $*" >> "$LOG" ;;
  *) exec "$REAL_PYTHON" "$@" ;;
esac
"""


@pytest.mark.integration
@pytest.mark.parametrize(("cuda", "wanted"), [
    ("13", ["kvikio-cu13==26.10.0", "libkvikio-cu13==26.10.0", "rapids-logger==0.3.0"]),
    ("12", ["kvikio-cu12==26.10.0", "libkvikio-cu12==26.10.0", "rapids-logger==0.3.0"]),
    ("", None),  # no cupy: requirements/gpu.txt whole
])  # fmt: skip
def test_the_wrapper_installs_kvikio_for_the_installed_cupy_or_the_whole_cuda_12_closure(
    tmp_path: Path, cuda: str, wanted: list[str] | None
) -> None:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "log"
    env = {**os.environ, "FLATCAKE_PYTHON": str(fake), "REAL_PYTHON": sys.executable, "FAKE_CUDA": cuda,
           "LOG": str(log), "FLATCAKE_WHEELS": str(tmp_path / "wheels")}  # fmt: skip
    done = subprocess.run(["bash", str(ROOT / "bin" / "gpu-check"), "--gib", "2"], capture_output=True, text=True,
                          env=env, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    pip = f"pip -m pip install -q --disable-pip-version-check --no-deps --no-index --find-links {tmp_path / 'wheels'}"
    assert log.read_text().splitlines() == [pip, "check -m flatcake.loadgen.bench.gpu_check --gib 2"]
    got = Path(f"{log}.req").read_text().split()
    if wanted is None:
        lock = (ROOT / "requirements" / "gpu.txt").read_text().splitlines()
        wanted = [line for line in lock if line and not line.startswith("#")]
        assert "cupy-cuda12x==14.2.0" in wanted
    assert got == wanted
