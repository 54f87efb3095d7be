"""The real SGLang L3s in the simulator (``hicache-file``, ``hicache-mooncake``): tiered's rules at the costs
bench peers measured, their calibration equal to the committed runs, and what slower reads cost."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from flatcake.loadgen.models import preset
from flatcake.loadgen.simulate import real_l3
from flatcake.loadgen.simulate.events import EventLoop
from flatcake.loadgen.simulate.real_l3 import CALIBRATION, HiCacheFileL3, MooncakeL3, calibration
from flatcake.loadgen.simulate.run import GiB, MiB, cluster, simulate
from flatcake.loadgen.simulate.sglang_rules import Tiered
from flatcake.loadgen.traces.formats import TraceRequest, write_trace
from tests.support.sims import small

pytestmark = pytest.mark.unit

RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results"
REAL = ("hicache-file", "hicache-mooncake")


def sessions_trace(path: Path, sessions: int = 80, again: int = 8, blocks: int = 8) -> str:
    """``sessions`` first turns of ``blocks`` 512-token blocks, 100 s apart; then the ``again`` oldest sessions'
    second turns within 8 ms (their prefixes long gone from HBM and the host tier: long restores queued on one
    I/O thread); then the 4 newest sessions' second turns, 100 s apart."""
    plan = [(100_000.0 * s, s, 1) for s in range(sessions)]
    plan += [(10_000_000.0 + s, s, 2) for s in range(again)]
    plan += [(20_000_000.0 + 100_000.0 * i, s, 2) for i, s in enumerate(range(sessions - 4, sessions))]
    write_trace(path, [TraceRequest(ms, turn * blocks * 512, 64, tuple(range(1000 * s + 1, 1000 * s + 1 + turn * blocks)),
                                    f"s{s}", turn, 512) for ms, s, turn in plan])  # fmt: skip
    return str(path)


def restores(tmp_path: Path) -> Any:
    """This VM's device (a rank reads a 2 MiB page in ~15 ms), 8 GiB of DRAM (a rank's host tier: 508 pages of
    the sessions' 1,280), 64 MiB of HBM a GPU."""
    return small(sessions_trace(tmp_path / "t.jsonl"), device="this-vm", dram_bytes=8 * GiB, hbm_bytes=64 * MiB)


def test_the_calibration_is_what_the_committed_peers_runs_say() -> None:
    fields = {"restore_bytes_per_s", "dram_hit_fraction", "durable_write_bytes_per_s"}
    assert {(r.system, r.source) for r in CALIBRATION} == {
        (s, f) for s in ("hicache_file", "mooncake") for f in ("peers-dsv4-flash.json", "peers-llama3-70b-tp4.json")
    }
    for run in CALIBRATION:
        report = json.loads((RESULTS / run.source).read_text())
        measured, workload = report["systems"][run.system], report["workload"]
        assert {f: getattr(run, f) for f in fields} == {f: measured[f] for f in fields}, run
        assert run.fio_read_bytes_per_s == report["limit"]["read_bytes_per_s"]
        assert (run.layers, run.page_layer_bytes, run.raw_page_layer_bytes) == (
            workload["layers"], workload["page_layer_bytes"], workload["raw_page_layer_bytes"])  # fmt: skip
    # The figures docs/benchmarks.md states, as the simulator applies them at dsv4-flash's page.
    span = preset("dsv4-flash").span_bytes
    file, mooncake = calibration("hicache_file", span), calibration("mooncake", span)
    assert file.source == mooncake.source == "peers-dsv4-flash.json"
    assert (round(file.read_efficiency, 3), round(file.write_efficiency, 3)) == (0.605, 0.246)
    assert (round(mooncake.read_efficiency, 3), round(mooncake.write_efficiency, 3)) == (0.564, 0.066)
    assert calibration("hicache_file", preset("llama3-70b-tp4").span_bytes).source == "peers-llama3-70b-tp4.json"


