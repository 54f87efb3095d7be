"""``flatcake simulate``: the cluster simulator."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from flatcake.cli.common import _csv, _write_json
from flatcake.errors import ConfigError
from flatcake.loadgen import names
from flatcake.loadgen.report import capacity
from flatcake.node_agent.constants import PLACEMENT_MODES

if TYPE_CHECKING:
    from flatcake.cli.common import Subparsers


def _simulate(args: argparse.Namespace) -> int:
    from flatcake.loadgen.simulate import results as sr
    from flatcake.loadgen.simulate import run as sim

    if args.validate:
        return _simulate_validate(args)
    if args.sweep == "load" and args.qps is not None:
        raise ConfigError("--qps: --sweep load chooses its own rates; give --ladder START,STOP instead")
    if args.sweep != "load" and (args.slo_ttft is not None or args.ladder is not None):
        raise ConfigError("--slo-ttft and --ladder apply to --sweep load only")
    if args.sweep and args.qps is not None and len(args.qps) != 1:
        raise ConfigError(f"--qps: --sweep runs one rate, {len(args.qps)} given")

    sizes = {"dram_bytes": ("--dram", args.dram), "ssd_bytes": ("--ssd", args.ssd), "hbm_bytes": ("--hbm", args.hbm)}
    given: dict[str, object] = {k: sim.parse_size(text, flag) for k, (flag, text) in sizes.items() if text is not None}
    fields = ("trace", "limit", "nodes", "gpus_per_node", "model", "gpu", "qps", "systems", "device", "scheduler",
              "prefetch_policy", "workers", "cross_node_gbps", "storage_dram_share", "wait_rule")  # fmt: skip
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
    if args.sweep == "load":
        return _simulate_load(args, cfg)
    if args.qps is None:
        cfg = dataclasses.replace(cfg, qps=(1.0,))
    out = Path(args.out or "results/simulate")
    report = sweeps.run(args.sweep, cfg, out, systems=args.systems, quiet=args.quiet,
                        log=lambda m: print(m, file=sys.stderr))  # fmt: skip
    print(sweeps.format_table(report))
    report["plot"] = sweeps.plot(report, out / f"sweep-{args.sweep}.png")
    _write_json(args.json or str(out / f"sweep-{args.sweep}.json"), report)
    return 0


def _simulate_load(args: argparse.Namespace, cfg: object) -> int:
    from flatcake.loadgen.simulate import load

    out = Path(args.out or "results/simulate")
    ladder = capacity.DEFAULT_LADDER
    if args.ladder is not None:
        if len(args.ladder) != 2:
            raise ConfigError(f"--ladder: give START,STOP (two rates), not {len(args.ladder)} values")
        ladder = (args.ladder[0], args.ladder[1])
        if not 0 < ladder[0] <= ladder[1]:
            raise ConfigError(f"--ladder: {args.ladder} must be 0 < START <= STOP")
    report = load.run(cfg, out, slo_s=args.slo_ttft, ladder=ladder, quiet=args.quiet,  # type: ignore[arg-type]
                      log=lambda m: print(m, file=sys.stderr))  # fmt: skip
    print(capacity.format_table(report["capacity"]))
    _write_json(args.json or str(out / "sweep-load.json"), report)
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


def add(sub: Subparsers) -> None:
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
    simp.add_argument("--wait-rule", dest="wait_rule", choices=("cost", "always"),
                      help="flatcake-native: cost (default) waits for an SSD load only where computing the tokens "
                           "would take longer; always waits for every load, as the paper's FC-MAS")  # fmt: skip
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
    simp.add_argument("--sweep", choices=["load", "dram-ssd", "placement", "gap", "staging", "long-sessions"],
                      help="load: every system on a load ladder to its knee, goodput at --slo-ttft; the others "
                           "vary one knob (at one --qps, default 1.0): JSON and a plot in --out")  # fmt: skip
    simp.add_argument("--slo-ttft", type=float, dest="slo_ttft", metavar="S",
                      help="--sweep load: the P90 TTFT objective in seconds (default: the cold prefill of "
                           "the trace's P90 prompt on --gpu)")  # fmt: skip
    simp.add_argument("--ladder", type=_csv(float, "--ladder"), metavar="START,STOP",
                      help=f"--sweep load: the rates climbed, on a 1-1.25-1.5-2-2.5-3-4-5-6-8 series "
                           f"(default {','.join(f'{q:g}' for q in capacity.DEFAULT_LADDER)})")  # fmt: skip
    simp.add_argument("--validate", action="store_true",
                      help="run one small case through the emulator and the simulator and compare them "
                           "(--limit 100, --qps 2, --gpu a100, --systems flatcake unless given)")  # fmt: skip
    simp.set_defaults(func=_simulate)
