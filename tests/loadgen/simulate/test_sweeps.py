"""``flatcake simulate --sweep``: knobs reach the agent's own policy, and a sweep is reproducible."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from flatcake.loadgen.simulate import sweeps
from flatcake.loadgen.simulate.run import GiB, MiB, SimConfig
from flatcake.loadgen.traces.formats import TraceRequest, read_trace, write_trace
from tests.support.sims import small

pytestmark = pytest.mark.unit


def chats(path: Path, sessions: int = 4, turns: int = 4) -> str:
    """Conversations whose first turn is under one page (nothing stored), so the first write (turn 2,
    ~9K tokens) is one-shot to SSD as far as SGLang's backend can tell; each later turn appends one page
    (a short reply and message): Table 2 puts those in DRAM (short chat) unless L_agent is below the
    context."""
    reqs, next_id, t = [], 1, 0.0
    history: dict[int, list[int]] = {s: [] for s in range(sessions)}
    for turn in range(1, turns + 1):
        for s in range(sessions):
            tokens = 200 if turn == 1 else 8_192 + 512 * turn
            ids = history[s]
            need = -(-tokens // 512) - len(ids)
            ids += range(next_id, next_id + need)
            next_id += need
            reqs.append(TraceRequest(t, tokens, 300, tuple(ids), f"c{s}", turn, 512))
            t += 500.0
    write_trace(path, reqs)
    return str(path)


def base(trace: str, **kw: Any) -> SimConfig:
    return small(trace, **{"hbm_bytes": 64 * MiB, "dram_bytes": 8 * GiB, "ssd_bytes": 64 * GiB, "workers": 2, **kw})


def test_a_placement_threshold_reaches_the_agents_decide(tmp_path: Path) -> None:
    report = sweeps.run("placement", base(chats(tmp_path / "t.jsonl")), tmp_path, quiet=True)
    share = {p["x"]: p["dram_placed_share"] for p in report["points"]}
    # Default L_agent (32K) above every context: turns 3 and 4 (one page each of the 20) are short chats.
    assert share[1.0] == pytest.approx(2 / 20)
    assert share[0.125] == 0.0  # L_agent 4K below them: agent sessions, SSD
    assert report["points"][0]["placement"]["agent_context_tokens"] == 4_096


def test_the_same_sweep_gives_the_same_json(tmp_path: Path) -> None:
    cfg = base(chats(tmp_path / "t.jsonl"), dram_bytes=1 * GiB)
    runs = []
    for _ in range(2):
        report = sweeps.run("gap", cfg, tmp_path, quiet=True)
        for p in report["points"]:
            p.pop("sim_wall_s")  # how long the simulation itself took
        runs.append(json.dumps(report, sort_keys=True))
    assert runs[0] == runs[1]
    assert [p["x"] for p in json.loads(runs[0])["points"]] == [0, 4, 16, 64, 256, 1024]


def test_dram_ssd_points_cost_the_same(tmp_path: Path) -> None:
    cfg = base(chats(tmp_path / "t.jsonl"), workers=1)
    points = sweeps.SWEEPS["dram-ssd"].points(cfg, ("flatcake-native",), tmp_path)
    costs = {round(p.cfg.dram_bytes / GiB * sweeps.DRAM_USD_PER_GIB + p.cfg.ssd_bytes / GiB * sweeps.NVME_USD_PER_GIB,
                   3) for p in points}  # fmt: skip
    assert len(points) >= 5 and len(costs) == 1
    assert sorted(p.cfg.dram_bytes for p in points) == [p.cfg.dram_bytes for p in points]


def test_long_sessions_append_a_fixed_amount_per_turn(tmp_path: Path) -> None:
    reqs = list(read_trace(sweeps.long_sessions_trace(tmp_path / "l.jsonl", turns=5, sessions=2)))
    assert len(reqs) == 10 and {r.session for r in reqs} == {"s0", "s1"}
    s0 = [r for r in reqs if r.session == "s0"]
    assert [r.input_length for r in s0] == [16_384 + 1_024 * t for t in range(5)]
    for a, b in itertools.pairwise(s0):  # each turn's prompt extends the previous one
        assert b.hash_ids[: len(a.hash_ids)] == a.hash_ids


def test_an_unknown_sweep_names_the_flag(tmp_path: Path) -> None:
    from flatcake.errors import ConfigError

    with pytest.raises(ConfigError, match="--sweep"):
        sweeps.run("nope", base(chats(tmp_path / "t.jsonl")), tmp_path)