def test_the_real_l3s_override_no_rule_of_tiereds() -> None:
    """Scheduling, prefetch, timeout and store are Tiered's own: the real L3s change only the L3's methods."""
    rules = {"arrive", "dispatch", "store", "_look_up", "_try_prefetch", "_pump_io", "_batch_done", "_op_finished",
             "_l2_insert"}  # fmt: skip
    assert rules <= set(vars(Tiered))
    for cls in (real_l3.RealL3, HiCacheFileL3, MooncakeL3):
        assert issubclass(cls, Tiered) and not rules & set(vars(cls)), cls


def test_the_real_l3s_run_tiereds_rules_and_deliver_no_more(tmp_path: Path) -> None:
    """Same rules (both are ``Tiered``), slower pages: no more hits, no lower TTFT, longer prefetches; the
    file backend writes every page once as the log does, Mooncake only what its segment evicts."""
    cfg = restores(tmp_path)
    tiered, _ = simulate(cfg, "tiered", None)
    assert tiered["hit_share"]["ssd"] > 0  # the L3 serves these restores
    for system in REAL:
        out, sim = simulate(cfg, system, None)
        assert isinstance(sim, Tiered) and sim.name == system
        # None declined: a declined prefetch is recomputed at once, which can cost less than waiting.
        assert out["declined_tokens"] == tiered["declined_tokens"] == 0
        assert out["delivered_hit_rate"] <= tiered["delivered_hit_rate"], system
        assert out["ttft_mean_s"] > tiered["ttft_mean_s"], system
        assert out["counters"]["calibration"]["source"] == "peers-dsv4-flash.json"
    file, _ = simulate(cfg, "hicache-file", None)
    assert file["mean_prefetch_s"] > tiered["mean_prefetch_s"]  # the same restores, each page slower
    assert file["ssd_write_bytes"] == tiered["ssd_write_bytes"] > 0


