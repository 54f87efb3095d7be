"""``flatcake report``: a run's report with plots."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flatcake.cli.common import Subparsers


def _report(args: argparse.Namespace) -> int:
    from flatcake.loadgen.report import build as R

    print(R.format_table(R.write(args.runs, args.out, context=args.context)))
    return 0


def add(sub: Subparsers) -> None:
    """``flatcake report``: reports from replay runs."""
    rep = sub.add_parser("report", help="report.json, Markdown/HTML and plots from replay runs")
    rep.add_argument("runs", help="directory of <system>/qps-<q>/results*.jsonl")
    rep.add_argument("--out", help="output directory (default: the runs directory)")
    rep.add_argument("--context", help="where the runs came from (cluster, namespace), shown in the report")
    rep.set_defaults(func=_report)
