"""``flatcake bench remote --quick`` across two network namespaces (real agents, a veth pair, Mooncake's
transfer engine over TCP): a session written on node A is restored on node B bit-exact from A's DRAM and
from A's SSD, and killing A's agent mid-restore gives misses within the timeout and no wrong byte."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

FLATCAKE = Path(sys.executable).parent / "flatcake"


def test_bench_remote_quick_restores_across_namespaces(tmp_path: Path) -> None:
    out = tmp_path / "remote.json"
    proc = subprocess.run([str(FLATCAKE), "bench", "remote", "--quick", "--dir", str(tmp_path / "run"), "--json",
                           str(out)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for field in ("remote_dram_bytes_per_s", "remote_ssd_bytes_per_s", "local_bytes_per_s", "corrupt_pages"):
        assert field in report
    assert report["corrupt_pages"] == 0
    for path in ("remote_dram", "remote_ssd", "local_dram", "local_ssd"):
        r = report[path]
        assert r["missing_pages"] == 0 and r["corrupt_pages"] == 0, (path, r)  # every page, bit-exact
        assert r["bytes_per_s"] > 0 and 0 < r["time_to_first_layer_s"] <= r["seconds"], (path, r)
    assert report["hosts"]["a"] != report["hosts"]["b"]
    killed = report["peer_killed"]
    assert killed["missing_pages"] > 0 and killed["wrong_pages"] == 0, killed
    assert killed["answered_after_kill_s"] < killed["timeout_s"], killed
    assert "remote_ssd" in proc.stdout and "A killed mid-restore" in proc.stdout  # the human-readable table
    # The namespaces are gone with the run.
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not set(report["hosts"]["namespaces"]) & set(listed)