def test_a_slower_l3_read_lets_more_prefetches_hit_the_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Concurrent long restores on one FIFO I/O thread: the slower each page, the more requests reach their
    prefetch deadline with pages still unread, which are recomputed (fewer hits, more not-prefetched)."""
    cfg = restores(tmp_path)
    measured, _ = simulate(cfg, "hicache-file", None)
    slow = tuple(dataclasses.replace(r, restore_bytes_per_s=r.restore_bytes_per_s / 4) for r in CALIBRATION)
    monkeypatch.setattr(real_l3, "CALIBRATION", slow)
    slower, sim = simulate(cfg, "hicache-file", None)
    assert isinstance(sim, HiCacheFileL3)
    assert sim.calibration.read_efficiency == pytest.approx(0.605 / 4, abs=1e-3)
    assert measured["not_prefetched_tokens"] < slower["not_prefetched_tokens"]
    assert slower["delivered_hit_rate"] < measured["delivered_hit_rate"]


def test_hicache_file_evicts_least_recently_used_files_never_one_being_written() -> None:
    """Its LRU evictor with max_size at the SSD: over the cap, files go oldest use first (a rewrite is a use)
    down to 90% of it; a file still being written is passed over; a file is found once it has landed."""
    c = cluster(small("unused.jsonl", ssd_bytes=8 * 256 * MiB))
    loop = EventLoop()
    sim = HiCacheFileL3(c, loop)
    cap = 256 * MiB // c.page_span
    assert sim.cap_pages == cap == 127
    sim._l3_append(0, list(range(1, cap + 1)))
    assert sim._l3_prefix(0, (1, 2), 0) == 0  # written, not landed yet
    loop.run()
    assert sim._l3_prefix(0, (1, 2), 0) == 2
    assert sim._unstored(0, [1, 500]) == [500]  # 1 is held: refreshed, not rewritten
    sim._l3_append(0, [500])
    target = int(cap * real_l3.EVICTION_RATIO)
    assert len(sim.files[0]) == target and sim.evicted_files == cap + 1 - target
    assert 1 in sim.files[0] and 2 not in sim.files[0] and cap in sim.files[0]
    sim._l3_append(0, list(range(600, 600 + cap - target + 1)))  # over the cap again: 500 is still being written
    assert 500 in sim.files[0] and sim.files[0][500] is False


def test_mooncake_serves_its_segment_from_dram_and_writes_only_what_it_evicts(tmp_path: Path) -> None:
    cfg = restores(tmp_path)
    out, sim = simulate(cfg, "hicache-mooncake", None)
    tiered, tiered_sim = simulate(cfg, "tiered", None)
    assert isinstance(sim, MooncakeL3)
    assert abs(2 * sim.l2_pages - tiered_sim.l2_pages) <= 1  # half the DRAM is SGLang's host tier
    assert sim.segment_reads > 0  # the newest sessions' pages: gone from the host tier, still in the segment
    assert sim.offloaded_pages > 0 and not any(sim.offloading)  # every offload landed by the end
    c = sim.c
    assert out["ssd_write_bytes"] == sim.offloaded_pages * c.page_span * c.width < tiered["ssd_write_bytes"]


def test_a_mooncake_put_into_a_segment_full_of_pages_being_offloaded_is_refused() -> None:
    c = cluster(small("unused.jsonl", dram_bytes=2 * GiB))  # a rank's segment: 128 MiB, 63 pages
    loop = EventLoop()
    sim = MooncakeL3(c, loop)
    cap = sim.segment_pages
    assert cap == GiB // 8 // c.page_span == 63
    sim._l3_append(0, list(range(1, cap + 1)))  # past the high watermark: the oldest go to SSD
    pending, step = len(sim.offloading[0]), int(real_l3.EVICTION_SHARE * cap)
    assert pending % step == 0 and cap - pending <= real_l3.HIGH_WATERMARK * cap < cap - pending + step
    assert set(sim.offloading[0]) == set(range(1, pending + 1))  # least recently put first
    assert sim._l3_prefix(0, (1,), 0) == 1  # being offloaded: still found, in DRAM
    sim._l3_append(0, [1000])  # no room until an offload lands
    assert sim.refused_puts == 1 and sim._l3_prefix(0, (1000,), 0) == 0
    loop.run()
    assert not sim.offloading[0] and sim.offloaded_pages == pending and 1 in sim.l3[0]
    sim._l3_append(0, [1000])
    assert sim._l3_prefix(0, (1000,), 0) == 1


def test_the_docs_table_is_the_committed_run() -> None:
    """docs/benchmarks.md's real-L3 rows and FlatCake's ratios to them are what the committed JSON says."""
    doc = " ".join((RESULTS.parent / "benchmarks.md").read_text().split())
    copies = json.loads((RESULTS / "simulate-copies.json").read_text())["runs"]
    runs = json.loads((RESULTS / "simulate-real-l3.json").read_text())["runs"]
    tiered = {(r["users"], r["qps"]): r["ttft_mean_s"] for r in copies if r["system"] == "tiered"}
    shipped = {(r["users"], r["qps"]): r["ttft_mean_s"] for r in copies
               if r["system"] == "flatcake" and r["placement"] == "copies" and r["storage_dram_share"] == 0.9}  # fmt: skip
    assert {r["system"] for r in runs} == set(REAL) and {(r["users"], r["qps"]) for r in runs} == set(tiered)
    ratios: dict[str, list[float]] = {s: [] for s in REAL}
    for r in runs:
        at = (r["users"], r["qps"])
        ratio = shipped[at] / r["ttft_mean_s"]
        row = (f"| {r['users']} | {r['qps']:g} | {r['system']} | {r['ttft_mean_s']:.3f} | "
               f"{r['ttft_mean_s'] / tiered[at]:.2f} | {ratio:.2f} | {100 * r['delivered_hit_rate']:.1f}% |")  # fmt: skip
        assert row in doc, row
        if r["users"] == 256:
            ratios[r["system"]].append(ratio)
    file, mooncake = (f"{min(v):.2f}-{max(v):.2f}×" for v in ratios.values())
    assert f"At 256 users shipped FlatCake is {file} `hicache-file` and {mooncake} `hicache-mooncake`" in doc
    assert all(v <= 0.8 for v in ratios["hicache-file"] + ratios["hicache-mooncake"])  # the goal, as stated
