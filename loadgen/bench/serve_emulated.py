"""``bench serve``'s emulated systems (issue 43): the same slice replayed against ``flatcake emulate``
configured as the real SGLang deployment is, so one table shows what the real server reaches next to what
the emulator predicts for it (``emu-flatcake``: SGLang's rules over FlatCake's agent, counterpart
``flatcake``; ``emu-hicache-file``: SGLang's rules over HiCacheFile, counterpart ``hicache-file``) and for
the paper's engine-integrated design, which no engine ships (``emu-flatcake-native``).

The mirror (``mirror``): the slice model's KV geometry (layers, SGLang's 64-token page, bytes per token
per layer), HBM = the device pool (``device_tokens``), SGLang's host pool (``host_ratio`` times it),
FlatCake's DRAM pool (``dram_bytes``) and its SSD pool (``SSD_FILES`` files of ``SSD_FILE_PAGES`` pages)
as ``storage_for`` gives the real systems. ``emu-flatcake``'s DRAM budget is the host pool plus
FlatCake's pool, split as deployed; ``emu-flatcake-native`` has no host tier and gets the same total as
FlatCake's pool; ``emu-hicache-file``'s is the host pool, its files left in the page cache as the real
backend leaves them. The modelled GPU is this CPU: prefill at the slice's measured cost per token
(``bench serve --calibrate``'s ``slice`` row: cold vLLM prefills of the same model, no fixed cost, no
cost for attending to cached tokens), decode at ``DECODE_S_PER_TOKEN``.

Not available from the emulator, so absent or n/a in its rows: the logprobs check (no model: n/a) and the
probe's restore (0); ``cpu_s.server`` is the emulator's own CPU, not a model's. Cached tokens by tier come
from its per-request records (HBM as ``device``, its host tier as ``host``, L3 as ``storage``; the native
what-if has no host tier, so its DRAM and SSD restores are both ``storage``), DRAM and SSD pages restored
from the agent's own counters.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flatcake.errors import ConfigError
from flatcake.loadgen.bench import emulated
from flatcake.loadgen.bench.serve import (
    SSD_FILE_PAGES,
    ServeConfig,
    _records,
    kv_geometry,
    ssd_pool_bytes,
    summarize,
)
from flatcake.loadgen.bench.serve_calibration import where_here
from flatcake.loadgen.emulator.config import EmulatorConfig
from flatcake.loadgen.replay.run import LoadgenConfig
from flatcake.loadgen.replay.run import run as run_locust
from flatcake.loadgen.report.build import agent_counters
from flatcake.loadgen.serve.server import cpu_seconds

# system -> (emulator mode, its L3, the real system it stands for: None for the what-if)
SYSTEMS: dict[str, tuple[str, str, str | None]] = {
    "emu-flatcake": ("flatcake", "log", "flatcake"),
    "emu-hicache-file": ("tiered", "hicache-file", "hicache-file"),
    "emu-flatcake-native": ("flatcake-native", "log", None),
}
# Decode: the median (e2e - TTFT) / (output tokens - 1) of the 384 requests of the real 8-user SGLang runs
# behind docs/results/serve-sglang-8users.json (every system, both repeats; per run 0.0139-0.0179 s).
DECODE_S_PER_TOKEN = 0.0156
CALIBRATE = "flatcake bench serve --calibrate --out docs/results"


@dataclasses.dataclass(frozen=True)
class Rates:
    """The modelled GPU: this CPU's prefill and decode rates, and where the prefill rate came from."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    source: str


def calibrated_rates(path: Path) -> Rates:
    """The slice's prefill rate from ``bench serve --calibrate``'s JSON (its ``slice`` row), decode's from
    ``DECODE_S_PER_TOKEN``; a ConfigError naming the calibration if the file or the row is missing."""
    if not path.is_file():
        raise ConfigError(f"calibration: {path} does not exist; the emulated systems take this CPU's prefill rate "
                          f"from it: run `{CALIBRATE}` first")  # fmt: skip
    rows = [r for r in json.loads(path.read_text()).get("here", []) if r.get("where") == where_here("slice")]
    if not rows or not rows[0].get("prefill_s_per_token", 0) > 0:
        raise ConfigError(f"calibration: {path} has no 'slice' row with prefill_s_per_token > 0; run `{CALIBRATE}`")
    return Rates(1.0 / float(rows[0]["prefill_s_per_token"]), 1.0 / DECODE_S_PER_TOKEN, str(path))


def budgets(cfg: ServeConfig, geometry: dict[str, int]) -> dict[str, int]:
    """The real deployment's memories in bytes: the device pool, SGLang's host pool, FlatCake's DRAM and SSD
    pools (whole pages, as ``storage_for`` sizes them) and one SSD file."""
    span = geometry["layers"] * geometry["page_bytes"]
    per_token = span // geometry["page_tokens"]
    return {"device": cfg.device_tokens * per_token, "host": int(cfg.device_tokens * cfg.host_ratio) * per_token,
            "flatcake_dram": cfg.dram_bytes // span * span, "flatcake_ssd": ssd_pool_bytes(geometry),
            "ssd_file": SSD_FILE_PAGES * span}  # fmt: skip


