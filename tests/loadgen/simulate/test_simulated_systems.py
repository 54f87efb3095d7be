"""The simulated systems run the agent's own policy and keep its accounting."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from flatcake.loadgen.models import preset
from flatcake.loadgen.simulate.native import FlatCake
from flatcake.loadgen.simulate.run import GiB, MiB, simulate
from flatcake.loadgen.simulate.sglang_rules import Tiered
from flatcake.loadgen.systems import hicache_rules as hicache
from flatcake.loadgen.traces.formats import TraceRequest, write_trace
from flatcake.node_agent import PlacementConfig
from flatcake.node_agent.policy.gva import Medium
from flatcake.node_agent.policy.placement import decide
from flatcake.node_agent.policy.scopes import ScopeTable
from tests.support.sims import small

pytestmark = pytest.mark.unit


def sessions_trace(path: Path, sessions: int = 6, turns: int = 4, blocks_per_turn: int = 32) -> str:
    """Interleaved sessions whose turns each append ``blocks_per_turn`` 512-token blocks."""
    reqs, next_id, t = [], 1, 0.0
    history: dict[int, list[int]] = {s: [] for s in range(sessions)}
    for turn in range(1, turns + 1):
        for s in range(sessions):
            history[s] += list(range(next_id, next_id + blocks_per_turn))
            next_id += blocks_per_turn
            ids = history[s]
            reqs.append(TraceRequest(t, len(ids) * 512, 64, tuple(ids), f"s{s}", turn, 512))
            t += 1000.0
    write_trace(path, reqs)
    return str(path)


def test_flatcake_places_by_the_real_decide(tmp_path: Path) -> None:
    cfg = small(sessions_trace(tmp_path / "t.jsonl"))
    _, sim = simulate(cfg, "flatcake-native", 1.0)
    assert isinstance(sim, FlatCake) and sim.decisions
    fresh = [(h, m) for h, m, reason in sim.decisions if reason not in ("inherited", "dram_full")]
    assert fresh
    for hints, medium in fresh:
        assert decide(hints, PlacementConfig()).medium is medium


def test_tiered_l2_hits_less_with_tiny_dram(tmp_path: Path) -> None:
    trace = sessions_trace(tmp_path / "t.jsonl")
    tiny, _ = simulate(small(trace, dram_bytes=64 * MiB), "dram", 1.0)
    big, _ = simulate(small(trace, dram_bytes=256 * GiB), "dram", 1.0)
    assert tiny["delivered_hit_rate"] < big["delivered_hit_rate"]


def test_flatcake_needs_fewer_read_commands_per_page_than_tiered_l3(tmp_path: Path) -> None:
    trace = sessions_trace(tmp_path / "t.jsonl")
    cfg = small(trace, dram_bytes=8 * GiB)  # the tiered host tier spills to its SSD log
    fc, _ = simulate(cfg, "flatcake-native", 1.0)
    l3, _ = simulate(cfg, "tiered", 1.0)
    assert fc["ssd_read_commands"] and l3["ssd_read_commands"]
    assert fc["read_commands_per_page"] < l3["read_commands_per_page"] == 1.0


def test_same_seed_same_json(tmp_path: Path) -> None:
    cfg = small(sessions_trace(tmp_path / "t.jsonl"), dram_bytes=8 * GiB)
    for system in ("flatcake-native", "tiered"):
        a, _ = simulate(cfg, system, 0.5)
        b, _ = simulate(cfg, system, 0.5)
        a.pop("sim_wall_s"), b.pop("sim_wall_s")
        assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_one_cold_request_costs_exactly_its_prefill(tmp_path: Path) -> None:
    trace = tmp_path / "one.jsonl"
    write_trace(trace, [TraceRequest(0.0, 4096, 10, tuple(range(1, 9)), "s", 1, 512)])
    cfg = small(str(trace), gpu="h200")
    p = preset(cfg.model)
    for system in ("flatcake-native", "dram", "tiered"):
        r, _ = simulate(cfg, system, None)
        assert r["delivered_hit_rate"] == 0.0 and r["ideal_hit_rate"] == 0.0
        assert r["ttft_mean_s"] == pytest.approx(p.prefill_s(4096, 0, "h200"))
        assert r["throughput_tokens_per_s"] == pytest.approx(
            (4096 + 10) / (p.prefill_s(4096, 0, "h200") + 10 * p.decode_s_per_token("h200"))
        )


def test_bytes_placed_are_reclaimed_or_resident(tmp_path: Path) -> None:
    # SSD of 3 scope files per rank: sessions must be reclaimed whole to make room.
    cfg = small(sessions_trace(tmp_path / "t.jsonl", sessions=8, turns=3), dram_bytes=8 * MiB * 43,
                ssd_bytes=8 * 3 * 256 * MiB)  # fmt: skip
    r, sim = simulate(cfg, "flatcake-native", 1.0)
    assert isinstance(sim, FlatCake)
    table: ScopeTable = sim.tables[0]
    assert table.reclaimed[Medium.SSD].scopes > 0
    for m in Medium:
        resident = table.used(m) * table.unit_bytes(m)
        assert sim.placed_bytes[m] == table.reclaimed[m].bytes + resident, m
    assert r["delivered_hit_rate"] <= r["ideal_hit_rate"] + 1e-12


def test_tiered_l3_reclaims_its_log_by_bucket(tmp_path: Path) -> None:
    cfg = small(sessions_trace(tmp_path / "t.jsonl", sessions=8), dram_bytes=1 * GiB, ssd_bytes=8 * 512 * MiB)
    _, sim = simulate(cfg, "tiered", 1.0)
    assert isinstance(sim, Tiered) and sim.reclaimed_buckets > 0


def test_the_same_inputs_give_the_same_json(tmp_path: Path) -> None:
    """No hidden randomness or wall-clock dependence: a what-if answer can be reproduced exactly."""
    cfg = small(sessions_trace(tmp_path / "t.jsonl", sessions=5, turns=3), dram_bytes=2 * GiB, ssd_bytes=8 * GiB)
    for system in ("flatcake-native", "dram", "tiered"):
        first, _ = simulate(cfg, system, 2.0)
        again, _ = simulate(cfg, system, 2.0)
        for r in (first, again):
            r.pop("sim_wall_s")  # how long the simulation itself took: the one field that may differ
        assert json.dumps(first, sort_keys=True) == json.dumps(again, sort_keys=True), system


def test_the_policy_is_imported_from_the_agent_not_copied() -> None:
    """The simulator must run the agent's own decisions: it imports them from the node agent (by module
    path), and nothing under loadgen defines a function of the same name (a copy that could drift)."""
    import ast

    from flatcake import loadgen

    root = Path(loadgen.__file__).parent
    # LocalCatalog places by ``decide`` and reclaims through ScopeTable; Scheduler orders by ``hrrn``.
    used = {"LocalCatalog", "ScopeTable", "Scheduler", "plan_restore"}
    policy = used | {"decide", "hrrn"}
    imported: set[str] = set()
    defined: list[str] = []
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flatcake.node_agent"):
                if path.parent.name == "simulate":
                    imported |= {a.name for a in node.names}
            elif isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in policy:
                defined.append(f"{path.relative_to(root)}:{node.name}")
    assert used <= imported and not defined, (used - imported, defined)


@pytest.mark.parametrize("system", ["dram", "tiered"])
def test_tiered_keeps_new_pages_in_hbm_until_backed_up(tmp_path: Path, system: str) -> None:
    """HiCache evicts a page from HBM only once the host tier holds it (the emulator: new pages are
    pinned from its insert until their store returns). A's pages that survived its own insert are
    still in HBM for A's next turn when another session's prefill ran during A's write-back; once
    written back, that prefill evicts them."""
    from flatcake.loadgen.simulate import devices

    one = tmp_path / "one.jsonl"
    a = TraceRequest(0.0, 4096, 1, tuple(range(1, 9)), "a", 1, 512)  # 16 pages of 256 tokens
    write_trace(one, [a])
    ttft = simulate(small(str(one)), system, None)[0]["ttft_mean_s"]
    b = TraceRequest(0.0, 4096, 1, tuple(range(101, 109)), "b", 1, 512)  # as long, queued behind A
    again = TraceRequest(2 * ttft + 1e-3, 5120, 1, tuple(range(1, 11)), "a", 2, 512)  # after B's prefill
    three = tmp_path / "three.jsonl"
    write_trace(three, [a, b, again])
    fast = devices.profile("this-vm")
    slow = dataclasses.replace(fast, h2d_bytes_per_s=1e6)  # the copy into the host tier takes seconds
    hbm = 16 * MiB  # 7 pages of dsv4-flash's 2 MiB rank page
    hits = {}
    for name, device in (("slow", slow), ("fast", fast)):
        _, sim = simulate(small(str(three), hbm_bytes=hbm, device=device), system, None)
        hits[name] = max(sim.records, key=lambda r: r.arrival).hit["hbm"]
    assert hits == {"slow": 7, "fast": 0}, hits


def _burst_trace(path: Path, sessions: int = 8, blocks: int = 32) -> str:
    """Every session's first turn, a second apart, then all second turns within 8 ms: prepared requests
    pile up behind one GPU."""
    reqs = [TraceRequest(1000.0 * s, blocks * 512, 64, tuple(range(1000 * s + 1, 1000 * s + 1 + blocks)), f"s{s}",
                         1, 512) for s in range(sessions)]  # fmt: skip
    reqs += [TraceRequest(100_000.0 + s, 2 * blocks * 512, 64, tuple(range(1000 * s + 1, 1000 * s + 1 + 2 * blocks)),
                          f"s{s}", 2, 512) for s in range(sessions)]  # fmt: skip
    write_trace(path, reqs)
    return str(path)


@pytest.mark.parametrize("system", ["flatcake-native", "tiered"])
def test_prepared_pages_wait_in_bounded_host_staging_not_hbm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, system: str
) -> None:
    """As the emulator (issue 27): pages read from SSD before dispatch wait in host staging, never in HBM,
    and count as SSD hits once copied in; the tokens prepared stay below half the host pool plus one
    request (FlatCake's prefetches wait past it): a bigger host pool lets more prepare at once."""
    seen: list[tuple[int, int, bool]] = []
    if system == "flatcake-native":
        prefetched = FlatCake._prefetched

        def spy(self: FlatCake, inst: Any, rid: str) -> None:
            job, staged = inst.jobs[rid], inst.staging_tokens
            prefetched(self, inst, rid)  # may dispatch it at once; its prefill ends later
            seen.append((staged, self.host_pool_tokens, any(k in inst.hbm for k in job.ssd_keys)))

        monkeypatch.setattr(FlatCake, "_prefetched", spy)
    else:
        batch_done = Tiered._batch_done

        def spy_batch(self: Tiered, inst: Any, job: Any, got: list[int], asked: int) -> None:
            batch_done(self, inst, job, got, asked)
            seen.append((inst.staging_tokens, self.host_pool_tokens, any(k in inst.hbm for k in got)))

        monkeypatch.setattr(Tiered, "_batch_done", spy_batch)
    trace = _burst_trace(tmp_path / "t.jsonl")
    peaks = []
    # A big host pool lets FlatCake prepare more at once; tiered's then holds everything in its host tier.
    for dram in (1 * GiB, 64 * GiB) if system == "flatcake-native" else (1 * GiB,):
        seen.clear()
        out, _ = simulate(small(trace, dram_bytes=dram, hbm_bytes=64 * MiB), system, None)
        assert len(seen) >= 4 and not any(in_hbm for _, _, in_hbm in seen), "prepared pages went into HBM"
        request_tokens = 32 * 512
        assert all(tokens < hicache.capacity_tokens(pool) + request_tokens for tokens, pool, _ in seen)
        assert out["hit_share"]["ssd"] > 0  # the prepared pages reached their prefills
        peaks.append(max(tokens for tokens, _, _ in seen))
    assert peaks == sorted(set(peaks))


def test_tiered_backs_pages_up_to_the_nodes_l3_which_serves_its_other_instances(tmp_path: Path) -> None:
    """SGLang's write_through with a storage backend backs every page up to storage as it enters the
    host tier; the node's L3 then serves another instance's request with the same prefix, though no
    host tier ever evicted it (the host tier is per instance; ``dram`` has no L3 and recomputes)."""
    from flatcake.loadgen.simulate.workload import route

    names = [f"s{i}" for i in range(64)]
    a = next(n for n in names if route(n + "/i", 2) == 0)
    b = next(n for n in names if route(n + "/i", 2) == 1)
    trace = tmp_path / "t.jsonl"
    write_trace(trace, [TraceRequest(0.0, 4096, 1, tuple(range(1, 9)), a, 1, 512),
                        TraceRequest(60_000.0, 5120, 1, tuple(range(1, 11)), b, 1, 512)])  # fmt: skip
    cfg = small(str(trace), model="llama3-70b-tp4")  # 4 ranks an instance: 2 instances on the node
    hits = {}
    for system in ("tiered", "dram"):
        _, sim = simulate(cfg, system, None)
        hits[system] = max(sim.records, key=lambda r: r.arrival).hit
    assert hits["tiered"]["ssd"] > 0 and hits["tiered"]["hbm"] == 0
    assert hits["dram"] == {"hbm": 0, "dram": 0, "ssd": 0, "remote": 0}


def test_cross_node_reads_serve_a_prompt_another_node_stored(tmp_path: Path) -> None:
    """Two sessions on two nodes share a prompt: with cross-node reads the second node fetches the first
    node's pages over its NIC (remote hits, the peer's catalog leased meanwhile) instead of prefilling them;
    without, it prefills. The nodes' own hits are unchanged."""
    from flatcake.loadgen.simulate.workload import route

    names = [f"s{i}" for i in range(64)]
    a = next(n for n in names if route(n, 2) == 0)
    b = next(n for n in names if route(n, 2) == 1)
    trace = tmp_path / "t.jsonl"
    write_trace(trace, [TraceRequest(0.0, 4096, 1, tuple(range(1, 9)), a, 1, 512),
                        TraceRequest(60_000.0, 5120, 1, tuple(range(1, 11)), b, 1, 512)])  # fmt: skip
    hits, outs = {}, {}
    for gbps in (0.0, 200.0):
        cfg = dataclasses.replace(small(str(trace)), nodes=2, cross_node_gbps=gbps)
        outs[gbps], sim = simulate(cfg, "flatcake-native", None)
        hits[gbps] = max(sim.records, key=lambda r: r.arrival).hit
        assert isinstance(sim, FlatCake)
        assert all(not c.handles()[1] for c in sim.catalogs)  # every lease released, remote ones too
    assert hits[0.0]["remote"] == 0 and sum(hits[0.0].values()) == 0  # another node's prompt: prefilled
    assert hits[200.0]["remote"] > 0  # fetched from node 0
    assert outs[200.0]["hit_share"]["remote"] > 0 and outs[200.0]["ttft_mean_s"] < outs[0.0]["ttft_mean_s"]


def test_flatcake_as_it_ships_runs_sglangs_rules_over_the_agents_catalog(tmp_path: Path) -> None:
    """The shipped FlatCake in the simulator: SGLang's scheduling and prefetch (Tiered's) with the agent's
    catalog as the L3 under half the DRAM budget's host tier; its SSD pages are read by the engine's
    coalesced plan (fewer commands a page than the tiered log's whole-page reads), placed by Table 2."""
    from flatcake.loadgen.simulate.sglang_rules import ShippedFlatCake

    trace = sessions_trace(tmp_path / "t.jsonl")
    cfg = small(trace, dram_bytes=8 * GiB)
    shipped, sim = simulate(cfg, "flatcake", 1.0)
    assert isinstance(sim, ShippedFlatCake) and isinstance(sim, Tiered)
    tiered, tiered_sim = simulate(cfg, "tiered", 1.0)
    assert abs(2 * sim.l2_pages - tiered_sim.l2_pages) <= 1  # half the DRAM budget is SGLang's host tier
    assert sum(sim.fc.placed_bytes.values()) > 0  # written through to FlatCake's catalog
    assert shipped["ssd_read_commands"] and shipped["read_commands_per_page"] < tiered["read_commands_per_page"]
    native, _ = simulate(cfg, "flatcake-native", 1.0)
    assert shipped["delivered_hit_rate"] <= native["delivered_hit_rate"] + 1e-9  # SGLang's rules bind it


def test_native_declines_ssd_loads_that_cost_more_than_computing(tmp_path: Path) -> None:
    """On a slow device, waiting for a session's SSD history costs more than computing it: the cost rule
    (policy.offer) declines those loads and TTFT falls below the paper's always-wait; on a fast one it
    declines nothing."""
    from flatcake.loadgen.simulate.devices import PROFILES

    trace = sessions_trace(tmp_path / "t.jsonl", sessions=8, turns=4, blocks_per_turn=64)
    slow = dataclasses.replace(PROFILES["this-vm"], name="slow", read_bytes_per_s=2e8)
    runs = {}
    for rule in ("always", "cost"):
        cfg = small(trace, hbm_bytes=64 * MiB, dram_bytes=4 * GiB, device=slow, wait_rule=rule)
        runs[rule], _ = simulate(cfg, "flatcake-native", 4.0)
    assert runs["always"]["declined_tokens"] == 0
    assert runs["cost"]["declined_tokens"] > 0
    assert runs["cost"]["ttft_mean_s"] < runs["always"]["ttft_mean_s"]
    fast, _ = simulate(small(trace, hbm_bytes=64 * MiB, dram_bytes=4 * GiB), "flatcake-native", 4.0)
    assert fast["declined_tokens"] == 0 and fast["hit_share"]["ssd"] > 0
