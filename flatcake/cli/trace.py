"""``flatcake trace``: trace statistics and synthesis."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from flatcake.cli.common import _write_json
from flatcake.errors import ConfigError

if TYPE_CHECKING:
    from flatcake.cli.common import Subparsers


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


def add(sub: Subparsers) -> None:
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