def mirror(system: str, cfg: ServeConfig, geometry: dict[str, int], rates: Rates) -> EmulatorConfig:
    """The emulator configured as ``system``'s real deployment on this slice (the module doc says how)."""
    mode, l3, _ = SYSTEMS[system]
    b = budgets(cfg, geometry)
    span = geometry["layers"] * geometry["page_bytes"]
    dram, share = b["host"] + b["flatcake_dram"], 0.5
    if mode == "flatcake":
        # FlatCake's share, half a page over: the emulator rounds its pool down to whole pages, so the split
        # lands on exactly the real pools rather than a page short.
        share = (b["flatcake_dram"] + span / 2) / dram
    elif mode == "tiered":
        dram = b["host"]
    return EmulatorConfig(
        mode=mode, l3=l3, layers=geometry["layers"], page_tokens=geometry["page_tokens"],
        bytes_per_token_layer=geometry["page_bytes"] // geometry["page_tokens"], hbm_bytes=b["device"],
        dram_bytes=dram, ssd_bytes=b["flatcake_ssd"], scope_file_bytes=b["ssd_file"], storage_dram_share=share,
        prefill_tokens_per_s=rates.prefill_tokens_per_s, decode_tokens_per_s=rates.decode_tokens_per_s,
        prefetch_policy=cfg.prefetch_policy, placement=cfg.placement, drop_page_cache=l3 != "hicache-file",
    )  # fmt: skip


def tiers(system: str, records: list[dict[str, Any]]) -> dict[str, int]:
    """Cached tokens by SGLang's tiers from the emulator's per-request hits (HBM, DRAM, SSD): its DRAM is the
    host tier under SGLang's rules, FlatCake's pool (storage) in the native what-if."""
    ok = [r for r in records if r["ok"] and r["ttft_s"] is not None]
    hits = {m: sum(int((r.get("hit_tokens") or {}).get(m, 0)) for r in ok) for m in ("hbm", "dram", "ssd")}
    if SYSTEMS[system][0] == "flatcake-native":
        return {"device": hits["hbm"], "host": 0, "storage": hits["dram"] + hits["ssd"]}
    return {"device": hits["hbm"], "host": hits["dram"], "storage": hits["ssd"]}


def _generate(url: str, input_ids: list[int]) -> None:
    body = json.dumps({"input_ids": input_ids, "sampling_params": {"max_new_tokens": 8}}).encode()
    request = urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        r.read()


def run_point(system: str, qps: float, cfg: ServeConfig, model: Path, trace: Path, where: Path,
              log: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """One cold point of an emulated system: the slice replayed as ``serve.run_point`` replays it."""
    where.mkdir(parents=True)
    geometry = kv_geometry(model)
    emu = mirror(system, cfg, geometry, calibrated_rates(Path(cfg.calibration)))
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    data = where / "emu"
    data.mkdir()
    with emulated.running(dataclasses.replace(emu, data_dir=str(data)), data, where) as emulator:
        log(f"  {system} (emulated {emu.mode}) at {qps:g} QPS: replaying ...")
        # The real point's cold probe, so the pools hold what the real server's hold when the replay starts.
        _generate(emulator.url, [random.Random(99).randrange(3, vocab) for _ in range(cfg.probe_tokens)])
        server, helpers = [emulator.emulator.pid], [emulator.agent.pid] if emulator.agent else []
        cpu = cpu_seconds(server), cpu_seconds(helpers)
        started = time.monotonic()
        rc = run_locust(LoadgenConfig(host=emulator.url, trace=str(trace), qps=qps, system=system,
                                      results=str(where / "results.jsonl"), api="sglang", max_output=cfg.max_output,
                                      vocab=vocab, users=16, margin_s=600.0))  # fmt: skip
        replay_s = time.monotonic() - started
        cpu_s = {"server": cpu_seconds(server) - cpu[0], "backend_processes": cpu_seconds(helpers) - cpu[1]}
        if rc not in (0, 1):  # 1: Locust saw failed requests, which the records show
            raise RuntimeError(f"locust exited with {rc}")
        emulator.save_metrics(where)
    records = _records(where)
    restored = agent_counters(where / "agent.prom") if emulator.agent else None
    pages = {m: int(n) for m, n in restored["restored_pages"].items()} if restored else None
    row = summarize(system, qps, records, replay_s, False, 0, pages, tiers(system, records))
    mode, l3, real = SYSTEMS[system]
    row.update(cpu_s=cpu_s, emulated={"mode": mode, "l3": l3 if mode == "tiered" else None, "counterpart": real,
                                      "dram_bytes": emu.dram_bytes, "host_tier_bytes": emu.host_tier_bytes,
                                      "storage_dram_bytes": emu.l3_dram_bytes, "hbm_bytes": emu.hbm_bytes,
                                      "ssd_bytes": emu.ssd_bytes, "prefill_tokens_per_s": emu.prefill_tokens_per_s,
                                      "decode_tokens_per_s": emu.decode_tokens_per_s})  # fmt: skip
    return row
