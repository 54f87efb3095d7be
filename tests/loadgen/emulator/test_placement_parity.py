"""The emulator and the simulator place the same requests alike: both derive each put's hints with the
SGLang backend's ``ChainSignals`` and place them with the agent's own catalog."""

from __future__ import annotations

from pathlib import Path

import pytest

from flatcake.loadgen.emulator.config import EmulatorConfig, MiB
from flatcake.loadgen.emulator.storage import Storage
from flatcake.loadgen.simulate import workload
from flatcake.loadgen.simulate.native import FlatCake
from flatcake.loadgen.simulate.run import GiB, simulate
from flatcake.loadgen.traces.formats import TraceRequest, write_trace
from flatcake.node_agent import ChainSignals
from tests.support.sims import small

pytestmark = pytest.mark.integration


def mixed_trace(path: Path) -> str:
    """A system prompt every session starts with; chats whose turns append one 512-token block (short
    turns) and agent sessions whose turns append eight (long ones); arrivals far apart, so every write has
    landed before the next request: what each side decides cannot depend on timing."""
    reqs, next_id, t = [], 100, 0.0
    prompt = list(range(1, 5))
    history = {s: list(prompt) for s in range(6)}
    for turn in range(1, 5):
        for s in range(6):
            grow = 1 if s % 2 else 8
            history[s] += range(next_id, next_id + grow)
            next_id += grow
            ids = history[s]
            reqs.append(TraceRequest(t, len(ids) * 512, 64, tuple(ids), f"s{s}", turn, 512))
            t += 60_000.0
    write_trace(path, reqs)
    return str(path)


def test_the_emulator_and_the_simulator_place_the_same_requests_alike(tmp_path: Path) -> None:
    trace = mixed_trace(tmp_path / "t.jsonl")
    _, sim = simulate(small(trace, dram_bytes=64 * GiB, ssd_bytes=512 * GiB), "flatcake-native", None)
    assert isinstance(sim, FlatCake)
    want = sim.counters()["placements_pages"]
    page_tokens = sim.c.page_tokens
    cfg = EmulatorConfig(mode="flatcake-native", data_dir=str(tmp_path / "emu"), page_tokens=page_tokens, layers=2,
                         bytes_per_token_layer=16, dram_bytes=256 * MiB, ssd_bytes=1024 * MiB)  # fmt: skip
    storage = Storage(cfg)
    try:
        assert storage.engine is not None
        signals = ChainSignals()
        for req in workload.build(workload.load(trace), page_tokens, None):
            keys = [str(k) for k in req.keys]
            stored = storage.engine.exists(keys)
            signals.observe(keys[:stored], keys[stored:])  # the hit query at arrival
            if stored < len(keys):
                storage.store(keys[:stored], keys[stored:], signals)  # the write-back after prefill
        got = storage.engine.catalog.placements.snapshot()
    finally:
        storage.close()
    assert got == want
    # The workload exercises both media and both reasons for a scope of its own.
    assert got.get("dram/short_chat", 0) > 0 and got.get("ssd/one_shot", 0) > 0 and got.get("ssd/inherited", 0) > 0
