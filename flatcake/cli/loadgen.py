"""``flatcake loadgen``: replay a trace against an endpoint, and the staging benchmark."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from flatcake.cli.common import API_CHOICES, API_HELP, _csv

if TYPE_CHECKING:
    from flatcake.cli.common import Subparsers


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


def add(sub: Subparsers) -> None:
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
        "staging",
        aliases=["bench"],  # its first name, which charts of earlier releases still run
        help="a staging-cluster run: Locust master or worker over every QPS point, then the report",
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
